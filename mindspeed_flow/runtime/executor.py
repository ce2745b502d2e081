"""Execute one rank's program of a composed :class:`.Plan`: the runtime behind Megatron's
``forward_backward_func``.

The program is data (:mod:`mindspeed_flow.schedule`); this module only does what each
action says, in order:

- ``F``: hand the visit's input to the model chunk (``set_input_tensor``, as Megatron
  does), call ``forward_step_func(data_iterator, model)``; on the last visit of a
  microbatch apply ``loss_func`` exactly as Megatron's ``forward_step`` does (2- and
  3-value returns, division by the microbatch count, ``collect_non_loss_data``);
- ``B`` (input and weight gradients), ``I`` (input gradients only: a frozen region on the
  gradient path, or the first half of a split backward), ``W`` (weight gradients only);
- ``SEND_A/RECV_A/SEND_G/RECV_G``: eager point-to-point with a shape header per tensor
  (:mod:`.transport`);
- ``BCAST`` / ``REDUCE``: parameters of a replicated region from its first replica, and the
  sum of its replicas' gradients (over the same point-to-point transport);
- ``PUT`` / ``GET``: through the executor's :mod:`mindspeed_flow.pool` (any backend; the
  getter releases what it took), or an in-process dict when no pool is given.

The runtime's contract is *eager semantics*: a send never blocks the program.  Every plan is
validated under eager semantics before its first step (a rendezvous plan passes too), and
replayed as the executor runs it to bound its send buffers (:mod:`.sends`), so no invalid
program runs; ``<transpose, 1f1b>`` plans, which can deadlock under rendezvous, run
as validated.  Every action is time-stamped (:mod:`.timeline`), and any failure ends the
step on every rank with an :class:`.ActionFailed` naming the rank, the action index and the
action.
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
from .feed import MicrobatchFeed
from .fifo import channel_groups, check_posting_order, needs_fifo_order
from .sends import SKIPPED_WHEN_FORWARD_ONLY, deadlock_with_bound, plan_send_bound
from .timeline import Stamp, Timeline
from .transport import AbortBoard, PeerFailure, Transport, WaitPolicy, Waiter

_DEFAULT_STORE = object()
_SAMPLE_META = ("sample_ids", "token_counts")  # data item fields a pool put carries along
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
            puts and gets must be on the same rank).
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
        self._prepared: dict[int, tuple[Plan, dict[tuple[str, int | None], int]]] = {}
        self._send_bounds: dict[tuple[int, bool], tuple[Plan, int]] = {}
        self.channels: dict[str, Any] = {}

    def prepare(self, plan: Plan) -> dict[tuple[str, int | None], int]:
        """Validate ``plan`` (eager semantics, then as the executor runs it, then - on a backend
        that ignores tags - its posting order per pair and channel, :mod:`.fifo`, creating a
        process group per channel) once and number its transfers' tags."""
        known = self._prepared.get(id(plan))
        if known is not None and known[0] is plan:
            return known[1]
        validate(plan, semantics="eager")
        if len(plan.programs) != len(self.ranks):
            raise ScheduleError(
                f"the plan has {len(plan.programs)} ranks but the runtime's group has {len(self.ranks)}")
        for rank, program in plan.programs.items():
            for i, a in enumerate(program):
                if a.key.endswith(":input"):
                    raise ScheduleError(
                        f"{where(rank, i, a)}: Transpose(backward='recompute') is not supported by "
                        "the runtime; use backward='owner'")
        keys = sorted({a.key or f"{a.kind.value}:{a.region}" for p in plan.programs.values() for a in p
                       if a.kind not in BACKWARDS and a.kind is not Kind.FORWARD})
        slots = plan.num_microbatches + 1
        tags = {(key, m): i * slots + (plan.num_microbatches if m is None else m)
                for i, key in enumerate(keys) for m in [*range(plan.num_microbatches), None]}
        self.send_bound(plan)  # refuses what the executor cannot run in program order
        if torch.distributed.is_available() and torch.distributed.is_initialized():
            backend = torch.distributed.get_backend(self.group)
            per_channel = self.options.channel_groups
            if per_channel is None:
                per_channel = needs_fifo_order(backend)
            check_posting_order(plan, backend, per_channel)
            if per_channel:
                self._create_channel_groups(plan)
        self._prepared[id(plan)] = (plan, tags)
        return tags

    def _create_channel_groups(self, plan: Plan) -> None:
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
        own = plan_send_bound(plan, forward_only)
        bound = self.options.max_pending_sends
        if bound is None:
            bound = own
        elif bound < 1:
            raise ScheduleError(f"RuntimeOptions.max_pending_sends must be >= 1 or None, got {bound}")
        else:
            stuck = deadlock_with_bound(plan, bound, forward_only)
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
        tags = self.prepare(plan)
        bound = self.send_bound(plan, forward_only)
        board = AbortBoard(self.store, f"mindspeed_flow/runtime/{self.generation}/abort/{self.steps}")
        self.steps += 1
        transport = Transport(self.ranks, self.group, self.options.wait, board, self.waiters, bound,
                              self.channels)
        step = _Step(self, plan, tags, transport, forward_step_func, bindings, forward_only,
                     collect_non_loss_data, loss or LossRules())
        program = plan.programs[self.rank]
        timeline = Timeline(self.rank)
        hooks = _last_backwards(program, list(bindings)) if before_last_backward and not forward_only else {}
        index, action = -1, None
        try:
            for index, action in enumerate(program):
                if forward_only and action.kind in SKIPPED_WHEN_FORWARD_ONLY:
                    continue
                for which in hooks.get(index, ()):
                    before_last_backward(which)
                start = time.monotonic()
                step.do(action)
                timeline.stamps.append(Stamp(index, action, start, time.monotonic()))
                transport.retire()
            index, action = len(program), Action(Kind.GRAD_REDUCE, "end-of-step")
            transport.drain()
            reported = board.read()
            if reported is not None:
                raise PeerFailure(f"another rank failed: {reported}")
        except PeerFailure as exc:
            board.post(f"{where(self.rank, index, action)}: {exc}")
            raise ActionFailed(self.rank, index, action, str(exc)) from exc
        except Exception as exc:
            reason = f"{type(exc).__name__}: {exc}"
            board.post(f"{where(self.rank, index, action)}: {reason}")
            raise ActionFailed(self.rank, index, action, reason) from exc
        return StepResult(step.store, step.total_num_tokens, timeline, transport.peak_pending)


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


