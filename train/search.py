"""``mindspeed-flow train CONFIG --search-baselines``: every co-located baseline at its best
configuration, searched on this machine in one launch of the ranks.

The grid (:func:`search_grid`): for each baseline family - ``baseline`` (MindSpeed-MM style:
padded microbatches, dense masks, Conv3d, ViT in stage 0, Megatron's 1F1B), ``baseline-thd``
(packs through megatron-core's THD path, Conv->Matmul, ViT in stage 0, 1F1B) and
``three-phase`` (``baseline-thd``'s data path under the --hetero-parallel / MIMO schedule) -
every pipeline size PP that divides the world and the LLM's layers (DP = world / PP; the
config's ``search.pp`` narrows them), and for the padded ``baseline`` every micro-batch size
of ``search.micro_batch_sizes`` too (default 1, 2, 4; a packed run's microbatch is one pack:
its size is ``data.capacity``, the same for every run).  Every
grid run trains the same samples from the same initialisation for ``steps`` steps, like the
job's other runs; ``flowtrain`` trains beside them.

:func:`best_of_search` picks each family's fastest configuration (samples/s over the
measured steps) and hands it back under the family's name, so the report compares FlowTrain
with every baseline at its best; ``baseline_search.json`` and the lines of
:func:`search_lines` keep the whole grid.  :func:`best_config_lines` turns the winners into
the ``layout.best_*`` keys (``best_baselines.yaml`` in the report, printed too) that make the
default job and ``--ablation`` run each baseline at its best.  One run per configuration on a
shared machine: the ranking of close configurations can swap from run to run (docs/train.md).
"""

from __future__ import annotations

import dataclasses
import re
from typing import TYPE_CHECKING, Any, Sequence

from mindspeed_flow.train.runs import BASELINE, BASELINE_THD, THD_FEATURES, THREE_PHASE, THREE_PHASE_FEATURES
from mindspeed_flow.train.runs import RunFeatures, RunSpec

if TYPE_CHECKING:
    from mindspeed_flow.train.config import TrainConfig
    from mindspeed_flow.train.metrics import RunRecord

FAMILIES = {BASELINE: RunFeatures(), BASELINE_THD: THD_FEATURES, THREE_PHASE: THREE_PHASE_FEATURES}
_SEP = "@"  # never in a catalogue run's name: family@pp<P>[-mbs<M>]
_CONFIG = re.compile(r"pp(\d+)(?:-mbs(\d+))?")


def pipeline_sizes(cfg: "TrainConfig") -> list[int]:
    """The PPs the grid tries: ``search.pp``, or every one a co-located run of ``cfg`` can take."""
    return list(cfg.search.pp) if cfg.search.pp is not None else cfg.pipeline_sizes()


def grid_name(family: str, pp: int, micro_batch_size: int | None = None) -> str:
    return f"{family}{_SEP}pp{pp}" + ("" if micro_batch_size is None else f"-mbs{micro_batch_size}")


def family_of(name: str) -> str | None:
    """The baseline family of a grid run's name (``None``: not a grid run)."""
    family, sep, _ = name.partition(_SEP)
    return family if sep else None


def config_of(name: str) -> tuple[int, int | None]:
    """A grid run's PP and micro-batch size (``None``: a packed run) from its name."""
    match = _CONFIG.fullmatch(name.partition(_SEP)[2])
    if match is None:
        raise ValueError(f"{name!r} is not a grid run's name (family{_SEP}pp<P>[-mbs<M>])")
    return int(match[1]), None if match[2] is None else int(match[2])


def search_grid(cfg: "TrainConfig") -> list[RunSpec]:
    """The search's runs, family by family, PP then micro-batch size ascending."""
    specs = []
    for family, features in FAMILIES.items():
        for pp in pipeline_sizes(cfg):
            for mbs in (cfg.search.micro_batch_sizes if not features.packing else (None,)):
                specs.append(RunSpec(grid_name(family, pp, mbs), features, cfg.co_located(pp, mbs)))
    return specs


