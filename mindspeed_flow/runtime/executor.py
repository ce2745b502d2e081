"""Execute one rank's program of a composed :class:`.Plan`: the runtime behind Megatron's
``forward_backward_func``.

The program is data (:mod:`mindspeed_flow.schedule`); the executor lowers it once
(:mod:`.lowering`: every action into its primitive operations, every message with its
channel and tag) and runs exactly that list, operation after operation (:mod:`.step` says
what each does).  The analyses that refuse a plan before its first step read the same list.

The runtime's contract is *eager semantics*: a send never blocks the program.  Every plan is
validated under eager semantics before its first step (a rendezvous plan passes too), and
its lowering replayed to bound its send buffers (:mod:`.sends`) and, on a backend that
matches messages in posting order, to check that order (:mod:`.fifo`), so no invalid
program runs; ``<transpose, 1f1b>`` plans, which can deadlock under rendezvous, run as
validated.  A plan the runtime cannot execute (a recomputed backward; pool transfers
without a pool) is refused there too.  Every action is time-stamped (:mod:`.timeline`), and
any failure ends the step on every rank with an :class:`.ActionFailed` naming the rank, the
action index and the action.
"""

from __future__ import annotations

import itertools
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Mapping, Sequence

import torch

from ..schedule.actions import BACKWARDS, Action, Kind
from ..schedule.errors import ScheduleError
from ..schedule.plan import Plan
from ..schedule.validate import validate
from .errors import ActionFailed, where
from .fifo import channel_groups, check_posting_order, needs_fifo_order
from .lowering import Lowered, Op, OpKind, Payload, lower
from .sends import deadlock_with_bound, plan_send_bound
from .step import Step
from .timeline import Stamp, Timeline
from .transport import AbortBoard, PeerFailure, Transport, WaitPolicy, Waiter

_DEFAULT_STORE = object()
_generations = itertools.count()


@dataclass
class Binding:
    """What runs one (region, stage) visit on this rank: its model chunk, the data
    iterator its ``forward_step_func`` reads (``None`` is passed through as Megatron does),
    and ``enter``: called right before each forward and backward of the chunk (Megatron's
    interleaved schedule sets the virtual pipeline rank of the chunk there; ``None``: nothing)."""

    module: torch.nn.Module
    data_iterator: Any = None
    enter: Callable[[], None] | None = None


@dataclass(frozen=True)
class LossRules:
    """Megatron's loss scaling on the last stage (``TransformerConfig`` fields)."""

    calculate_per_token_loss: bool = False
    context_parallel_size: int = 1
    grad_scale_func: Callable[[torch.Tensor], torch.Tensor] | None = None


@dataclass(frozen=True)
class RuntimeOptions:
    """Knobs of the runtime.

    Attributes:
        wait: timeouts and polling of blocked receives (failures end the step within
            ``wait.timeout_s``, or ``wait.abort_poll_s`` after another rank reported one).
        max_pending_sends: at most this many tensors' send buffers alive: the oldest send is
            awaited before another is posted.  ``None`` (default): the plan's own bound
            (:func:`.sends.plan_send_bound`), the most any rank can hold in any interleaving,
            so no send ever waits for another rank and the plan's in-flight limits bound the
            buffers.  An explicit bound may be smaller; it is refused before the first step if
            it can deadlock the plan (:func:`.sends.deadlock_with_bound`).
            :attr:`StepResult.peak_pending_sends` reports what a step held.
        channel_groups: post each message channel (:func:`.fifo.channel_groups`) on its own
            process group, so that a backend matching messages in posting order (NCCL, HCCL)
            needs the order to agree only per pair *and channel*.  ``None`` (default): on for
            every backend but gloo (which matches by tag and keeps one group); ``True`` forces
            it on gloo too (to test the routing on CPU).
    """

    wait: WaitPolicy = field(default_factory=WaitPolicy)
    max_pending_sends: int | None = None
    channel_groups: bool | None = None


@dataclass
class StepResult:
    """What one step returned: Megatron's ``forward_data_store`` (loss dicts on the last
    stage), the 3-value ``loss_func`` token count, and the rank's measured timeline."""

    forward_data_store: list
    total_num_tokens: torch.Tensor
    timeline: Timeline
    peak_pending_sends: int = 0


