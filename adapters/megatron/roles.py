"""Megatron's parallel state for FlowTrain's decoupled layout: two parallel configs in one world.

The encoder ranks (the first ``encoder_dp * backbone_dp * encoder_tp`` global ranks) run the
ViT with ``(tp=encoder_tp, pp=1, dp=encoder_dp*backbone_dp)``; the backbone ranks after
them run the LLM with ``(backbone_tp, backbone_pp, backbone_dp)``.  Megatron knows one config
per process, so each process is given *its role's* config, as if the world were its role's
ranks only:

- :func:`validate_args_wrapper` hands Megatron's ``validate_args`` the role's world size,
  TP and PP (its ``world % (tp*pp)`` arithmetic and data-parallel size are the role's), then
  puts the real world size back (``init_process_group`` needs it);
- :func:`initialize_model_parallel_wrapper` runs Megatron's ``initialize_model_parallel``
  twice on every rank, once per role, in the same order everywhere (a default
  ``new_group`` is collective over the whole world): during a role's pass
  ``torch.distributed`` looks like that role's world (:func:`role_world`: ``get_world_size``
  is its size, ``get_rank`` its index, ``new_group`` maps its ranks to global ranks).  A rank
  keeps the globals of its own role's pass (global-rank lists mapped) and drops the other's.
  So every Megatron group (TP, PP, DP, embedding, model parallel) holds ranks of one role
  only: no collective of one role waits on the other, DDP's gradient all-reduce never mixes
  encoder and backbone gradients.  The runtime's cross-role groups
  (:func:`mindspeed_flow.decoupled.groups.new_groups`: the slice's executor
  group, the pool group) are built right after, on every rank.

The layout is set with :func:`configure`: by :func:`validate_args_wrapper` from the job's
flags (``--flow-schedule-config``'s ``decoupled:`` form, or a decoupled ``--flow-allocator-plan``:
:func:`~mindspeed_flow.adapters.megatron.decoupled_layout.decoupled_layout`), or before it by a
test driver; without one both wrappers are Megatron's own functions.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator

from mindspeed_flow.schedule.regions import BACKBONE_REGION, ENCODER_REGION
from mindspeed_flow.decoupled.layout import MEGATRON_ORDER


@dataclass(frozen=True)
class RoleConfig:
    """One role's Megatron config: its global ranks and its TP / PP sizes."""

    region: str
    ranks: tuple[int, ...]
    tp: int
    pp: int

    @property
    def world_size(self) -> int:
        return len(self.ranks)

    @property
    def dp(self) -> int:
        return self.world_size // (self.tp * self.pp)


@dataclass
class Roles:
    """What the patches configured: the decoupled layout (``None``: Megatron's own) and the
    runtime's cross-role groups once built."""

    layout: Any = None  # mindspeed_flow DecoupledLayout
    groups: dict = field(default_factory=dict)


ROLES = Roles()


def configure(layout: Any) -> Roles:
    """Run this process under ``layout`` (a ``DecoupledLayout``; ``None``: Megatron's own)."""
    global ROLES
    ROLES = Roles(layout)
    return ROLES


def role_configs(layout: Any) -> tuple[RoleConfig, RoleConfig]:
    """The encoder's and the backbone's configs, in the order their groups are built."""
    return (RoleConfig(ENCODER_REGION, tuple(layout.encoder_ranks), layout.encoder_tp, 1),
            RoleConfig(BACKBONE_REGION, tuple(layout.backbone_ranks), layout.backbone_tp, layout.backbone_pp))


def my_role(layout: Any, rank: int) -> RoleConfig:
    encoder, backbone = role_configs(layout)
    return encoder if rank in encoder.ranks else backbone


def check_world(layout: Any, world_size: int) -> None:
    """The job's world must be the layout's: refuse at start-up naming both numbers."""
    layout.check_world_size(world_size, "this Megatron job")


@contextlib.contextmanager
def role_world(role: RoleConfig, rank: int) -> Iterator[None]:
    """``torch.distributed`` as one role's world: ``get_world_size()`` / ``get_rank()``
    (without a group) answer for that world, ``new_group(ranks)`` takes ranks of that world.
    A rank outside the role answers as the role's first rank: it takes part in every
    ``new_group`` (they are collective over the real world) and its globals are dropped."""
    import torch.distributed as dist

    real_size, real_rank, real_new_group = dist.get_world_size, dist.get_rank, dist.new_group
    local = role.ranks.index(rank) if rank in role.ranks else 0

    def get_world_size(group: Any = None) -> int:
        return role.world_size if group is None else real_size(group)

    def get_rank(group: Any = None) -> int:
        return local if group is None else real_rank(group)

    def new_group(ranks: Any = None, *args: Any, **kwargs: Any) -> Any:
        mapped = list(role.ranks) if ranks is None else [role.ranks[r] for r in ranks]
        return real_new_group(mapped, *args, **kwargs)

    dist.get_world_size, dist.get_rank, dist.new_group = get_world_size, get_rank, new_group
    try:
        yield
    finally:
        dist.get_world_size, dist.get_rank, dist.new_group = real_size, real_rank, real_new_group


