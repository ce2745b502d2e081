"""One step of one rank: what each lowered operation (:mod:`.lowering`) does.

- ``COMPUTE`` ``F``: hand the visit's input to the model chunk (``set_input_tensor``, as
  Megatron does), call ``forward_step_func(data_iterator, model)``; on the last visit of a
  microbatch apply ``loss_func`` exactly as Megatron's ``forward_step`` does (2- and 3-value
  returns, division by the microbatch count, ``collect_non_loss_data``);
- ``COMPUTE`` ``B`` (input and weight gradients), ``I`` (input gradients only: a frozen
  region on the gradient path, or the first half of a split backward), ``W`` (weight
  gradients only);
- ``SEND`` / ``RECV``: a boundary's activation or gradient, or a collective's buffer, over
  the point-to-point :class:`.Transport` on the message's channel and tag;
- ``PUT`` / ``GET``: through the executor's :mod:`mindspeed_flow.pool` (the getter releases
  what it took);
- ``PACK`` / ``UNPACK``: a replicated region's parameters or gradients into one flat buffer
  (the root of a reduce adds the members' buffers to its own as they arrive), and the
  received parameters or summed gradients written back.

Tensors are held by (microbatch, :class:`.BoundaryKey`): a visit's output under its ``act``
key, the gradient of an output under its ``grad`` key, what a split backward keeps for its
``W`` under its ``weight`` key.
"""

from __future__ import annotations

from typing import Any, Callable, Mapping

import torch

from ..flat_grads import flatten_grads, scatter_flat, set_accumulated_grads
from ..schedule.actions import Action, Kind
from ..schedule.keys import BoundaryKey, BoundaryKind
from ..schedule.plan import Plan
from .feed import MicrobatchFeed
from .lowering import Op, OpKind, Payload, channel_of
from .transport import Transport

ACT, GRAD, WEIGHT = BoundaryKind.ACT, BoundaryKind.GRAD, BoundaryKind.WEIGHT


def set_input_tensor(model: torch.nn.Module, tensors: list) -> None:
    """``model.set_input_tensor(tensors)``, looking through wrappers' ``.module`` as
    Megatron's ``get_attr_wrapped_model`` does."""
    inner = model
    while not hasattr(inner, "set_input_tensor") and hasattr(inner, "module"):
        inner = inner.module
    if not hasattr(inner, "set_input_tensor"):
        raise AttributeError(f"{type(model).__name__} has no set_input_tensor (nor a wrapped .module that has)")
    inner.set_input_tensor(tensors)