def set_input_tensor(model: torch.nn.Module, tensors: list) -> None:
    """``model.set_input_tensor(tensors)``, looking through wrappers' ``.module`` as
    Megatron's ``get_attr_wrapped_model`` does."""
    inner = model
    while not hasattr(inner, "set_input_tensor") and hasattr(inner, "module"):
        inner = inner.module
    if not hasattr(inner, "set_input_tensor"):
        raise AttributeError(f"{type(model).__name__} has no set_input_tensor (nor a wrapped .module that has)")
    inner.set_input_tensor(tensors)


class _Step:
    """The tensors of one step, by (microbatch, key), and one method per action kind."""

    def __init__(self, executor: Executor, plan: Plan, tags: dict, transport: Transport,
                 forward_step_func: Callable, bindings: Mapping[tuple[str, int], Binding],
                 forward_only: bool, collect_non_loss_data: bool, loss: LossRules) -> None:
        self.rank = executor.rank
        self.plan = plan
        self.tags = tags
        self.transport = transport
        self.forward_step_func = forward_step_func
        self.bindings = bindings
        self.forward_only = forward_only
        self.collect_non_loss_data = collect_non_loss_data
        self.loss = loss
        self.feeds: dict[int, MicrobatchFeed] = {}
        self.arrived: dict[tuple[int, str], torch.Tensor] = {}  # inputs waiting for their forward
        self.inputs: dict[tuple[int, str], torch.Tensor] = {}  # a visit's input, for its backward
        self.outputs: dict[tuple[int, str], torch.Tensor] = {}  # a visit's output (with its graph)
        self.grads: dict[tuple[int, str], torch.Tensor | None] = {}  # gradients of outputs
        self.pool: dict[tuple[int, str], torch.Tensor] = {}
        self.shared_pool = executor.pool
        self.step_number = executor.steps
        self.store: list = []
        self.total_num_tokens = torch.zeros([], dtype=torch.int)
        self.handlers = {
            Kind.FORWARD: self.forward, Kind.BACKWARD: self.backward, Kind.BACKWARD_INPUT: self.backward,
            Kind.BACKWARD_WEIGHT: self.backward_weight, Kind.SEND_ACT: self.send, Kind.SEND_GRAD: self.send,
            Kind.RECV_ACT: self.recv, Kind.RECV_GRAD: self.recv, Kind.POOL_PUT: self.put,
            Kind.POOL_GET: self.get, Kind.PARAM_BROADCAST: self.broadcast, Kind.GRAD_REDUCE: self.reduce,
        }

    def do(self, action: Action) -> None:
        self.handlers[action.kind](action)

    # ------------------------------------------------------------------ helpers

    def binding(self, a: Action, enter: bool = True) -> Binding:
        """The visit's binding, entered (:attr:`Binding.enter`) unless ``enter`` is False."""
        try:
            binding = self.bindings[(a.region, a.stage)]
        except KeyError:
            raise KeyError(f"no model chunk bound to {a.region}.s{a.stage} on rank {self.rank} "
                           f"(bound: {sorted(self.bindings)})") from None
        if enter and binding.enter is not None:
            binding.enter()
        return binding

    def visit(self, a: Action) -> tuple[int, tuple]:
        k, _ = self.plan.visits[(a.microbatch, a.region, a.stage)]
        return k, self.plan.paths[a.microbatch]

    def data(self, binding: Binding, microbatch: int) -> Any:
        if binding.data_iterator is None:
            return None
        feed = self.feeds.get(id(binding.data_iterator))
        if feed is None:
            feed = self.feeds[id(binding.data_iterator)] = MicrobatchFeed(binding.data_iterator)
        return feed.one_shot(microbatch)

    def outbound(self, a: Action) -> torch.Tensor:
        if a.kind is Kind.SEND_ACT or a.kind is Kind.POOL_PUT and a.key.endswith(":act"):
            return self.outputs[(a.microbatch, a.key[: -len(":act")])].detach()
        grad = self.grads.pop((a.microbatch, a.key))
        if grad is None:
            raise RuntimeError(f"no gradient reached the input of the visit after {a.key[:-5]}")
        return grad

    def inbound(self, a: Action, tensor: torch.Tensor) -> None:
        if a.key.endswith(":act"):
            self.arrived[(a.microbatch, a.key)] = tensor
        else:
            self.grads[(a.microbatch, a.key)] = tensor

    def device(self, a: Action) -> torch.device:
        binding = self.bindings.get((a.region, a.stage))
        param = next(binding.module.parameters(), None) if binding else None
        return param.device if param is not None else torch.device("cpu")

    def describe(self, a: Action) -> Callable[[], str]:
        return lambda: f"`{' '.join(str(a).split())}`"

    # ------------------------------------------------------------------ computes

    def forward(self, a: Action) -> None:
        m = a.microbatch
        binding = self.binding(a)
        k, path = self.visit(a)
        visit = path[k]
        if k == 0:
            inputs: list = [None]
        else:
            upstream = path[k - 1]
            key = (m, f"{upstream.tag}:act")
            tensor = self.arrived.pop(key, None)
            if tensor is None:  # the upstream visit ran here: its output, cut from its graph
                tensor = self.outputs[(m, upstream.tag)].detach()
            if upstream.backward is not None and not self.forward_only:
                tensor.requires_grad_()
            self.inputs[(m, visit.tag)] = tensor
            inputs = [tensor]
        set_input_tensor(binding.module, inputs)
        output, loss_func = self.forward_step_func(self.data(binding, m), binding.module)
        if k == len(path) - 1:
            output = self.apply_loss(output, loss_func)
        if not self.forward_only or k < len(path) - 1:
            self.outputs[(m, visit.tag)] = output

    def apply_loss(self, output: Any, loss_func: Callable) -> Any:
        """Megatron's last-stage rules (``schedules.forward_step``), to the letter."""
        if self.collect_non_loss_data:
            self.store.append(loss_func(output, non_loss_data=True))
            return output
        outputs = loss_func(output)
        if len(outputs) == 3:
            output, num_tokens, reduced = outputs
            if not self.loss.calculate_per_token_loss:
                output /= num_tokens
                output *= self.loss.context_parallel_size
                output /= self.plan.num_microbatches
            self.total_num_tokens += torch.as_tensor(num_tokens).to(self.total_num_tokens.device)
        elif len(outputs) == 2:
            output, reduced = outputs
            output *= self.loss.context_parallel_size
            output /= self.plan.num_microbatches
        else:
            raise ValueError(f"loss_func returned {len(outputs)} values; Megatron's contract is 2 "
                             "(loss, reduced) or 3 (loss, num_tokens, reduced)")
        self.store.append(reduced)
        return output

    def backward(self, a: Action) -> None:
        m = a.microbatch
        self.binding(a)  # entered: the chunk's hooks (DDP's grad sync...) run under its virtual rank
        k, path = self.visit(a)
        visit = path[k]
        last = k == len(path) - 1
        output = self.outputs[(m, visit.tag)]
        grad = None if last else self.grads.pop((m, f"{visit.tag}:grad"))
        if last and self.loss.grad_scale_func is not None:
            output = self.loss.grad_scale_func(output)
        tensor = self.inputs.get((m, visit.tag))
        wants_input_grad = tensor is not None and tensor.requires_grad
        split = a.kind is Kind.BACKWARD_INPUT and visit.backward == "IW"
        if output.requires_grad:
            if a.kind is Kind.BACKWARD:
                torch.autograd.backward(output, grad_tensors=grad)
            elif wants_input_grad:
                torch.autograd.backward(output, grad_tensors=grad, inputs=[tensor], retain_graph=split)
        if split:
            self.outputs[(m, visit.tag)] = output
            self.grads[(m, f"{visit.tag}:weight")] = grad
        else:
            del self.outputs[(m, visit.tag)]
        self.inputs.pop((m, visit.tag), None)
        if wants_input_grad:
            self.grads[(m, f"{path[k - 1].tag}:grad")] = tensor.grad

    def backward_weight(self, a: Action) -> None:
        m = a.microbatch
        tag = f"{a.region}.s{a.stage}"
        output = self.outputs.pop((m, tag))
        grad = self.grads.pop((m, f"{tag}:weight"))
        params = [p for p in self.binding(a).module.parameters() if p.requires_grad]
        if output.requires_grad and params:
            torch.autograd.backward(output, grad_tensors=grad, inputs=params)

    # ------------------------------------------------------------------ transfers

    def send(self, a: Action) -> None:
        self.transport.send(self.outbound(a), a.peer, self.tags[(a.key, a.microbatch)], self.describe(a), a.key)

    def recv(self, a: Action) -> None:
        tensor = self.transport.recv(a.peer, self.tags[(a.key, a.microbatch)], self.device(a), self.describe(a),
                                     a.key)
        self.inbound(a, tensor)

    def sample_meta(self, a: Action) -> dict:
        """``sample_ids`` / ``token_counts`` of the microbatch's data item (a dict), if it
        has them and this rank read it: they travel with the embeddings in the pool."""
        binding = self.bindings.get((a.region, a.stage))
        feed = self.feeds.get(id(binding.data_iterator)) if binding is not None else None
        item = feed.items[a.microbatch] if feed is not None and len(feed.items) > a.microbatch else None
        if not isinstance(item, dict):
            return {}
        return {k: torch.as_tensor(item[k]).tolist() for k in _SAMPLE_META if k in item}

    def pool_key(self, a: Action) -> str:
        return f"step{self.step_number}/{a.key}/mb{a.microbatch}"

    def put(self, a: Action) -> None:
        if self.shared_pool is not None:
            meta = {"microbatch": a.microbatch, "key": a.key, "rank": self.rank, **self.sample_meta(a)}
            self.shared_pool.put(self.pool_key(a), self.outbound(a), meta, timeout=self.transport.policy.timeout_s)
            return
        self.pool[(a.microbatch, a.key)] = self.outbound(a)

    def get(self, a: Action) -> None:
        if self.shared_pool is not None:
            key = self.pool_key(a)
            tensor = self.shared_pool.get(key, timeout=self.transport.policy.timeout_s)
            self.shared_pool.release(key)
            self.inbound(a, tensor.to(self.device(a)))
            return
        try:
            tensor = self.pool.pop((a.microbatch, a.key))
        except KeyError:
            raise RuntimeError(
                f"pool get of [{a.key}] mb{a.microbatch} from r{a.peer}: only the in-process "
                "('local') pool exists yet, and the put ran on another rank") from None
        self.inbound(a, tensor)

    # ------------------------------------------------------------------ collectives

    def region_params(self, a: Action) -> list[torch.nn.Parameter]:
        return [p for p in self.binding(Action(a.kind, a.region, 0), enter=False).module.parameters() if p.requires_grad]

    def broadcast(self, a: Action) -> None:
        """The group's first rank's parameters to every other replica."""
        params = self.region_params(a)
        channel = f"{a.kind.value}:{a.region}"
        root, tag = a.group[0], self.tags[(channel, None)]
        if self.rank == root:
            flat = torch.cat([p.detach().reshape(-1) for p in params])
            for peer in a.group[1:]:
                self.transport.send(flat, peer, tag, self.describe(a), channel)
            return
        flat = self.transport.recv(root, tag, params[0].device, self.describe(a), channel)
        _scatter(flat, [p.data for p in params])

    def reduce(self, a: Action) -> None:
        """Every replica's gradients summed in group order, the sum on every replica."""
        params = self.region_params(a)
        channel = f"{a.kind.value}:{a.region}"
        root, tag = a.group[0], self.tags[(channel, None)]
        flat = torch.cat([(p.grad if p.grad is not None else torch.zeros_like(p)).reshape(-1) for p in params])
        if self.rank == root:
            total = None
            for member in a.group:
                part = flat if member == root else self.transport.recv(
                    member, tag, flat.device, self.describe(a), channel)
                total = part.clone() if total is None else total.add_(part)
            for peer in a.group[1:]:
                self.transport.send(total, peer, tag, self.describe(a), channel)
        else:
            self.transport.send(flat, root, tag, self.describe(a), channel)
            total = self.transport.recv(root, tag, flat.device, self.describe(a), channel)
        grads = [torch.empty_like(p) for p in params]
        _scatter(total, grads)
        for p, g in zip(params, grads):
            p.grad = g


def _scatter(flat: torch.Tensor, tensors: Sequence[torch.Tensor]) -> None:
    offset = 0
    with torch.no_grad():
        for t in tensors:
            t.copy_(flat[offset: offset + t.numel()].view_as(t))
            offset += t.numel()
