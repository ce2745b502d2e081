"""What both runs share on one rank: the optimizer, the step loop around a run's forward and
backward, gradient reduction, checkpointing and the rank's measured record.

A run (:class:`~mindspeed_flow.train.baseline.BaselineTrainer`: co-located, the baseline and
the ablation chain's co-located runs; :class:`~mindspeed_flow.train.flow.FlowTrainer`) only builds its modules and runs one step's
forward and backward; everything that must be *the same* in both runs lives here, so that
parity and the report compare the runs and not two training loops:

- ``torch.optim.AdamW`` per rank over the rank's parameters, the config's hyperparameters;
- every trainable parameter ends the step with a gradient (zeros where nothing reached it),
  so AdamW treats a parameter the same way whichever run or replica computed nothing for it;
- the step loss is the loss convention's (sum of per-token CE over the step / the step's
  loss tokens), all-reduced so every rank reports the same number;
- a checkpoint is the rank's model, optimizer and RNG states: a trainer that loads it
  continues exactly as the one that wrote it would have.
"""

from __future__ import annotations

import ctypes
import gc
import random
import resource
import sys
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Iterable

import torch

from mindspeed_flow.train.errors import CheckpointMismatch
from mindspeed_flow.train.metrics import RankRecord, StepOutcome
from mindspeed_flow.train.stamps import StepStamps

if TYPE_CHECKING:
    from mindspeed_flow.train.config import TrainConfig
    from mindspeed_flow.train.feed import StepData
    from mindspeed_flow.train.launch import DistEnv
    from mindspeed_flow.train.runs import RunFeatures

RUNS = ("baseline", "three-phase", "flowtrain")


@dataclass(frozen=True)
class LocalStep:
    """What a run's forward and backward of one step left on this rank.

    ``loss``: this rank's share of the step loss (its last-stage microbatches' losses, 0
    elsewhere); ``padded_tokens``: this rank's share of the tokens the step computed, counted
    once per replica (0 on the other ranks of a replica).  Both are summed over the world.
    """

    loss: float
    padded_tokens: int