def _state_globals(module: Any) -> dict[str, Any]:
    return {k: v for k, v in vars(module).items() if k.startswith("_") and k[1:2].isupper()}


def _to_global(value: Any, ranks: tuple[int, ...]) -> Any:
    """A ``*_GLOBAL_RANKS`` value of a role's pass (ranks of the role's world) in global ranks."""
    if isinstance(value, int):
        return ranks[value]
    if isinstance(value, list):
        return [_to_global(v, ranks) for v in value]
    return value


def initialize_model_parallel_wrapper(wrapped: Callable, instance: Any, args: tuple, kwargs: dict) -> Any:
    """Megatron's ``initialize_model_parallel`` once per role (see the module docstring);
    the role's TP / PP replace the ones passed, and the backbone's pass runs in Megatron's
    ``tp-cp-ep-pp-dp`` order (``--use-tp-pp-dp-mapping``'s): the layout places each backbone
    replica's stages on consecutive ranks, which Megatron's default ``...-dp-pp`` order would
    pipeline across replicas once both PP and DP exceed 1; then the runtime's cross-role groups."""
    layout = ROLES.layout
    if layout is None:
        return wrapped(*args, **kwargs)
    import torch.distributed as dist
    from megatron.core import parallel_state

    rank = dist.get_rank()
    check_world(layout, dist.get_world_size())
    names = ("tensor_model_parallel_size", "pipeline_model_parallel_size", "virtual_pipeline_model_parallel_size",
             "pipeline_model_parallel_split_rank")
    options = dict(zip(names, args))
    options.update(kwargs)
    if options.get("virtual_pipeline_model_parallel_size"):
        raise ValueError("the decoupled layout runs one model chunk per rank: drop "
                         "--virtual-pipeline-model-parallel-size / --num-layers-per-virtual-pipeline-stage")
    options.update(virtual_pipeline_model_parallel_size=None, pipeline_model_parallel_split_rank=None)
    before = _state_globals(parallel_state)
    kept: dict[str, Any] | None = None
    for role in role_configs(layout):
        options.update(tensor_model_parallel_size=role.tp, pipeline_model_parallel_size=role.pp)
        if role.region == BACKBONE_REGION:  # each replica's stages consecutive, as the layout places them
            options["order"] = MEGATRON_ORDER
        with role_world(role, rank):
            wrapped(**options)
        if rank in role.ranks:
            kept = {k: (_to_global(v, role.ranks) if k.endswith("_GLOBAL_RANKS") else v)
                    for k, v in _state_globals(parallel_state).items()}
        for k, v in before.items():  # as before the pass (destroy_model_parallel misses some)
            setattr(parallel_state, k, v)
    assert kept is not None
    for k, v in kept.items():
        setattr(parallel_state, k, v)
    from mindspeed_flow.decoupled.groups import new_groups

    ROLES.groups = new_groups(layout)
    return None


def encoder_replica() -> int:
    """This encoder rank's replica within its slice (``0 .. encoder_dp - 1``: its rank in the
    slice's plan)."""
    import torch.distributed as dist

    rank = dist.get_rank()
    return ROLES.layout.executor_ranks(rank).index(rank)


def grad_stats_group_wrapper(wrapped: Callable, instance: Any, args: tuple, kwargs: dict) -> Any:
    """``MegatronOptimizer.get_grad_stats_parallel_group``: under a decoupled layout, this
    rank's slice (every TP rank of its encoder replicas and backbone stages), so
    the gradient norm ``--clip-grad`` clips by, the zero count and fp16's found-inf are the
    whole model's, as co-located, not each role's own.  Each parameter's gradient is counted
    once in a slice: the encoder replicas after the first mark their (all-reduced, equal)
    parameters ``shared`` (:func:`mindspeed_flow.adapters.mindspeed_mm.roles.vlm_init_wrapper`),
    which Megatron's norm and zero count skip; a TP-replicated parameter counts on TP rank 0
    only, as Megatron's own filter has it.
    The distributed optimizer's own method (the whole world, each rank its shard) is already
    the whole model's and is not wrapped."""
    if ROLES.layout is None:
        return wrapped(*args, **kwargs)
    return ROLES.groups["slice"]