def best_of_search(records: Sequence["RunRecord"]) -> list["RunRecord"]:
    """Each family's fastest grid run under the family's name (its layout text names the
    configuration it won with), in :data:`FAMILIES` order."""
    best = []
    for family in FAMILIES:
        runs = [r for r in records if family_of(r.name) == family]
        if runs:
            winner = max(runs, key=lambda r: r.samples_per_s())
            config = winner.name.partition(_SEP)[2]
            best.append(dataclasses.replace(winner, name=family, layout=f"{winner.layout} [best: {config}]"))
    return best


def search_json(records: Sequence["RunRecord"]) -> dict[str, Any]:
    """``baseline_search.json``: every grid run's rates and layout by family, and the best."""
    out: dict[str, Any] = {}
    for family in FAMILIES:
        runs = [r for r in records if family_of(r.name) == family]
        if runs:
            out[family] = {
                "configs": {r.name.partition(_SEP)[2]: {"pp": config_of(r.name)[0],
                                                        "micro_batch_size": config_of(r.name)[1],
                                                        "samples_per_s": r.samples_per_s(),
                                                        "tokens_per_s": r.tokens_per_s(),
                                                        "padding_fraction": r.padding_fraction(),
                                                        "layout": r.layout} for r in runs},
                "best": max(runs, key=lambda r: r.samples_per_s()).name.partition(_SEP)[2]}
    return out


def search_lines(records: Sequence["RunRecord"]) -> list[str]:
    """The grid as the terminal prints it: per family, each configuration's samples/s and its
    ratio to the family's best (the best marked)."""
    lines = ["baseline search (samples/s over the measured steps; one run per configuration):"]
    for family, entry in search_json(records).items():
        best = entry["configs"][entry["best"]]["samples_per_s"]
        cells = [f"{config} {numbers['samples_per_s']:.2f}" + (" (best)" if config == entry["best"] else
                                                               f" ({numbers['samples_per_s'] / best:.2f}x)")
                 for config, numbers in entry["configs"].items()]
        lines.append(f"  {family}: " + ", ".join(cells))
    return lines


def best_config_lines(cfg: "TrainConfig", records: Sequence["RunRecord"]) -> list[str]:
    """The ``layout.best_*`` keys of each searched family's best configuration, as YAML lines
    to paste into the config: ``best_thd_pp``, ``best_three_phase_pp``, and
    ``best_baseline_pp`` / ``best_baseline_micro_batch_size`` (both ``null`` when the padded
    baseline's best is the configured baseline itself: no second baseline run)."""
    keys = {BASELINE: "best_baseline_pp", BASELINE_THD: "best_thd_pp", THREE_PHASE: "best_three_phase_pp"}
    lines = ["layout:  # each baseline at its best (mindspeed-flow train --search-baselines)"]
    for family, entry in search_json(records).items():
        best = entry["configs"][entry["best"]]
        pp, mbs = best["pp"], best["micro_batch_size"]
        note = f"  # {entry['best']}: {best['samples_per_s']:.2f} samples/s"
        if family == BASELINE:
            if (pp, mbs) == (cfg.layout.baseline_pp, cfg.data.micro_batch_size):
                pp = mbs = None
                note += ", the configured baseline itself"
            lines.append(f"  {keys[family]}: {_yaml(pp)}{note}")
            lines.append(f"  best_baseline_micro_batch_size: {_yaml(mbs)}")
        else:
            lines.append(f"  {keys[family]}: {pp}{note}")
    return lines


def _yaml(value: int | None) -> str:
    return "null" if value is None else str(value)


__all__ = ["FAMILIES", "best_config_lines", "best_of_search", "config_of", "family_of", "grid_name",
           "pipeline_sizes", "search_grid", "search_json", "search_lines"]
