"""Memory per device of one module config: weights, gradients and optimizer state, plus
the activations of the microbatches a rank holds for their backward pass.

Mixed-precision Adam as Megatron keeps it: bf16 weights (2 bytes per parameter), fp32
gradient buffer (4) and fp32 master weights, momentum and variance (12), the last sharded
over data parallel ranks with the distributed optimizer.  A frozen module keeps its bf16
weights only.  Activations per layer and microbatch are ``34 * tokens * hidden / tp``
bytes (Korthikanti et al. 2022 with sequence parallelism and flash attention, so no
``tokens^2`` term); how many microbatches a rank holds comes from the schedule simulator's
``peak_live`` (as microbatches in flight, :func:`.pipeline.in_flight`, so each part of a
stage is charged once per microbatch), not from a formula.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from .specs import GIB, ModuleSpec

ACTIVATION_BYTES_PER_TOKEN_HIDDEN = 34
BF16 = 2
FP32 = 4


@dataclass(frozen=True)
class MemoryEstimate:
    """Bytes on the fullest device of a module config."""

    states: float  # weights, gradients, optimizer state
    activations: float

    @property
    def total(self) -> float:
        return self.states + self.activations

    def describe(self) -> str:
        return (f"{self.total / GIB:.1f} GiB (states {self.states / GIB:.1f}, "
                f"activations {self.activations / GIB:.1f})")


def bytes_per_param(trainable: bool, distributed_optimizer: bool, dp: int) -> float:
    if not trainable:
        return BF16
    optimizer = 3 * FP32
    return BF16 + FP32 + (optimizer / dp if distributed_optimizer else optimizer)


def layer_activation_bytes(spec: ModuleSpec, samples: int, tp: int) -> float:
    """Activations one layer keeps for the backward of one microbatch of ``samples``."""
    return ACTIVATION_BYTES_PER_TOKEN_HIDDEN * samples * spec.tokens_per_sample * spec.hidden / tp


def stage_memory(spec: ModuleSpec, *, layers: int, tp: int, dp: int, samples: int, live: int,
                 first: bool, last: bool, distributed_optimizer: bool) -> MemoryEstimate:
    """One pipeline stage (or a whole unpipelined module: ``first`` and ``last``) holding
    ``live`` microbatches of ``samples`` samples in flight.  ``layers``, ``dp`` and ``live``
    may be numpy arrays (many configs of one shape at once, :func:`.colocated.layer_caps`);
    the estimate's fields are then arrays too."""
    params = layers * spec.layer_params + spec.vocab * spec.hidden * (int(first) + int(last))
    states = params / tp * bytes_per_param(spec.trainable, distributed_optimizer, dp)
    # A frozen stage without backward still needs one microbatch's working set.
    held = (np.maximum(live, 1) if isinstance(live, np.ndarray) else max(live, 1)) * layers \
        * layer_activation_bytes(spec, samples, tp)
    if last and spec.vocab:  # fp32 logits of one microbatch
        held += FP32 * samples * spec.tokens_per_sample * spec.vocab / tp
    return MemoryEstimate(states=states, activations=held)


def fullest(estimates: list[MemoryEstimate]) -> MemoryEstimate:
    """The estimate with the largest total (the first of equals), config by config when
    the fields are arrays over many configs."""
    totals = [e.total for e in estimates]
    if not any(isinstance(t, np.ndarray) for t in totals):
        return max(estimates, key=lambda m: m.total)
    pick = np.argmax(np.stack(np.broadcast_arrays(*totals)), axis=0)
    return MemoryEstimate(np.choose(pick, np.broadcast_arrays(*[e.states for e in estimates])),
                          np.choose(pick, np.broadcast_arrays(*[e.activations for e in estimates])))