class Trainer:
    """One run on one rank; subclasses set ``name``, ``role``, ``layout``, ``features``,
    ``plan_text`` and ``modules`` and implement :meth:`forward_backward` and
    :meth:`reduce_grads`, then call :meth:`make_optimizer`."""

    name: str = ""
    features: tuple[str, ...] = ()
    timeline_from_end: int = 1  # the report's timeline: this step from the end (1: the last)

    def __init__(self, cfg: "TrainConfig", env: "DistEnv", *, parity: bool = False) -> None:
        self.cfg = cfg
        self.env = env
        self.parity = parity
        self.role = ""
        self.layout = ""
        self.plan_text: str | None = None
        self.modules: dict[str, torch.nn.Module] = {}
        self.optimizer: torch.optim.Optimizer | None = None
        self.stamps = StepStamps(env.rank, env.device)
        self.outcomes: list[StepOutcome] = []
        reset_peak_memory(env.device)  # the peak is this run's, not an earlier run's in this process

    # ------------------------------------------------------------------ for subclasses

    def forward_backward(self, data: "StepData") -> LocalStep:
        """This rank's forward and backward of the step; gradients exactly those of the step
        loss once :meth:`reduce_grads` has run."""
        raise NotImplementedError

    def reduce_grads(self) -> None:
        """Combine the replicas' gradients into the global batch's."""
        raise NotImplementedError

    def make_optimizer(self) -> None:
        opt = self.cfg.optim
        # one explicit group: a rank with nothing to train (a frozen ViT's) gets an empty one
        self.optimizer = torch.optim.AdamW([{"params": self.parameters()}], lr=opt.lr, betas=tuple(opt.betas), eps=opt.eps,
                                           weight_decay=opt.weight_decay)

    def parameters(self) -> list[torch.nn.Parameter]:
        return [p for m in self.modules.values() for p in m.parameters() if p.requires_grad]

    # ------------------------------------------------------------------ the step

    def train_step(self, data: "StepData") -> StepOutcome:
        import torch.distributed as dist

        if self.optimizer is None:
            raise RuntimeError(f"{type(self).__name__}: make_optimizer() was not called after building the modules")
        dist.barrier()  # one origin for every rank's intervals
        origin = time.monotonic()
        self.stamps.start(origin)
        for module in self.modules.values():
            module.zero_grad(set_to_none=True)
        local = self.forward_backward(data)
        fill_missing_grads(self.parameters())
        self.reduce_grads()
        self.optimizer.step()
        totals = torch.tensor([local.loss, float(local.padded_tokens)], dtype=torch.float64, device=self.env.device)
        dist.all_reduce(totals)
        loss, padded = totals.tolist()  # waits for the device: the step has ended
        step_s = time.monotonic() - origin
        outcome = StepOutcome(step=data.step, loss=loss,
                              samples=sum(len(p["sample_ids"]) for p in data.packs),
                              tokens=sum(int(p["input_ids"].numel()) for p in data.packs),
                              padded_tokens=int(round(padded)), step_s=step_s,
                              intervals=list(self.stamps.intervals))
        self.outcomes.append(outcome)
        return outcome

    # ------------------------------------------------------------------ checkpoint

    def state_dict(self) -> dict[str, Any]:
        """This rank's model, optimizer and RNG states (copies: training on does not change them)."""
        if self.optimizer is None:
            raise RuntimeError(f"{type(self).__name__}: nothing to save before make_optimizer()")
        return {"run": self.name, "layout": self.layout, "rank": self.env.rank,
                "model": {name: _copied(m.state_dict()) for name, m in self.modules.items()},
                "optimizer": _copied(self.optimizer.state_dict()), "rng": rng_state(self.env.device)}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Continue from :meth:`state_dict` of the same run, layout and rank."""
        if self.optimizer is None:
            raise RuntimeError(f"{type(self).__name__}: make_optimizer() before loading a checkpoint")
        mine = {"run": self.name, "layout": self.layout, "rank": self.env.rank}
        theirs = {k: state.get(k) for k in mine}
        if theirs != mine:
            raise CheckpointMismatch(f"checkpoint of {theirs} cannot be loaded by {mine}")
        if set(state["model"]) != set(self.modules):
            raise CheckpointMismatch(f"checkpoint holds modules {sorted(state['model'])}, rank {self.env.rank} of "
                                     f"{self.name} has {sorted(self.modules)}")
        for name, module in self.modules.items():
            module.load_state_dict(state["model"][name], strict=True)
        self.optimizer.load_state_dict(state["optimizer"])
        set_rng_state(state["rng"], self.env.device)

    # ------------------------------------------------------------------ measurement and teardown

    def rank_record(self) -> RankRecord:
        return RankRecord.measure(self.env.rank, self.role, peak_memory_mb(self.env.device), self.outcomes)

    def close(self) -> None:
        """Undo what the run installed in this process (subclasses extend it)."""


# ---------------------------------------------------------------------- helpers


def fill_missing_grads(params: Iterable[torch.nn.Parameter]) -> None:
    """A zero gradient for every parameter the step did not reach, so that the gradient
    reduction sees the same tensors on every replica and AdamW steps every parameter alike."""
    for p in params:
        if p.grad is None:
            p.grad = torch.zeros_like(p)


def replica_share(count: int, replica: int, replicas: int) -> list[int]:
    """Replica ``replica``'s contiguous share of ``count`` items (the first ``count %
    replicas`` replicas take one more); every replica needs at least one."""
    if count < replicas:
        raise ValueError(f"{count} microbatches in the step cannot feed {replicas} data-parallel replicas: "
                         f"raise data.packs_per_step to at least {replicas}")
    base, extra = divmod(count, replicas)
    start = replica * base + min(replica, extra)
    return list(range(start, start + base + (replica < extra)))


def even_split(layers: int, stages: int) -> list[int]:
    """Layers per pipeline stage, as even as possible, earlier stages first."""
    if layers < stages:
        raise ValueError(f"{layers} LLM layers cannot fill {stages} pipeline stages")
    base, extra = divmod(layers, stages)
    return [base + (s < extra) for s in range(stages)]


def reset_peak_memory(device: torch.device) -> None:
    """Start measuring the peak afresh: the CUDA allocator's peak statistics, or on Linux the
    process's resident-set high-water mark (``/proc/self/clear_refs`` resets ``VmHWM``); where neither can be reset the peak covers the whole process.
    On CPU the heap an earlier run of this process freed is first handed back to the system
    (glibc's ``malloc_trim``), otherwise it stays resident and counts in every later run's
    peak (the dense-mask ``packing`` run's did, by ~700 MB)."""
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
        return
    gc.collect()
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):  # not glibc
        pass
    try:
        with open("/proc/self/clear_refs", "w") as refs:
            refs.write("5")
    except OSError:
        pass


def peak_memory_mb(device: torch.device) -> float:
    """Peak memory of this rank since :func:`reset_peak_memory`: the CUDA allocator's peak on
    a GPU, else the process's peak resident set: Linux's ``VmHWM`` (the mark ``clear_refs``
    resets; ``ru_maxrss`` is not enough, it also keeps the peak of any thread that exited
    since, gloo's and the loader's included), elsewhere ``ru_maxrss`` (bytes on macOS)."""
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**20
    try:
        with open("/proc/self/status") as status:
            for line in status:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) / 2**10  # kB
    except OSError:
        pass
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return peak / 2**20 if sys.platform == "darwin" else peak / 2**10


