"""Which regions a job's step is composed of: Megatron's own layout, a YAML file, or
MindSpeed-MM's VLM split; or, from the same file, a decoupled layout.

A layout is the input of :func:`.compose`; the runtime binds each (region, stage) this rank
visits to one of its model chunks, in model order (:func:`local_visits`).  A layout file
holds one of three forms: ``regions:`` (:func:`load_layout`), ``vlm:`` (MindSpeed-MM's split,
read by the Megatron schedule adapter) or ``decoupled:`` (:func:`load_decoupled`: encoder
ranks of their own feeding the backbone's pipeline through the pool, a
:class:`~mindspeed_flow.decoupled.DecoupledLayout`, whose step is not regions of one
pipeline).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional, Sequence

from ..schedule import (GPipe, Interleaved1F1B, OneFOneB, Region, ScheduleError, Transpose, ZeroBubbleH1,
                        compose)
from ..schedule.actions import COMPUTE
from ..schedule.plan import Plan
from ..decoupled import DecoupledLayout, LayoutError
from ..flow.encoder_cost import EncoderCost
from ..flow.errors import EncoderCostError
from ..schedule.regions import BACKBONE_REGION, ENCODER_REGION, MEGATRON_REGION
from ..typed_yaml import build, read_yaml
from .executor import RuntimeOptions
from .transport import WaitPolicy

__all__ = ["MEGATRON_REGION", "load_decoupled", "load_layout", "local_visits", "megatron_layout", "plan_for",
           "vlm_layout"]
_SHARDED = {"1f1b": OneFOneB, "gpipe": GPipe, "zb-h1": ZeroBubbleH1}
FORMS = ("regions", "vlm", "decoupled")  # the layout file's forms: exactly one of them


def megatron_layout(stages: int, chunks: int = 1) -> tuple[Region, ...]:
    """Megatron's own schedule as one region: 1F1B, or interleaved 1F1B with ``chunks``
    model chunks per rank; turning the feature on with it changes no number."""
    skeleton = OneFOneB(stages=stages) if chunks == 1 else Interleaved1F1B(stages=stages, chunks_per_rank=chunks)
    return (Region(MEGATRON_REGION, stages * chunks, skeleton),)


def vlm_layout(vision_layers: Sequence[int], text_layers: Sequence[int], *, transpose: bool = False,
               vision_trainable: bool = True, max_in_flight: int | None = None) -> tuple[Region, ...]:
    """Regions from MindSpeed-MM's ``pipeline_num_layers`` lists (``vision_encoder`` and
    ``text_decoder``, one entry per pipeline stage).

    Without ``transpose`` it is what MindSpeed-MM runs: each stage's chunk holds its share of
    both, one 1F1B region (Megatron's layout).  With ``transpose`` the ViT becomes a
    replicated ``Transpose`` region in front of a 1F1B text decoder cut by ``text_layers``
    (the ``<transpose, 1f1b>`` composition; every rank then needs the whole ViT).
    """
    if len(vision_layers) != len(text_layers):
        raise ScheduleError(
            f"vision_encoder.pipeline_num_layers has {len(vision_layers)} stages but "
            f"text_decoder.pipeline_num_layers has {len(text_layers)}")
    stages = len(text_layers)
    if not transpose:
        return megatron_layout(stages)
    if any(n < 1 for n in text_layers):
        raise ScheduleError(f"text_decoder.pipeline_num_layers {list(text_layers)}: every stage needs a layer "
                            "when the ViT is transposed")
    return (
        Region(ENCODER_REGION, max(1, sum(vision_layers)), Transpose(max_in_flight=max_in_flight),
               trainable=vision_trainable),
        Region(BACKBONE_REGION, sum(text_layers), OneFOneB(stages=stages, layers=tuple(text_layers))),
    )


def load_layout(path: str | Path, stages: int) -> tuple[Region, ...]:
    """Regions from a YAML file (``--flow-schedule-config``)::

        regions:
          - {name: vit, layers: 2, skeleton: transpose, trainable: false, max_in_flight: 2}
          - {name: llm, layers: 4, skeleton: 1f1b}          # stages: the pipeline size
          # skeleton: 1f1b | gpipe | zb-h1 | interleaved (chunks: N) | transpose

    Errors name the file and the region.
    """
    path = Path(path)
    doc = read_yaml(path, error=ScheduleError, what="the schedule layout")
    if _form(doc, path) == "decoupled":
        raise ScheduleError(
            f"{path}: decoupled: a decoupled layout (encoder ranks of their own feeding the backbone through the "
            "pool) is a step of its own, not regions of one pipeline: it runs under the decoupled step "
            "(mindspeed_flow.decoupled; runtime.layout.load_decoupled reads it), not under this schedule")
    entries = (doc or {}).get("regions") if isinstance(doc, dict) else None
    if not isinstance(entries, list) or not entries:
        raise ScheduleError(f"{path}: expected a non-empty `regions:` list")
    return tuple(_region(entry, i, path, stages) for i, entry in enumerate(entries))


def _form(doc: Any, path: Path) -> str | None:
    """Which of :data:`FORMS` the file holds (``None``: none of them); two are refused."""
    found = [form for form in FORMS if isinstance(doc, dict) and form in doc]
    if len(found) > 1:
        raise ScheduleError(f"{path}: a layout file holds one of {', '.join(f'{f}:' for f in FORMS)}; "
                            f"this one has {' and '.join(f'{f}:' for f in found)}")
    return found[0] if found else None


def _at_least_one(section: Any, names: Sequence[str]) -> None:
    bad = {name: getattr(section, name) for name in names if getattr(section, name) < 1}
    if bad:
        name, value = next(iter(bad.items()))
        raise ScheduleError(f"{name} must be >= 1, got {value}")


@dataclass(frozen=True)
class _EncoderSizes:
    """``decoupled.encoder``: ``dp`` encoder replicas over the whole job, ``tp`` ranks each."""

    dp: int = 1
    tp: int = 1

    def __post_init__(self) -> None:
        _at_least_one(self, ("dp", "tp"))


@dataclass(frozen=True)
class _BackboneSizes:
    """``decoupled.backbone``: ``dp`` pipelines of ``pp`` stages of ``tp`` ranks."""

    pp: int
    dp: int = 1
    tp: int = 1

    def __post_init__(self) -> None:
        _at_least_one(self, ("pp", "dp", "tp"))


@dataclass(frozen=True)
class _DecoupledSection:
    """The ``decoupled:`` form as written (``max_in_flight``: microbatches an encoder
    replica may run ahead of its backward; ``null``: unbounded)."""

    encoder: _EncoderSizes
    backbone: _BackboneSizes
    max_in_flight: Optional[int] = DecoupledLayout.__dataclass_fields__["max_ahead"].default
    flow: bool = False  # FlowTrain's flow: per-sample pool entries, encoder batches of its own
    flow_encoder_batch_patches: int = DecoupledLayout.__dataclass_fields__["flow_encoder_batch_patches"].default
    flow_encoder_cost: Any = None  # the calibration JSON's path or {quadratic, linear, per_image}; null: patches
    flow_max_in_flight: Optional[int] = None  # a frozen encoder's entries ahead, at most (null: the pool's room)
    flow_repack: bool = False  # the LLM's microbatches made from the step's samples, not the loader's packs

    def __post_init__(self) -> None:
        if self.max_in_flight is not None and self.max_in_flight < 1:
            raise ScheduleError(f"max_in_flight must be >= 1 or null (unbounded), got {self.max_in_flight}")
        if self.flow_max_in_flight is not None and self.flow_max_in_flight < 1:
            raise ScheduleError(f"flow_max_in_flight must be >= 1 or null (unbounded), got {self.flow_max_in_flight}")
        if self.flow_repack and not self.flow:
            raise ScheduleError("flow_repack: true regroups the flow's samples: it needs flow: true")
        if self.encoder.dp % self.backbone.dp:
            raise ScheduleError(f"encoder.dp {self.encoder.dp} (encoder replicas in the job) does not split over "
                                f"backbone.dp {self.backbone.dp}: every backbone replica needs as many")


def load_decoupled(path: str | Path) -> Optional[DecoupledLayout]:
    """The ``decoupled:`` form of a layout file, or ``None`` when the file holds another::

        decoupled:
          encoder: {dp: 2, tp: 1}          # encoder replicas over the whole job, TP ranks each
          backbone: {dp: 2, tp: 1, pp: 2}  # pipelines, TP ranks per stage, stages
          max_in_flight: 2                 # microbatches ahead of their backward (null: unbounded)
          flow: true                       # optional: FlowTrain's flow instead of the lockstep plan
          flow_encoder_batch_patches: 1024 # optional: ViT patches per encoder batch under the flow
          flow_encoder_cost: cost.json     # optional: the encoder's batch cost (see below; default: patches)
          flow_max_in_flight: 64           # optional: a frozen ViT's entries ahead (null: the pool's room)
          flow_repack: true                # optional: the LLM's microbatches repacked from the samples (group_step)

    ``flow_encoder_cost`` is the JSON ``scripts/calibrate_cost_model.py`` writes (its
    ``encoder_cost``; a relative path is the layout file's folder's) or the terms inline,
    ``{quadratic: .., linear: .., per_image: ..}``; an encoder batch then costs at most what
    one image of ``flow_encoder_batch_patches`` patches costs under it.
    The layer counts are the model's (:meth:`~mindspeed_flow.decoupled.DecoupledLayout.with_layers`).
    A typo, a wrong type, a size below one or an encoder that does not split over the
    backbone replicas is refused naming the file and the key."""
    path = Path(path)
    doc = read_yaml(path, error=ScheduleError, what="the schedule layout")
    if _form(doc, path) != "decoupled":
        return None
    spec = build(_DecoupledSection, doc["decoupled"], path=path, where="decoupled", error=ScheduleError)
    try:
        return DecoupledLayout(encoder_dp=spec.encoder.dp // spec.backbone.dp, encoder_tp=spec.encoder.tp,
                               backbone_pp=spec.backbone.pp, backbone_tp=spec.backbone.tp,
                               backbone_dp=spec.backbone.dp, max_ahead=spec.max_in_flight, flow=spec.flow,
                               flow_encoder_batch_patches=spec.flow_encoder_batch_patches,
                               flow_encoder_cost=_encoder_cost(spec.flow_encoder_cost, path),
                               flow_max_in_flight=spec.flow_max_in_flight, flow_repack=spec.flow_repack)
    except LayoutError as exc:  # the section's own checks come first; this is a safety net
        raise ScheduleError(f"{path}: decoupled: {exc}") from None


def _encoder_cost(value: Any, path: Path) -> Optional[EncoderCost]:
    """``decoupled.flow_encoder_cost`` as an :class:`~mindspeed_flow.flow.EncoderCost` (``None``
    when unset): a calibration file (relative to the layout file's folder) or inline terms;
    refused naming the layout file and the key."""
    if value is None:
        return None
    key = f"{path}: decoupled.flow_encoder_cost"
    try:
        if isinstance(value, str):
            return EncoderCost.load(path.parent / value)
        return EncoderCost.from_terms(value, "inline terms")
    except EncoderCostError as exc:
        raise ScheduleError(f"{key}: {exc}") from None


@dataclass(frozen=True)
class _RuntimeSection:
    """The layout file's optional ``runtime:`` section as written (unset: the defaults of
    :class:`~.transport.WaitPolicy` and the plan's own send bound)."""

    timeout_s: Optional[float] = None
    abort_poll_s: Optional[float] = None
    max_pending_sends: Optional[int] = None


def load_runtime_options(path: str | Path) -> Optional[RuntimeOptions]:
    """The ``runtime:`` section of a layout file (``timeout_s``: how long a wait may take
    before the step fails naming the action; ``abort_poll_s``; ``max_pending_sends``), or
    ``None`` when the file has none.  Read with the same reader as the regions, so a typo
    or a wrong type is refused naming the file and the key."""
    path = Path(path)
    doc = read_yaml(path, error=ScheduleError, what="the schedule layout")
    section = doc.get("runtime") if isinstance(doc, dict) else None
    if section is None:
        return None
    spec = build(_RuntimeSection, section, path=path, where="runtime", error=ScheduleError)
    defaults = WaitPolicy()
    wait = WaitPolicy(timeout_s=defaults.timeout_s if spec.timeout_s is None else spec.timeout_s,
                      abort_poll_s=defaults.abort_poll_s if spec.abort_poll_s is None else spec.abort_poll_s)
    return RuntimeOptions(wait=wait, max_pending_sends=spec.max_pending_sends)


@dataclass(frozen=True)
class _RegionEntry:
    """One entry of ``regions:`` as written (``stages``: the job's pipeline size when unset)."""

    name: str
    layers: int
    skeleton: str = "1f1b"
    trainable: bool = True
    stages: Optional[int] = None
    chunks: int = 2
    max_in_flight: Optional[int] = None
    pipeline_num_layers: Optional[tuple[int, ...]] = None


def _region(entry: Any, i: int, path: Path, stages: int) -> Region:
    if not isinstance(entry, dict) or "name" not in entry or "layers" not in entry:
        raise ScheduleError(f"{path}: regions[{i}]: needs at least `name` and `layers`")
    where = f"regions[{i}] ({entry['name']})"
    spec = build(_RegionEntry, entry, path=path, where=where, error=ScheduleError)
    kind, layers = spec.skeleton.lower(), spec.pipeline_num_layers
    n = stages if spec.stages is None else spec.stages
    try:
        if kind in _SHARDED:
            skeleton = _SHARDED[kind](stages=n, layers=layers)
        elif kind == "interleaved":
            skeleton = Interleaved1F1B(stages=n, layers=layers, chunks_per_rank=spec.chunks)
        elif kind == "transpose":
            skeleton = Transpose(max_in_flight=spec.max_in_flight)
        else:
            raise ScheduleError(f"unknown skeleton {kind!r}: 1f1b, gpipe, zb-h1, interleaved or transpose")
        return Region(spec.name, spec.layers, skeleton, trainable=spec.trainable)
    except (ScheduleError, TypeError, ValueError) as exc:
        raise ScheduleError(f"{path}: {where}: {exc}") from exc


def plan_for(regions: Sequence[Region], num_microbatches: int) -> Plan:
    """The eager plan the runtime executes."""
    return compose(regions, num_microbatches, semantics="eager")


def local_visits(plan: Plan, rank: int) -> list[tuple[str, int]]:
    """The (region, stage) pairs ``rank`` computes, in model order: the order in which a
    Megatron model list holds this rank's chunks."""
    order = {r.name: i for i, r in enumerate(plan.regions)}
    seen = {(a.region, a.stage) for a in plan.programs[rank] if a.microbatch is not None and a.kind in COMPUTE}
    return sorted(seen, key=lambda rs: (order[rs[0]], rs[1]))
