"""The throughput proxy: predicted step time, rate and memory of any module config.

From a :class:`~.profile.Profile` measured at a few points the proxy predicts configs that
were never run:

- compute: a layer's forward FLOPs per rank divided by the achieved FLOP/s, where the
  achieved fraction of peak is read off the profile's ``tp = 1`` points as a function of
  the work per rank (piecewise linear in log FLOPs, flat beyond the measured range) and
  multiplied by the cluster's peak.  Smaller GEMMs per rank under TP land lower on that
  curve: TP's efficiency loss;
- TP communication: Megatron's two all-reduces per layer in the forward and two in the
  backward (as reduce-scatter + all-gather with sequence parallelism: the same volume),
  ring volume ``2 (tp-1)/tp`` of the layer's activations, over the intra-node link;
- calibration: compute is multiplied by a factor fitted per module and TP size so that
  the model reproduces every point the profile measured, TP > 1 included
  (:mod:`.tp_calibration`: interpolated in work and in log tp, held beyond the measured TP);
- the pipeline: step time and bubble from the schedule simulator (:mod:`.pipeline`);
- data parallel: one ring all-reduce (or reduce-scatter + all-gather) of the bf16
  gradients per step over the inter-node link, not overlapped;
- memory (:mod:`.memory`), with the microbatches each stage holds from the simulator.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from statistics import median

import numpy as np

from . import memory
from .errors import AllocatorError
from .memory import MemoryEstimate
from .pipeline import PipelineStep, backbone_layout, pipeline_step, step_lower_bound, uniform_split
from .profile import Profile
from .specs import ClusterSpec, ModuleSpec, Workload
from .tp_calibration import TPCalibration, piecewise_log
from mindspeed_flow.schedule import Link, RegionCost


@dataclass(frozen=True)
class EncoderEstimate:
    """Predicted performance of the encoder at (tp, dp): ``dp`` producer replicas."""

    tp: int
    dp: int
    step_time: float  # seconds to produce one global batch
    rate: float  # samples per second
    memory: MemoryEstimate

    @property
    def devices(self) -> int:
        return self.tp * self.dp


@dataclass(frozen=True)
class BackboneEstimate:
    """Predicted performance of the backbone at (tp, pp, micro batch, dp)."""

    tp: int
    pp: int
    micro_batch: int
    dp: int
    split: tuple[int, ...]
    microbatches: int  # per replica and step
    step_time: float
    bubble_fraction: float
    rate: float  # samples per second
    memory: MemoryEstimate

    @property
    def devices(self) -> int:
        return self.tp * self.pp * self.dp


class ProxyModel:
    """Predicts module configs on ``cluster`` from a ``profile`` (see the module docstring)."""

    def __init__(self, profile: Profile, cluster: ClusterSpec) -> None:
        self.profile = profile
        self.cluster = cluster
        self._curves = {m: self._efficiency_curve(m) for m in ("encoder", "backbone")}
        self._backward_ratio = {m: median(p.backward_s / p.forward_s for p in profile.module_points(m))
                                for m in ("encoder", "backbone")}
        self.intra = Link(cluster.latency_us * 1e-6, cluster.intra_node_gbps * 1e9)
        self.inter = Link(cluster.latency_us * 1e-6, cluster.inter_node_gbps * 1e9)
        self.calibration = TPCalibration.fit(profile, self._backward_ratio, self._profiled_terms)

    def _profiled_terms(self, module: str, tp: int, flops_per_rank: float, samples: int, seq: int,
                        hidden: int) -> tuple[float, float]:
        """The formula's compute and one-direction TP communication seconds of one layer on
        the profiled device (its peak, its TP link): what the calibration is fitted against."""
        compute = flops_per_rank / (self.efficiency(module, flops_per_rank) * self.profile.peak_tflops * 1e12)
        link = Link(self.profile.tp_link_latency_us * 1e-6, self.profile.tp_link_gbps * 1e9)
        return compute, self.tp_comm_seconds(link, tp, samples * seq * hidden)

    @staticmethod
    def tp_comm_seconds(link: Link, tp: int, tokens_times_hidden: float) -> float:
        """Megatron's two TP all-reduces of one direction of one layer (ring volume)."""
        if tp == 1:
            return 0.0
        return 2 * link.seconds(2 * (tp - 1) / tp * memory.BF16 * tokens_times_hidden)

    def _efficiency_curve(self, module: str) -> list[tuple[float, float]]:
        points = self.profile.module_points(module, tp=1)
        if not points:
            raise AllocatorError(f"profile ({self.profile.device}): no tp=1 points for the {module}")
        peak = self.profile.peak_tflops * 1e12
        return sorted((math.log(p.flops / p.layers), p.achieved_flops / peak) for p in points)

    def efficiency(self, module: str, flops_per_rank: float) -> float:
        """Achieved fraction of peak for one layer's forward of ``flops_per_rank`` FLOPs."""
        return piecewise_log(self._curves[module], flops_per_rank)

    def compute_seconds(self, module: str, flops_per_rank: float) -> float:
        """Seconds for ``flops_per_rank`` FLOPs at the efficiency the profile shows for that much work."""
        return flops_per_rank / (self.efficiency(module, flops_per_rank) * self.cluster.peak_tflops * 1e12)

    def layer_seconds(self, module: str, spec: ModuleSpec, tp: int, samples: int) -> tuple[float, float]:
        """(forward, backward) seconds of one layer for one microbatch on a TP group:
        calibrated compute plus the TP all-reduces over the intra-node link."""
        flops_per_rank = spec.layer_forward_flops(samples) / tp
        compute = self.calibration.factor(module, tp, flops_per_rank) * self.compute_seconds(module, flops_per_rank)
        comm = self.tp_comm_seconds(self.intra, tp, samples * spec.tokens_per_sample * spec.hidden)
        return compute + comm, self._backward_ratio[module] * compute + comm

    def gradient_reduce_seconds(self, param_count: float, tp: int, dp: int) -> float:
        """Ring all-reduce of one rank's bf16 gradients over ``dp`` replicas."""
        if dp == 1:
            return 0.0
        return self.inter.seconds(2 * (dp - 1) / dp * memory.BF16 * param_count / tp)

    def encoder(self, spec: ModuleSpec, workload: Workload, tp: int, dp: int) -> EncoderEstimate:
        """``dp`` encoder replicas of ``tp`` devices: the global batch's forward (and backward
        when trained) spread over them, plus the gradient reduce; memory with the in-flight bound."""
        samples = workload.encoder_micro_batch
        microbatches = workload.global_batch / (dp * samples)
        forward, backward = self.layer_seconds("encoder", spec, tp, samples)
        per_microbatch = spec.layers * (forward + (backward if spec.trainable else 0.0))
        step = microbatches * per_microbatch
        if spec.trainable:
            step += self.gradient_reduce_seconds(spec.params, tp, dp)
        live = min(workload.encoder_in_flight, math.ceil(microbatches)) if spec.trainable else 0
        mem = memory.stage_memory(spec, layers=spec.layers, tp=tp, dp=dp, samples=samples, live=live,
                                  first=True, last=True, distributed_optimizer=workload.distributed_optimizer)
        return EncoderEstimate(tp, dp, step, workload.global_batch / step, mem)

    def stage_link(self, tp: int, pp: int) -> Link:
        """Between pipeline stages: inside a node while the whole pipeline fits one."""
        return self.inter if tp * pp > self.cluster.devices_per_node else self.intra

    def region_cost(self, module: str, spec: ModuleSpec, tp: int, samples: int, layers: int) -> RegionCost:
        """``layers`` layers of a module for one microbatch of ``samples`` on a TP group,
        as the simulator's per-region cost (output: the activations sent on, over TP)."""
        forward, backward = self.layer_seconds(module, spec, tp, samples)
        output = memory.BF16 * samples * spec.tokens_per_sample * spec.hidden / tp
        return RegionCost(forward=layers * forward, backward_ratio=backward / forward, output_bytes=output)

    def head_cost(self, spec: ModuleSpec, tp: int, samples: int) -> RegionCost:
        """The LM head (parallel output layer) for one microbatch."""
        forward = self.compute_seconds("backbone", max(spec.head_forward_flops(samples), 1.0) / tp)
        output = memory.BF16 * samples * spec.tokens_per_sample * spec.hidden / tp
        return RegionCost(forward=forward, backward_ratio=self._backward_ratio["backbone"], output_bytes=output)

    def backbone_costs(self, spec: ModuleSpec, tp: int, micro_batch: int) -> tuple[RegionCost, RegionCost]:
        """The backbone layout's region costs: all its layers, then the head."""
        return self.region_cost("backbone", spec, tp, micro_batch, spec.layers), self.head_cost(spec, tp, micro_batch)

    def pipeline(self, spec: ModuleSpec, tp: int, pp: int, micro_batch: int, microbatches: int) -> PipelineStep:
        """The backbone's 1F1B step over ``pp`` stages, from the schedule simulator."""
        return pipeline_step(backbone_layout(spec.layers, pp, spec.trainable), microbatches,
                             self.backbone_costs(spec, tp, micro_batch), self.stage_link(tp, pp))

    def backbone(self, spec: ModuleSpec, workload: Workload, tp: int, pp: int, micro_batch: int,
                 dp: int) -> BackboneEstimate:
        """``dp`` backbone pipelines: the simulated step of their share of the global batch
        plus the gradient reduce, and the fullest stage's memory with the simulator's ``peak_live``."""
        microbatches = workload.global_batch // (dp * micro_batch)
        sim = self.pipeline(spec, tp, pp, micro_batch, microbatches)
        step = sim.step_time + self._gradient_reduce(spec, tp, pp, dp)
        mem = self.backbone_memory(spec, workload, tp, pp, micro_batch, dp, sim.peak_live)
        return BackboneEstimate(tp, pp, micro_batch, dp, uniform_split(spec.layers, pp), microbatches, step,
                                sim.bubble_fraction, workload.global_batch / step, mem)

    def _gradient_reduce(self, spec: ModuleSpec, tp: int, pp: int, dp: int) -> float:
        """The gradient reduce of the largest stage (the first: embedding; or the last: head)."""
        if not spec.trainable:
            return 0.0
        stage_params = spec.layers // pp * spec.layer_params + spec.vocab * spec.hidden * (2 if pp == 1 else 1)
        return self.gradient_reduce_seconds(stage_params, tp, dp)

    def backbone_rate_bound(self, spec: ModuleSpec, workload: Workload, tp: int, pp: int, micro_batch: int,
                            dp: int) -> float:
        """An upper bound on :meth:`backbone`'s rate without simulating (see
        :func:`.pipeline.step_lower_bound`), plus the gradient reduce."""
        microbatches = workload.global_batch // (dp * micro_batch)
        shortest = step_lower_bound(backbone_layout(spec.layers, pp, spec.trainable),
                                    self.backbone_costs(spec, tp, micro_batch), microbatches)
        return workload.global_batch / (shortest + self._gradient_reduce(spec, tp, pp, dp))

    @staticmethod
    def backbone_memory(spec: ModuleSpec, workload: Workload, tp: int, pp: int, micro_batch: int,
                        dp: int | np.ndarray, live: tuple) -> MemoryEstimate:
        """The fullest stage's memory with ``live[s]`` microbatches held on stage ``s``;
        ``dp`` and ``live`` may be numpy arrays over replica counts (the candidate pool
        checks every count of a shape at once)."""
        split = uniform_split(spec.layers, pp)
        return memory.fullest([
            memory.stage_memory(spec, layers=split[s], tp=tp, dp=dp, samples=micro_batch,
                                live=live[s] if spec.trainable else 0,
                                first=s == 0, last=s == pp - 1,
                                distributed_optimizer=workload.distributed_optimizer)
            for s in range(pp)])

    def mfu(self, spec_encoder: ModuleSpec, spec_backbone: ModuleSpec, samples_per_s: float,
            devices: int) -> float:
        """Model FLOPs utilisation: 3x forward FLOPs for trained modules, 1x for frozen."""
        flops = sum((3.0 if s.trainable else 1.0) * s.forward_flops(1) for s in (spec_encoder, spec_backbone))
        return float(flops * samples_per_s / (devices * self.cluster.peak_tflops * 1e12))
