"""The job's configuration: plain dataclasses, one per YAML section, read with
:func:`load_config`.

Every key of the YAML file must name a field (a typo is an error, not a silent default),
and every value must have the field's type; errors name the file and the dotted key.
Unset keys keep the defaults below, which are the demo's (``configs/train/demo.yaml``).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional

from mindspeed_flow.calibration_file import read_calibrated_terms
from mindspeed_flow.flow import EncoderCost
from mindspeed_flow.flow.errors import EncoderCostError
from mindspeed_flow.packing import CostModel
from mindspeed_flow.train.errors import ConfigError
from mindspeed_flow.train.model import ModelConfig
from mindspeed_flow.typed_yaml import build, read_yaml

POOL_BACKENDS = ("local", "shm", "torch")
# layout keys that count ranks or microbatches: each must be >= 1 (checked at load, naming the key)
LAYOUT_POSITIVE = ("world_size", "baseline_pp", "text_only_pp", "flow_encoder_dp", "flow_backbone_pp",
                   "flow_backbone_dp", "max_ahead")


LLM_COST_TERMS = ("linear", "quadratic", "constant")  # the LLM's terms of a CostModel (what the grouping uses)


@dataclass(frozen=True)
class LlmCostConfig:
    """The LLM's cost of a microbatch, ``constant + linear * sum(l) + quadratic * sum(l^2)``
    over its samples' token counts ``l`` (:class:`~mindspeed_flow.packing.CostModel`): the
    flow (``layout.flow: true``, ``train/stream.py``) fills and deals the backbone's
    microbatches by it, so with attention's ``sum l^2`` term one long sample is not priced
    like many short ones of the same token count.  Units are free (only ratios matter).

    ``file``: the JSON ``scripts/calibrate_cost_model.py`` writes (its ``model``; the
    encoder terms in it are kept, the grouping does not use them), read and checked when the
    config loads, relative to the working directory like ``data.path``.  Otherwise the three
    coefficients; ``quadratic: null`` is ``1 / data.capacity``: the defaults are the
    loader's default cost model (``linear=1, quadratic=1/capacity``)."""

    file: Optional[str] = None
    linear: float = 1.0
    quadratic: Optional[float] = None
    constant: float = 0.0

    @property
    def coefficients_set(self) -> bool:
        return (self.linear, self.quadratic, self.constant) != (1.0, None, 0.0)


@dataclass(frozen=True)
class EncoderCostConfig:
    """The encoder's cost of a batch, ``quadratic * sum(p^2) + linear * sum(p) + per_image *
    images`` over its images' patch counts ``p`` (:class:`~mindspeed_flow.flow.EncoderCost`):
    the flow (``layout.flow: true``, ``train/stream.py``) cuts the encoder's batches by it,
    each batch costing at most what one image of ``layout.flow_encoder_batch_patches``
    patches costs.  The default (``linear: 1``) is patches: a batch holds that many patches.

    ``file``: the JSON ``scripts/calibrate_cost_model.py`` writes (its ``encoder_cost``),
    read and checked when the config loads, relative to the working directory like
    ``data.path``.  Otherwise the three coefficients (units are free: only ratios matter)."""

    file: Optional[str] = None
    quadratic: float = 0.0
    linear: float = 1.0
    per_image: float = 0.0

    @property
    def coefficients_set(self) -> bool:
        return (self.quadratic, self.linear, self.per_image) != (0.0, 1.0, 0.0)