class Executor:
    """Runs plan rank ``rank``'s programs, step after step.

    Args:
        rank: this process's rank in the plan (its pipeline rank).
        ranks: plan rank -> global rank (``torch.distributed`` rank).
        group: process group of those ranks (``None``: the default group).
        store: where failures are reported to the other ranks (default: the default
            process group's store; ``None``: no board, failures surface by timeout).
        pool: the :class:`mindspeed_flow.pool.Pool` of ``PUT``/``GET`` actions (``None``:
            a plan with pool transfers is refused).
    """

    def __init__(self, rank: int, ranks: Sequence[int], group: Any = None, store: Any = _DEFAULT_STORE,
                 options: RuntimeOptions | None = None, pool: Any = None) -> None:
        self.rank = rank
        self.pool = pool
        self.ranks = list(ranks)
        self.group = group
        self.options = options or RuntimeOptions()
        self.store = _default_store() if store is _DEFAULT_STORE else store
        self.generation = next(_generations)
        self.steps = 0
        self.waiters = (Waiter(f"flow-r{rank}-sends"), Waiter(f"flow-r{rank}-recvs"))
        self._prepared: dict[int, Plan] = {}
        self._lowered: dict[tuple[int, bool], Lowered] = {}
        self._send_bounds: dict[tuple[int, bool], tuple[Plan, int]] = {}
        self.channels: dict[str, Any] = {}

    def prepare(self, plan: Plan) -> Lowered:
        """Validate ``plan`` (eager semantics; then its lowering: what the runtime cannot run,
        the send-buffer replay and - on a backend that ignores tags - its posting order per
        pair and channel, :mod:`.fifo`, creating a process group per channel) once; return
        the lowered training step."""
        if self._prepared.get(id(plan)) is plan:
            return self.lowered(plan)
        validate(plan, semantics="eager")
        if len(plan.programs) != len(self.ranks):
            raise ScheduleError(
                f"the plan has {len(plan.programs)} ranks but the runtime's group has {len(self.ranks)}")
        lowered = self.lowered(plan)
        self._check_runnable(lowered)
        self.send_bound(plan)  # refuses what the executor cannot run in program order
        if torch.distributed.is_available() and torch.distributed.is_initialized():
            backend = torch.distributed.get_backend(self.group)
            per_channel = self.options.channel_groups
            if per_channel is None:
                per_channel = needs_fifo_order(backend)
            check_posting_order(lowered, backend, per_channel)
            if per_channel:
                self._create_channel_groups(lowered)
        self._prepared[id(plan)] = plan
        return lowered

    def lowered(self, plan: Plan, forward_only: bool = False) -> Lowered:
        """``plan`` lowered for a training (or forward-only) step, once per plan."""
        known = self._lowered.get((id(plan), forward_only))
        if known is None or known.plan is not plan:
            known = self._lowered[(id(plan), forward_only)] = lower(plan, forward_only)
        return known

    def _check_runnable(self, lowered: Lowered) -> None:
        """Refuse what the runtime cannot execute, naming the first such operation: a
        recomputed backward on any rank (every rank refuses the same plan), a pool transfer
        on this rank without a pool (ranks whose own program has none, such as the backbone's
        later stages of a decoupled layout, open no pool)."""
        for rank, ops in sorted(lowered.programs.items()):
            for op in ops:
                if op.message is not None and op.message.payload is Payload.INPUT:
                    raise ScheduleError(
                        f"{where(rank, op.index, op.action)}: Transpose(backward='recompute') is not supported "
                        "by the runtime; use backward='owner'")
                if op.kind in (OpKind.PUT, OpKind.GET) and self.pool is None and rank == self.rank:
                    raise ScheduleError(
                        f"{where(rank, op.index, op.action)}: the plan moves tensors through the pool, but "
                        "this executor has none: pass Executor(pool=...) (mindspeed_flow.pool.open_pool)")

    def _create_channel_groups(self, plan: Lowered) -> None:
        """One process group per channel of ``plan`` among the ranks that use it, created in
        the plan's channel order (the same on every rank; only the members call
        ``new_group``, hence local synchronization), each channel once per executor."""
        for channel, users in channel_groups(plan):
            if channel in self.channels or self.rank not in users:
                continue
            self.channels[channel] = torch.distributed.new_group(
                [self.ranks[r] for r in users], use_local_synchronization=True)

    def send_bound(self, plan: Plan, forward_only: bool = False) -> int:
        """The send buffers a step of ``plan`` may keep alive: the explicit
        ``max_pending_sends`` if it cannot deadlock the plan, else the plan's own bound."""
        known = self._send_bounds.get((id(plan), forward_only))
        if known is not None and known[0] is plan:
            return known[1]
        lowered = self.lowered(plan, forward_only)
        own = plan_send_bound(lowered)
        bound = self.options.max_pending_sends
        if bound is None:
            bound = own
        elif bound < 1:
            raise ScheduleError(f"RuntimeOptions.max_pending_sends must be >= 1 or None, got {bound}")
        else:
            stuck = deadlock_with_bound(lowered, bound)
            if stuck is not None:
                raise ScheduleError(
                    f"RuntimeOptions.max_pending_sends={bound} can deadlock this plan "
                    f"({'forward only' if forward_only else 'training'} step): {stuck}; the plan's "
                    f"own bound is {own}")
        self._send_bounds[(id(plan), forward_only)] = (plan, bound)
        return bound

    def run(self, plan: Plan, forward_step_func: Callable, bindings: Mapping[tuple[str, int], Binding], *,
            forward_only: bool = False, collect_non_loss_data: bool = False,
            loss: LossRules | None = None,
            before_last_backward: Callable[[int | None], None] | None = None) -> StepResult:
        """One step of this rank's program; see the module docstring.

        ``before_last_backward(i)`` is called right before the last backward of the i-th
        binding (in ``bindings`` order), and ``(None)`` before the rank's very last backward:
        where Megatron re-enables gradient reduction (``enable_grad_sync``)."""
        self.prepare(plan)
        program = self.lowered(plan, forward_only).programs[self.rank]
        bound = self.send_bound(plan, forward_only)
        board = AbortBoard(self.store, f"mindspeed_flow/runtime/{self.generation}/abort/{self.steps}")
        self.steps += 1
        step = Step(self.rank, plan, Transport(self.ranks, self.group, self.options.wait, board, self.waiters,
                                               bound, self.channels),
                    self.pool, self.steps, forward_step_func, bindings, forward_only, collect_non_loss_data,
                    loss or LossRules())
        timeline = Timeline(self.rank)
        hooks = _last_backwards(plan.programs[self.rank], list(bindings)) \
            if before_last_backward and not forward_only else {}
        op = Op(OpKind.COMPUTE, -1, Action(Kind.FORWARD, "start-of-step"))
        try:
            start = end = 0.0
            for n, op in enumerate(program):
                if n == 0 or op.index != program[n - 1].index:  # the first operation of an action
                    for which in hooks.get(op.index, ()):
                        before_last_backward(which)
                    start = time.monotonic()
                step.do(op)
                end = time.monotonic()
                if n + 1 == len(program) or program[n + 1].index != op.index:  # its last
                    timeline.stamps.append(Stamp(op.index, op.action, start, end))
                    step.end_action()
                    step.transport.retire()
            op = Op(OpKind.COMPUTE, len(plan.programs[self.rank]), Action(Kind.GRAD_REDUCE, "end-of-step"))
            step.transport.drain()
            reported = board.read()
            if reported is not None:
                raise PeerFailure(f"another rank failed: {reported}")
        except PeerFailure as exc:
            board.post(f"{where(self.rank, op.index, op.action)}: {exc}")
            raise ActionFailed(self.rank, op.index, op.action, str(exc)) from exc
        except Exception as exc:
            reason = f"{type(exc).__name__}: {exc}"
            board.post(f"{where(self.rank, op.index, op.action)}: {reason}")
            raise ActionFailed(self.rank, op.index, op.action, reason) from exc
        return StepResult(step.store, step.total_num_tokens, timeline, step.transport.peak_pending)


def _last_backwards(program: Sequence[Action], keys: list[tuple[str, int]]) -> dict[int, list[int | None]]:
    """Program index -> which hooks fire before it: ``None`` at the rank's last backward,
    then the binding position at each binding's last backward."""
    hooks: dict[int, list[int | None]] = {}
    last = {}
    for i, a in enumerate(program):
        if a.kind in BACKWARDS:
            last[(a.region, a.stage)] = i
    if last:
        hooks.setdefault(max(last.values()), []).append(None)
    for key, i in last.items():
        if key in keys:
            hooks.setdefault(i, []).append(keys.index(key))
    return hooks


def _default_store() -> Any:
    import torch.distributed as dist

    if not dist.is_initialized():
        return None
    try:
        return dist.distributed_c10d._get_default_store()
    except Exception:  # noqa: BLE001 - a backend without a store: failures surface by timeout
        return None