def rng_state(device: torch.device) -> dict[str, Any]:
    """Every generator a step may draw from (torch, Python, numpy, CUDA), so that a resumed
    run draws what the uninterrupted one would have."""
    import numpy as np

    state = {"torch": torch.get_rng_state(), "python": random.getstate(), "numpy": np.random.get_state()}
    if device.type == "cuda":
        state["cuda"] = torch.cuda.get_rng_state(device)
    return state


def set_rng_state(state: dict[str, Any], device: torch.device) -> None:
    """Restore what :func:`rng_state` saved."""
    import numpy as np

    torch.set_rng_state(state["torch"].cpu())  # a checkpoint loaded with map_location=cuda moved it
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    if device.type == "cuda":
        torch.cuda.set_rng_state(state["cuda"].cpu(), device)


def _copied(obj: Any) -> Any:
    if isinstance(obj, torch.Tensor):
        return obj.detach().clone()
    if isinstance(obj, dict):
        return {k: _copied(v) for k, v in obj.items()}
    if isinstance(obj, list):
        return [_copied(v) for v in obj]
    return obj


def build_trainer(kind: str, cfg: "TrainConfig", env: "DistEnv", *, parity: bool = False,
                  switches: "RunFeatures | None" = None) -> Trainer:
    """The ``kind`` run (``"baseline"``: co-located, ``"three-phase"``: co-located with the
    three-phase schedule, or ``"flowtrain"``: decoupled, lockstep or the flow with ``layout.flow``) on this
    rank with ``switches`` (default: that kind's own, the baseline's all off); collective:
    every rank calls it at the same point."""
    from mindspeed_flow.train.runs import FLOWTRAIN_FEATURES, RunFeatures

    if kind == "baseline":
        from mindspeed_flow.train.baseline import BaselineTrainer

        return BaselineTrainer(cfg, env, parity=parity, switches=switches or RunFeatures())
    if kind == "three-phase":
        from mindspeed_flow.train.three_phase import ThreePhaseTrainer

        return ThreePhaseTrainer(cfg, env, parity=parity, **({"switches": switches} if switches else {}))
    if kind == "flowtrain":
        if switches not in (None, FLOWTRAIN_FEATURES):
            raise ValueError(f"the flowtrain trainer runs {FLOWTRAIN_FEATURES}, not {switches}")
        if cfg.layout.flow:  # FlowTrain's flow over the same ranks (train/stream.py)
            from mindspeed_flow.train.stream import StreamTrainer

            return StreamTrainer(cfg, env, parity=parity)
        from mindspeed_flow.train.flow import FlowTrainer

        return FlowTrainer(cfg, env, parity=parity)
    raise ValueError(f"unknown run {kind!r}: choose one of {', '.join(RUNS)}")