@dataclass(frozen=True)
class DataConfig:
    """The corpus at ``path`` and how it is cut into steps.  ``make_demo: true`` (the demo
    and CI configs) makes the demo corpus there with ``make_demo_corpus(path, samples,
    seed)`` when ``path`` does not exist; otherwise a missing ``path`` is an error naming it
    (a typo must not train on generated data).  Each step is ``packs_per_step`` packs of at
    most ``capacity`` tokens, the same samples for both runs; the baseline pads them into
    microbatches of ``micro_batch_size`` samples."""

    path: str = "outputs/demo_data"
    samples: int = 400
    seed: int = 0
    capacity: int = 1024
    packs_per_step: int = 4
    micro_batch_size: int = 2
    max_pixels: int = 50176
    num_workers: int = 1
    make_demo: bool = False
    llm_cost: LlmCostConfig = field(default_factory=LlmCostConfig)
    encoder_cost: EncoderCostConfig = field(default_factory=EncoderCostConfig)

    def llm_cost_model(self) -> CostModel:
        """``llm_cost`` as a :class:`CostModel` (its file read now); a :class:`ConfigError`
        names the key and the file when it cannot be one."""
        cost = self.llm_cost
        if cost.file is None:
            quadratic = 1.0 / self.capacity if cost.quadratic is None else cost.quadratic
            return _cost_model({"linear": cost.linear, "quadratic": quadratic, "constant": cost.constant},
                               "data.llm_cost")
        if cost.coefficients_set:
            raise ConfigError(f"data.llm_cost: set either file ({cost.file}) or the coefficients "
                              f"(linear, quadratic, constant), not both")
        return _cost_model(_calibrated_terms(Path(cost.file)), f"data.llm_cost.file ({cost.file})")

    def encoder_cost_model(self) -> EncoderCost:
        """``encoder_cost`` as an :class:`EncoderCost` (its file read now); a :class:`ConfigError`
        names the key and the file when it cannot be one."""
        cost = self.encoder_cost
        if cost.file is not None and cost.coefficients_set:
            raise ConfigError(f"data.encoder_cost: set either file ({cost.file}) or the coefficients "
                              f"(quadratic, linear, per_image), not both")
        try:
            if cost.file is not None:
                return EncoderCost.load(cost.file)
            return EncoderCost.from_terms({"quadratic": cost.quadratic, "linear": cost.linear,
                                           "per_image": cost.per_image}, "coefficients")
        except EncoderCostError as exc:
            key = "data.encoder_cost" if cost.file is None else "data.encoder_cost.file"
            raise ConfigError(f"{key}: {exc}") from None


def _calibrated_terms(path: Path) -> dict[str, Any]:
    """The ``model`` mapping of a ``scripts/calibrate_cost_model.py`` JSON at ``path``."""
    return read_calibrated_terms(path, "model", [f.name for f in dataclasses.fields(CostModel)],
                                 where=f"data.llm_cost.file ({path})", error=ConfigError)


def _cost_model(terms: dict[str, Any], key: str) -> CostModel:
    """A :class:`CostModel` of ``terms``: numbers, none negative, some LLM term above 0
    (a cost of 0 everywhere would group by nothing)."""
    for name, value in terms.items():
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise ConfigError(f"{key}: {name}: expected a number, got {type(value).__name__} {value!r}")
    try:
        model = CostModel(**terms)
    except ValueError as exc:
        raise ConfigError(f"{key}: {exc}") from None
    if not any(getattr(model, name) > 0 for name in LLM_COST_TERMS):
        raise ConfigError(f"{key}: the LLM terms ({', '.join(LLM_COST_TERMS)}) are all 0: no cost to group by")
    return model


@dataclass(frozen=True)
class LayoutConfig:
    """Processes and how each run places the model on them.

    The baseline is PP=``baseline_pp`` x DP=``world_size / baseline_pp`` with the ViT in
    stage 0 (the MindSpeed-MM-style pipeline the issue names).  ``best_baseline_pp``, when
    set, adds a second baseline run at PP=``best_baseline_pp`` x DP=``world_size /
    best_baseline_pp`` (everything else the same), named ``baseline-pp<N>``: the baseline's
    best measured configuration, so FlowTrain is also compared with the baseline at its best
    (docs/train.md); ``best_baseline_micro_batch_size`` gives that run its own padded
    micro-batch size (named ``baseline-pp<N>-mbs<M>``; either key alone adds the run, the
    other keeping the baseline's value).  ``best_thd_pp`` and ``best_three_phase_pp``: the
    pipeline size ``baseline-thd`` and ``three-phase`` run at (``null``: ``baseline_pp``), so
    the job compares FlowTrain with each baseline at its best; ``--search-baselines`` prints
    these keys' measured values to paste (:mod:`mindspeed_flow.train.search`).
    ``text_only_pp``: the pipeline size of the text-only upper bound (the
    backbone alone on every rank, PP=``text_only_pp`` x DP=``world_size / text_only_pp``;
    default 1: a pure LLM this small trains fastest without a pipeline here, docs/train.md).
    FlowTrain takes its layout from the allocator when ``use_allocator`` is true
    and the plan fits a ``DecoupledLayout``, otherwise from the three ``flow_*`` sizes
    (``flow_backbone_dp * (flow_encoder_dp + flow_backbone_pp)`` must be ``world_size``).
    """

    world_size: int = 4
    baseline_pp: int = 2
    best_baseline_pp: Optional[int] = None  # None (and no best micro-batch size): no second baseline run
    best_baseline_micro_batch_size: Optional[int] = None  # None: data.micro_batch_size
    best_thd_pp: Optional[int] = None  # None: baseline_pp
    best_three_phase_pp: Optional[int] = None  # None: baseline_pp
    text_only_pp: int = 1
    use_allocator: bool = True
    flow_encoder_dp: int = 2
    flow_backbone_pp: int = 2
    flow_backbone_dp: int = 1
    max_ahead: int = 2
    pool_backend: str = "shm"
    flow: bool = False
    pool_capacity_mb: Optional[float] = None  # None: what max_ahead packs of embeddings need (train/flow.py)
    flow_encoder_batch_patches: int = 1024
    flow_max_in_flight: Optional[int] = None