def check_encoder_share(layout: Any, global_batch: int, micro_batch: int) -> None:
    """Each of a slice's ``encoder_dp`` replicas forwards an equal share of the slice's
    microbatches (Megatron gives the encoder role ``N / encoder_dp`` a step): refuse a global
    batch that does not split so, naming the numbers (Megatron's own assert would name the
    encoder role's data-parallel size, which the user never set)."""
    per_slice, rest = divmod(global_batch, micro_batch * layout.backbone_dp)
    if rest or per_slice % layout.encoder_dp:
        raise ValueError(
            f"the decoupled layout's {layout.encoder_dp} encoder replicas per slice need each slice's microbatches "
            f"a step (--global-batch-size {global_batch} / (--micro-batch-size {micro_batch} x backbone dp "
            f"{layout.backbone_dp})) to be a multiple of {layout.encoder_dp}")


def check_supported(layout: Any, parsed: Any, packing: bool) -> None:
    """Refuse at start-up what this version does not run under a decoupled layout (rather than
    run something else):

    - several encoder replicas per slice (``encoder_dp > 1``) without the ``packing`` feature:
      upstream's data loader shards the encoder ranks' samples by their own data-parallel rank,
      not by their slice's (the plugin's loader reads the slice's share,
      :func:`mindspeed_flow.adapters.mindspeed_mm.data.loader_shard`);
    - TP sizes that differ between the roles: the executors pair the roles' TP ranks by index
      (equal sizes are tested in Megatron's job, different ones only in the plugin's trainer);
    - ``--overlap-grad-reduce``: the plan's ``REDUCE`` among a slice's encoder replicas reads
      and writes DDP's ``main_grad`` after their last backward, where an overlapped DDP
      all-reduce of the same buffer may still be running;
    - ``--save`` / ``--load`` in another format than ``--ckpt-format torch``, or with an
      unpipelined backbone: each role writes the files of its own Megatron config (the encoder
      ``mp_rank_00``, the backbone ``mp_rank_00_PPP``), which resume bit for bit; at
      ``backbone_pp`` 1 both roles' files would be ``mp_rank_00``; a distributed
      (``torch_dist``) checkpoint of two configs in one world is not checked."""
    reasons = []
    if layout.encoder_dp > 1 and not packing:
        reasons.append(f"encoder_dp {layout.encoder_dp} > 1 without --flow-packing (upstream's data loader would "
                       "feed the encoder replicas other samples than their slice's)")
    if layout.encoder_tp != layout.backbone_tp:
        reasons.append(f"encoder_tp {layout.encoder_tp} != backbone_tp {layout.backbone_tp} (the executors pair "
                       "the roles' TP ranks by index; TP sizes that differ are not checked in Megatron's job)")
    if getattr(parsed, "overlap_grad_reduce", False):
        reasons.append("--overlap-grad-reduce (the encoder replicas' gradient reduce reads DDP's buffers after "
                       "the last backward, which an overlapped all-reduce may still be writing)")
    fmt = getattr(parsed, "ckpt_format", "torch")
    for flag, value in (("--save", getattr(parsed, "save", None)), ("--load", getattr(parsed, "load", None))):
        if value and fmt != "torch":
            reasons.append(f"{flag} {value} with --ckpt-format {fmt} (only --ckpt-format torch checkpoints of "
                           "the decoupled layout are checked to resume)")
        elif value and layout.backbone_pp == 1:
            reasons.append(f"{flag} {value} with backbone_pp 1 (the encoder's and the backbone's files would both "
                           "be mp_rank_00)")
    if reasons:
        raise ValueError("the decoupled layout does not run here yet: " + "; ".join(reasons))


def validate_args_wrapper(wrapped: Callable, instance: Any, args: tuple, kwargs: dict) -> Any:
    """Megatron's ``validate_args`` on this rank's role: world size, TP and PP of the role
    (so ``world % (tp*pp)`` and the data-parallel size are the role's); the real world
    size is put back after."""
    parsed = args[0] if args else kwargs.get("args")
    if parsed is not None and ROLES.layout is None:
        from mindspeed_flow.adapters.megatron.decoupled_layout import decoupled_layout

        configure(decoupled_layout(parsed))  # the flags' layout (a test driver may have set one)
    layout = ROLES.layout
    if layout is None or parsed is None:
        return wrapped(*args, **kwargs)
    check_world(layout, parsed.world_size)
    check_encoder_share(layout, parsed.global_batch_size, parsed.micro_batch_size)
    from mindspeed_flow.activation import flow_config

    check_supported(layout, parsed, packing=flow_config(parsed).enabled("packing"))
    role = my_role(layout, parsed.rank)
    world = parsed.world_size
    parsed.world_size = role.world_size
    parsed.tensor_model_parallel_size, parsed.pipeline_model_parallel_size = role.tp, role.pp
    if role.region == ENCODER_REGION:
        # The ViT has no pipeline of its own: Megatron's per-stage layer count is the LLM's.
        parsed.num_layers_per_virtual_pipeline_stage = None
        parsed.virtual_pipeline_model_parallel_size = None
    try:
        return wrapped(*args, **kwargs)
    finally:
        parsed.world_size = world