class Step:
    """The tensors of one step, by (microbatch, key), and one method per operation kind."""

    def __init__(self, rank: int, plan: Plan, transport: Transport, pool: Any, step_number: int,
                 forward_step_func: Callable, bindings: Mapping[tuple[str, int], Any],
                 forward_only: bool, collect_non_loss_data: bool, loss: Any) -> None:
        self.rank = rank
        self.plan = plan
        self.transport = transport
        self.pool = pool
        self.step_number = step_number
        self.forward_step_func = forward_step_func
        self.bindings = bindings
        self.forward_only = forward_only
        self.collect_non_loss_data = collect_non_loss_data
        self.loss = loss
        self.feeds: dict[int, MicrobatchFeed] = {}
        self.arrived: dict[tuple[int, BoundaryKey], torch.Tensor] = {}  # inputs waiting for their forward
        self.inputs: dict[tuple[int, str], torch.Tensor] = {}  # a visit's input, for its backward
        self.outputs: dict[tuple[int, BoundaryKey], torch.Tensor] = {}  # a visit's output (with its graph)
        self.grads: dict[tuple[int, BoundaryKey], torch.Tensor | None] = {}  # gradients of outputs
        self.flat: dict[str, torch.Tensor] = {}  # the running collective's buffer, by channel
        self.store: list = []
        self.total_num_tokens = torch.zeros([], dtype=torch.int)
        self.handlers = {OpKind.COMPUTE: self.compute, OpKind.SEND: self.send, OpKind.RECV: self.recv,
                         OpKind.PUT: self.put, OpKind.GET: self.get, OpKind.PACK: self.pack,
                         OpKind.UNPACK: self.unpack}
        self.computes = {Kind.FORWARD: self.forward, Kind.BACKWARD: self.backward,
                         Kind.BACKWARD_INPUT: self.backward, Kind.BACKWARD_WEIGHT: self.backward_weight}

    def do(self, op: Op) -> None:
        self.handlers[op.kind](op)

    def end_action(self) -> None:
        """A collective's buffers live for its action only (its sends hold their own)."""
        self.flat.clear()

    # ------------------------------------------------------------------ helpers

    def binding(self, a: Action, enter: bool = True) -> Any:
        """The visit's binding, entered (``Binding.enter``) unless ``enter`` is False."""
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

    def data(self, binding: Any, microbatch: int) -> Any:
        if binding.data_iterator is None:
            return None
        feed = self.feeds.get(id(binding.data_iterator))
        if feed is None:
            feed = self.feeds[id(binding.data_iterator)] = MicrobatchFeed(binding.data_iterator)
        return feed.one_shot(microbatch)

    def outbound(self, op: Op) -> torch.Tensor:
        """What a send or put of a boundary carries: the visit's output, or its gradient."""
        m, key = op.message.microbatch, op.message.channel
        if op.message.payload is Payload.ACT:
            return self.outputs[(m, key)].detach()
        grad = self.grads.pop((m, key))
        if grad is None:
            raise RuntimeError(f"no gradient reached the input of the visit after {key.tag}")
        return grad

    def inbound(self, op: Op, tensor: torch.Tensor) -> None:
        m, key = op.message.microbatch, op.message.channel
        if op.message.payload is Payload.ACT:
            self.arrived[(m, key)] = tensor
        else:
            self.grads[(m, key)] = tensor

    def device(self, a: Action) -> torch.device:
        binding = self.bindings.get((a.region, a.stage))
        param = next(binding.module.parameters(), None) if binding else None
        return param.device if param is not None else torch.device("cpu")

    def describe(self, a: Action) -> Callable[[], str]:
        return lambda: f"`{' '.join(str(a).split())}`"

    # ------------------------------------------------------------------ computes

    def compute(self, op: Op) -> None:
        self.computes[op.action.kind](op.action)

    def forward(self, a: Action) -> None:
        m = a.microbatch
        binding = self.binding(a)
        k, path = self.visit(a)
        visit = path[k]
        if k == 0:
            inputs: list = [None]
        else:
            upstream = path[k - 1]
            tensor = self.arrived.pop((m, upstream.key(ACT)), None)
            if tensor is None:  # the upstream visit ran here: its output, cut from its graph
                tensor = self.outputs[(m, upstream.key(ACT))].detach()
            if upstream.backward is not None and not self.forward_only:
                tensor.requires_grad_()
            self.inputs[(m, visit.tag)] = tensor
            inputs = [tensor]
        set_input_tensor(binding.module, inputs)
        output, loss_func = self.forward_step_func(self.data(binding, m), binding.module)
        if k == len(path) - 1:
            output = self.apply_loss(output, loss_func)
        if not self.forward_only or k < len(path) - 1:
            self.outputs[(m, visit.key(ACT))] = output

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
        output = self.outputs[(m, visit.key(ACT))]
        grad = None if last else self.grads.pop((m, visit.key(GRAD)))
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
            self.outputs[(m, visit.key(ACT))] = output
            self.grads[(m, visit.key(WEIGHT))] = grad
        else:
            del self.outputs[(m, visit.key(ACT))]
        self.inputs.pop((m, visit.tag), None)
        if wants_input_grad:
            self.grads[(m, path[k - 1].key(GRAD))] = tensor.grad

    def backward_weight(self, a: Action) -> None:
        m = a.microbatch
        output = self.outputs.pop((m, BoundaryKey(a.region, a.stage, ACT)))
        grad = self.grads.pop((m, BoundaryKey(a.region, a.stage, WEIGHT)))
        params = [p for p in self.binding(a).module.parameters() if p.requires_grad]
        if output.requires_grad and params:
            torch.autograd.backward(output, grad_tensors=grad, inputs=params)

    # ------------------------------------------------------------------ transfers

    def send(self, op: Op) -> None:
        message = op.message
        tensor = self.flat[message.channel] if message.microbatch is None else self.outbound(op)
        self.transport.send(tensor, message.dst, message.tag, self.describe(op.action), message.channel)

    def recv(self, op: Op) -> None:
        message = op.message
        collective = message.microbatch is None
        device = self.region_params(op.action)[0].device if collective else self.device(op.action)
        tensor = self.transport.recv(message.src, message.tag, device, self.describe(op.action), message.channel)
        if not collective:
            self.inbound(op, tensor)
        elif message.payload is Payload.GRADS:  # the root sums the members' in group order
            self.flat[message.channel].add_(tensor)
        else:
            self.flat[message.channel] = tensor

    def pool_key(self, op: Op) -> str:
        return f"step{self.step_number}/{op.message.channel}/mb{op.message.microbatch}"

    def put(self, op: Op) -> None:
        a = op.action
        meta = {"microbatch": a.microbatch, "key": str(a.key), "rank": self.rank}
        self.pool.put(self.pool_key(op), self.outbound(op), meta, timeout=self.transport.policy.timeout_s)

    def get(self, op: Op) -> None:
        key = self.pool_key(op)
        tensor = self.pool.get(key, timeout=self.transport.policy.timeout_s)
        self.pool.release(key)
        self.inbound(op, tensor.to(self.device(op.action)))

    # ------------------------------------------------------------------ collectives

    def region_params(self, a: Action) -> list[torch.nn.Parameter]:
        return [p for p in self.binding(Action(a.kind, a.region, 0), enter=False).module.parameters()
                if p.requires_grad]

    def pack(self, op: Op) -> None:
        """A replica's parameters (``BCAST`` root) or gradients (``REDUCE``) as one flat buffer."""
        params = self.region_params(op.action)
        if op.payload is Payload.PARAMS:
            flat = torch.cat([p.detach().reshape(-1) for p in params])
        else:
            flat = flatten_grads(params)
        self.flat[channel_of(op.action)] = flat

    def unpack(self, op: Op) -> None:
        """The received parameters into the replica's, or the summed gradients as its gradients
        (DDP's ``main_grad`` where there is one, else ``.grad``)."""
        params = self.region_params(op.action)
        flat = self.flat.pop(channel_of(op.action))
        if op.payload is Payload.PARAMS:
            scatter_flat(flat, [p.data for p in params])
            return
        set_accumulated_grads(params, flat)
