"""``mindspeed-flow train CONFIG --search-baselines``: every co-located baseline at its best
configuration, searched on this machine in one launch of the ranks.

The grid (:func:`search_grid`): for each baseline family - ``baseline`` (MindSpeed-MM style:
padded microbatches, dense masks, Conv3d, ViT in stage 0, Megatron's 1F1B), ``baseline-thd``
(packs through megatron-core's THD path, Conv->Matmul, ViT in stage 0, 1F1B) and
``three-phase`` (``baseline-thd``'s data path under the --hetero-parallel / MIMO schedule) -
every pipeline size PP that divides the world and the LLM's layers (DP = world / PP), and for
the padded ``baseline`` every micro-batch size of :data:`MICRO_BATCH_SIZES` too (a packed
run's microbatch is one pack: its size is ``data.capacity``, the same for every run).  Every
grid run trains the same samples from the same initialisation for ``steps`` steps, like the
job's other runs; ``flowtrain`` trains beside them.

:func:`best_of_search` picks each family's fastest configuration (samples/s over the
measured steps) and hands it back under the family's name, so the report compares FlowTrain
with every baseline at its best; ``baseline_search.json`` and the lines of
:func:`search_lines` keep the whole grid.  One run per configuration on a shared machine:
the ranking of close configurations can swap from run to run (docs/train.md).
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING, Any, Sequence

from mindspeed_flow.train.runs import BASELINE, BASELINE_THD, THD_FEATURES, THREE_PHASE, THREE_PHASE_FEATURES
from mindspeed_flow.train.runs import RunFeatures, RunSpec

if TYPE_CHECKING:
    from mindspeed_flow.train.config import TrainConfig
    from mindspeed_flow.train.metrics import RunRecord

MICRO_BATCH_SIZES = (1, 2, 4)
FAMILIES = {BASELINE: RunFeatures(), BASELINE_THD: THD_FEATURES, THREE_PHASE: THREE_PHASE_FEATURES}
_SEP = "@"  # never in a catalogue run's name: family@pp<P>[-mbs<M>]


def pipeline_sizes(cfg: "TrainConfig") -> list[int]:
    """Every PP a co-located run of ``cfg`` can take: it divides the world and the LLM has a
    layer for each stage."""
    world = cfg.layout.world_size
    return [pp for pp in range(1, world + 1) if world % pp == 0 and pp <= cfg.model.llm_layers]


def grid_name(family: str, pp: int, micro_batch_size: int | None = None) -> str:
    return f"{family}{_SEP}pp{pp}" + ("" if micro_batch_size is None else f"-mbs{micro_batch_size}")


def family_of(name: str) -> str | None:
    """The baseline family of a grid run's name (``None``: not a grid run)."""
    family, sep, _ = name.partition(_SEP)
    return family if sep else None


def search_grid(cfg: "TrainConfig") -> list[RunSpec]:
    """The search's runs, family by family, PP then micro-batch size ascending."""
    specs = []
    for family, features in FAMILIES.items():
        for pp in pipeline_sizes(cfg):
            layout = dataclasses.replace(cfg.layout, baseline_pp=pp, best_baseline_pp=None)
            sizes = MICRO_BATCH_SIZES if not features.packing else (None,)
            for mbs in sizes:
                data = cfg.data if mbs is None else dataclasses.replace(cfg.data, micro_batch_size=mbs)
                specs.append(RunSpec(grid_name(family, pp, mbs), features,
                                     dataclasses.replace(cfg, layout=layout, data=data)))
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
                "configs": {r.name.partition(_SEP)[2]: {"samples_per_s": r.samples_per_s(),
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


__all__ = ["FAMILIES", "MICRO_BATCH_SIZES", "best_of_search", "family_of", "grid_name", "pipeline_sizes",
           "search_grid", "search_json", "search_lines"]