@dataclass(frozen=True)
class SearchConfig:
    """The grid of ``--search-baselines`` (:mod:`mindspeed_flow.train.search`).  ``pp``: the
    pipeline sizes tried (``null``: every one the layout allows, :meth:`TrainConfig.pipeline_sizes`;
    a size it does not allow is an error); ``micro_batch_sizes``: the padded baseline's."""

    pp: Optional[tuple[int, ...]] = None
    micro_batch_sizes: tuple[int, ...] = (1, 2, 4)


@dataclass(frozen=True)
class OptimConfig:
    """``torch.optim.AdamW`` hyperparameters, the same for both runs."""

    lr: float = 1e-3
    betas: tuple[float, float] = (0.9, 0.95)
    eps: float = 1e-8
    weight_decay: float = 0.01


@dataclass(frozen=True)
class TrainConfig:
    """The whole job.  ``parity_steps``: steps of the parity run; ``resume_at``: the resume
    check stops after this many steps, reloads from ``checkpoint_dir`` and continues to
    ``steps`` (``checkpoint_dir``, default ``<report_dir>/checkpoint``)."""

    model: ModelConfig = field(default_factory=ModelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    layout: LayoutConfig = field(default_factory=LayoutConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    search: SearchConfig = field(default_factory=SearchConfig)
    steps: int = 12
    seed: int = 1234
    report_dir: str = "outputs/train/report"
    checkpoint_dir: Optional[str] = None  # None: <report_dir>/checkpoint
    parity_steps: int = 3
    resume_at: int = 2

    @property
    def baseline_dp(self) -> int:
        return self.layout.world_size // self.layout.baseline_pp

    def pipeline_sizes(self) -> list[int]:
        """Every PP a co-located run can take: it divides the world and the LLM has a layer
        for each stage."""
        world = self.layout.world_size
        return [pp for pp in range(1, world + 1) if world % pp == 0 and pp <= self.model.llm_layers]

    def co_located(self, pp: int, micro_batch_size: Optional[int] = None) -> "TrainConfig":
        """This config with its co-located runs at PP=``pp`` (and the padded microbatches of
        ``micro_batch_size`` samples when given): one run's resolved config, its ``best_*``
        keys cleared (they choose runs, they are not part of one)."""
        layout = dataclasses.replace(self.layout, baseline_pp=pp, best_baseline_pp=None,
                                     best_baseline_micro_batch_size=None, best_thd_pp=None, best_three_phase_pp=None)
        data = self.data if micro_batch_size is None else dataclasses.replace(self.data,
                                                                              micro_batch_size=micro_batch_size)
        return dataclasses.replace(self, layout=layout, data=data)

    def best_baseline(self) -> Optional[tuple[str, "TrainConfig"]]:
        """The second baseline run's name and config (PP=``layout.best_baseline_pp``, padded
        micro-batch size ``layout.best_baseline_micro_batch_size``, each defaulting to the
        baseline's), or None when the config sets neither."""
        lay = self.layout
        if lay.best_baseline_pp is None and lay.best_baseline_micro_batch_size is None:
            return None
        pp = lay.best_baseline_pp or lay.baseline_pp
        mbs = lay.best_baseline_micro_batch_size
        name = f"baseline-pp{pp}" + ("" if mbs is None else f"-mbs{mbs}")
        return name, self.co_located(pp, mbs)

    def thd_config(self) -> "TrainConfig":
        """``baseline-thd``'s config: at PP=``layout.best_thd_pp`` (``null``: ``baseline_pp``)."""
        return self.co_located(self.layout.best_thd_pp or self.layout.baseline_pp)

    def three_phase_config(self) -> "TrainConfig":
        """``three-phase``'s config: at PP=``layout.best_three_phase_pp`` (``null``: ``baseline_pp``)."""
        return self.co_located(self.layout.best_three_phase_pp or self.layout.baseline_pp)

    @property
    def checkpoint_path(self) -> Path:
        return Path(self.checkpoint_dir) if self.checkpoint_dir else Path(self.report_dir) / "checkpoint"


def load_config(path: str | Path, **overrides: Any) -> TrainConfig:
    """Read ``path``; ``overrides`` (``steps=3``, ``report_dir=...``, ``world_size=2``)
    replace top-level fields, ``world_size`` the layout's."""
    path = Path(path)
    raw = read_yaml(path, error=ConfigError, what="the config")
    if raw is None:
        raw = {}
    if not isinstance(raw, dict):
        raise ConfigError(f"{path}: the top level must be a mapping of sections, got {type(raw).__name__}")
    world_size = overrides.pop("world_size", None)
    cfg = build(TrainConfig, raw, path=path, error=ConfigError)
    if world_size is not None:
        cfg = dataclasses.replace(cfg, layout=dataclasses.replace(cfg.layout, world_size=world_size))
    cfg = dataclasses.replace(cfg, **{k: v for k, v in overrides.items() if v is not None})
    check_config(cfg, path)
    return cfg


def check_config(cfg: TrainConfig, path: str | Path = "<config>") -> None:
    """Values that have the right type but cannot work together."""
    problems = []
    positive = {"steps": cfg.steps, "data.samples": cfg.data.samples, "data.capacity": cfg.data.capacity,
                "data.packs_per_step": cfg.data.packs_per_step, "data.micro_batch_size": cfg.data.micro_batch_size,
                "parity_steps": cfg.parity_steps}
    lay = cfg.layout
    positive.update({f"layout.{key}": getattr(lay, key) for key in LAYOUT_POSITIVE})
    positive["data.max_pixels"] = cfg.data.max_pixels
    problems += [f"{key}: must be >= 1, got {value}" for key, value in positive.items() if value < 1]
    if cfg.data.num_workers < 0:
        problems.append(f"data.num_workers: must be >= 0, got {cfg.data.num_workers}")
    if lay.baseline_pp >= 1 and lay.world_size % lay.baseline_pp:
        problems.append(f"layout.baseline_pp: {lay.baseline_pp} does not divide layout.world_size {lay.world_size}")
    if not lay.use_allocator and lay.flow_backbone_dp * (lay.flow_encoder_dp + lay.flow_backbone_pp) != lay.world_size:
        problems.append(f"layout: flow_backbone_dp * (flow_encoder_dp + flow_backbone_pp) = {lay.flow_backbone_dp} * "
                        f"({lay.flow_encoder_dp} + {lay.flow_backbone_pp}) is not world_size {lay.world_size}")
    if lay.text_only_pp >= 1 and lay.world_size % lay.text_only_pp:
        problems.append(f"layout.text_only_pp: {lay.text_only_pp} does not divide layout.world_size {lay.world_size}")
    problems += _best_problems(cfg)
    if cfg.data.capacity >= 1:  # the default quadratic term is 1 / capacity
        try:
            cfg.data.llm_cost_model()
        except ConfigError as exc:
            problems.append(str(exc))
    try:
        cfg.data.encoder_cost_model()
    except ConfigError as exc:
        problems.append(str(exc))
    problems += _search_problems(cfg)
    if lay.flow and lay.pool_backend != "shm":
        problems.append(f"layout.flow: the flow runs on the 'shm' pool (one host), not {lay.pool_backend!r}")
    if lay.pool_capacity_mb is not None and not lay.pool_capacity_mb > 0:
        problems.append(f"layout.pool_capacity_mb: must be > 0 (or null), got {lay.pool_capacity_mb}")
    if lay.flow_encoder_batch_patches < 1:
        problems.append(f"layout.flow_encoder_batch_patches: must be >= 1, got {lay.flow_encoder_batch_patches}")
    if lay.flow_max_in_flight is not None and lay.flow_max_in_flight < 1:
        problems.append(f"layout.flow_max_in_flight: must be >= 1 (or null), got {lay.flow_max_in_flight}")
    if lay.pool_backend not in POOL_BACKENDS:
        problems.append(f"layout.pool_backend: {lay.pool_backend!r} is not one of {POOL_BACKENDS}")
    if problems:
        raise ConfigError(f"{path}: " + "; ".join(problems))


def _best_problems(cfg: TrainConfig) -> list[str]:
    """The ``layout.best_*`` keys: each PP one a co-located run can take, a micro-batch size
    >= 1, and a second baseline that is not the baseline itself."""
    lay, problems = cfg.layout, []
    best = lay.best_baseline_pp
    for key in ("best_baseline_pp", "best_thd_pp", "best_three_phase_pp"):
        pp = getattr(lay, key)
        if pp is not None and pp not in cfg.pipeline_sizes():
            problems.append(f"layout.{key}: {pp} is not a pipeline size a co-located run can take here (one that "
                            f"divides layout.world_size {lay.world_size} and is at most model.llm_layers "
                            f"{cfg.model.llm_layers}: {cfg.pipeline_sizes()}; null: layout.baseline_pp)")
    mbs = lay.best_baseline_micro_batch_size
    if mbs is not None and mbs < 1:
        problems.append(f"layout.best_baseline_micro_batch_size: must be >= 1 (or null), got {mbs}")
    same_mbs = mbs is None or mbs == cfg.data.micro_batch_size
    if best is not None and best == lay.baseline_pp and same_mbs:
        problems.append(f"layout.best_baseline_pp: {best} is layout.baseline_pp already (null: no second baseline; "
                        f"or set layout.best_baseline_micro_batch_size to another size than data.micro_batch_size)")
    if best is None and mbs is not None and same_mbs:
        problems.append(f"layout.best_baseline_micro_batch_size: {mbs} is data.micro_batch_size already and "
                        f"layout.best_baseline_pp is null: that is the baseline itself (null: no second baseline)")
    return problems


def _search_problems(cfg: TrainConfig) -> list[str]:
    """The ``search`` section: sizes the grid can run, none twice."""
    problems = []
    allowed = cfg.pipeline_sizes()
    for key, sizes, ok in (("search.pp", cfg.search.pp, lambda v: v in allowed),
                           ("search.micro_batch_sizes", cfg.search.micro_batch_sizes, lambda v: v >= 1)):
        if sizes is None:
            continue
        if not sizes or len(set(sizes)) != len(sizes):
            problems.append(f"{key}: must be a non-empty list without repeats, got {list(sizes)}")
        bad = [v for v in sizes if not ok(v)]
        if bad:
            what = f"pipeline sizes a co-located run can take here: {allowed}" if key == "search.pp" else "sizes >= 1"
            problems.append(f"{key}: {bad} are not {what}")
    return problems


def check_resume(cfg: TrainConfig, path: str | Path = "<config>") -> None:
    """The resume check needs a step to stop after and at least one step to resume."""
    if not 0 < cfg.resume_at < cfg.steps:
        raise ConfigError(f"{path}: resume_at: must be between 1 and steps - 1 = {cfg.steps - 1} for the resume "
                          f"check, got {cfg.resume_at} (set resume_at, or pass --no-resume-check)")


def as_dict(cfg: TrainConfig) -> dict[str, Any]:
    """The config as plain data (for the report and the checkpoint's metadata)."""
    return dataclasses.asdict(cfg)


__all__ = ["ConfigError", "DataConfig", "LayoutConfig", "LlmCostConfig", "OptimConfig", "SearchConfig", "TrainConfig",
           "as_dict", "check_config", "check_resume", "load_config"]
