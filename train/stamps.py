"""The measured timeline of a step on one rank, as :class:`~mindspeed_flow.train.metrics.Interval` records.

Two sources, one clock (``time.monotonic``, shared by the processes of a host; every rank
measures from the same step origin, taken right after a barrier):

- Megatron's own 1F1B (the baseline): the run's ``forward_step_func`` is wrapped for ``F``
  and megatron-core's ``schedules.backward_step`` for ``B`` through a removable patch of the
  plugin's patching layer; nothing in Megatron is edited.  The non-interleaved schedule runs
  a rank's forwards and backwards each in microbatch order, so the k-th of each is
  microbatch k of this rank's share.
- Our executor (FlowTrain): its per-action :class:`~mindspeed_flow.runtime.Timeline`, every
  compute, transfer, pool ``PUT``/``GET`` and gradient reduction converted one to one.
"""

from __future__ import annotations

import time
from contextlib import contextmanager
from typing import Any, Callable, Iterator

from mindspeed_flow.schedule.regions import BACKBONE_REGION, ENCODER_REGION
from mindspeed_flow.train.metrics import NO_MICROBATCH, Interval

BACKWARD_STEP = "megatron.core.pipeline_parallel.schedules:backward_step"
_FEATURE = "train-stamps"
# Executor action kinds -> Interval kinds (``I``, input gradients only, is a backward).
_ACTION_KINDS = {"F": "F", "B": "B", "I": "B", "W": "W", "SEND_A": "SEND", "SEND_G": "SEND", "RECV_A": "RECV",
                 "RECV_G": "RECV", "PUT": "PUT", "GET": "GET", "REDUCE": "REDUCE"}


class StepStamps:
    """This rank's intervals of the current step, measured from ``origin``.

    On a GPU, kernels run after the call that launched them returns: an interval ends
    when the device has finished (``torch.cuda.synchronize``), so it measures compute,
    not launch."""

    def __init__(self, rank: int, device: Any = None) -> None:
        self.rank = rank
        self.origin = time.monotonic()
        self.intervals: list[Interval] = []
        self.sync: Callable[[], None] = lambda: None
        if device is not None and device.type == "cuda":
            import torch

            self.sync = torch.cuda.synchronize

    def start(self, origin: float) -> None:
        self.origin = origin
        self.intervals = []

    def add(self, region: str, kind: str, microbatch: int, start: float, end: float, ahead: int = 0) -> None:
        self.intervals.append(Interval(self.rank, region, kind, microbatch, max(0.0, start - self.origin),
                                       max(0.0, end - self.origin), ahead))

    def now(self) -> float:
        self.sync()
        return time.monotonic()

    @contextmanager
    def timed(self, region: str, kind: str, microbatch: int = NO_MICROBATCH) -> Iterator[None]:
        start = self.now()
        yield
        self.add(region, kind, microbatch, start, self.now())


class MegatronStamps(StepStamps):
    """``F`` and ``B`` of megatron-core's non-interleaved schedule on this rank.

    :meth:`install` wraps ``schedules.backward_step`` (the schedule looks it up in its module
    at every call, so the wrapper sees every backward); :meth:`remove` restores it.
    Microbatches are numbered within this rank's data-parallel replica, as Megatron does.
    A stage that runs an encoder inside it (the baseline's ViT in stage 0) splits its
    intervals at the encoder (:meth:`watch_encoder`).
    """

    def __init__(self, rank: int, device: Any = None) -> None:
        super().__init__(rank, device)
        self._forwards = 0
        self._backwards = 0
        self._registry: Any = None
        self._hooks: list = []
        self._encoder_done: float | None = None  # when this forward's encoder returned
        self._encoder_grad: float | None = None  # when this backward reached the encoder's output

    def start(self, origin: float) -> None:
        super().start(origin)
        self._forwards = self._backwards = 0

    def watch_encoder(self, encoder: Any) -> None:
        """Time ``encoder`` (a module the stage calls first in its forward, so last in its
        backward) as region ``vit``: its forward ends when it returns, its backward starts
        when the gradient reaches its output (a tensor hook)."""

        def returned(module: Any, args: Any, output: Any) -> None:
            self._encoder_done = self.now()
            if output.requires_grad:
                output.register_hook(reached)

        def reached(grad: Any) -> None:
            self._encoder_grad = self.now()

        self._hooks.append(encoder.register_forward_hook(returned))

    def forward_step(self, forward_step_func: Callable) -> Callable:
        """``forward_step_func`` that records an ``F`` interval around each call."""

        def timed_forward_step(data_iterator: Any, model: Any, *rest: Any) -> Any:
            self._encoder_done = None
            start = self.now()
            out = forward_step_func(data_iterator, model, *rest)
            self._record("F", self._forwards, start, self._encoder_done, self.now())
            self._forwards += 1
            return out

        return timed_forward_step

    def _backward(self, wrapped: Callable, instance: Any, args: tuple, kwargs: dict) -> Any:
        self._encoder_grad = None
        start = self.now()
        out = wrapped(*args, **kwargs)
        self._record("B", self._backwards, start, self._encoder_grad, self.now())
        self._backwards += 1
        return out

    def _record(self, kind: str, microbatch: int, start: float, split: float | None, end: float) -> None:
        """One ``llm`` interval, or the encoder's part (first in a forward, last in a
        backward) and the rest when the encoder ran at ``split``."""
        if split is None:
            self.add(BACKBONE_REGION, kind, microbatch, start, end)
            return
        first, second = (ENCODER_REGION, BACKBONE_REGION) if kind == "F" else (BACKBONE_REGION, ENCODER_REGION)
        self.add(first, kind, microbatch, start, split)
        self.add(second, kind, microbatch, split, end)

    def install(self) -> None:
        from mindspeed_flow.patching import Patch, PatchRegistry

        if self._registry is not None:
            return
        self._registry = PatchRegistry([Patch(
            feature=_FEATURE, target=BACKWARD_STEP, wrapper=self._backward,
            params="input_tensor, output_tensor, output_tensor_grad, model_type, config",
            checked=("megatron-core 0.12.3", "megatron-core 0.16.1"), rebind_aliases=False,
            description="time each backward of the baseline's 1F1B (B intervals of the report's Gantt chart)")])
        self._registry.enable({_FEATURE})

    def remove(self) -> None:
        if self._registry is not None:
            self._registry.remove()
            self._registry = None
        for hook in self._hooks:
            hook.remove()
        self._hooks = []


def executor_intervals(stamps: StepStamps, timeline: Any) -> None:
    """Add an executor step's :class:`~mindspeed_flow.runtime.Timeline` to ``stamps``: each
    action's kind mapped to the report's, microbatches numbered in this backbone replica's
    plan; parameter broadcasts have no report kind and are left out."""
    for s in timeline.stamps:
        kind = _ACTION_KINDS.get(s.action.kind.value)
        if kind is None:
            continue
        m = s.action.microbatch
        region = s.action.region if s.action.region in (ENCODER_REGION, BACKBONE_REGION) else BACKBONE_REGION
        stamps.add(region, kind, NO_MICROBATCH if m is None else m, s.start, s.end)
