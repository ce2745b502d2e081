"""Run megatron-core's real pipeline schedules on CPU over gloo, on a tiny GPTModel.

This is the ground truth the schedule regression tests compare our executor with: a
deterministic tiny model and data, Megatron's own ``forward_backward_*`` functions run in N
gloo processes on 127.0.0.1, a single-process reference without pipelining, and a per-rank
record of the order in which forward and backward passes ran.

Typical use from a test (``tests/`` is on ``sys.path`` under pytest)::

    from megatron_cpu_harness import TinyGPTSpec, merge_stage_results, run_pipelined, run_reference

    spec = TinyGPTSpec()
    reference = run_reference(spec)
    stages = run_pipelined(spec, reference.state_dict, pipeline_parallel_size=2)
    merged = merge_stage_results(stages)      # compare merged.grads with reference.result.grads

To run something else under the same conditions (our executor, say), write a module-level
worker ``worker(rank, world_size, *args)`` that enters :func:`megatron_parallel`, builds the
stage with :func:`build_stage_model` and calls :func:`run_schedule` with a callable that has
Megatron's ``forward_backward_func`` signature; launch it with :func:`launch`.

Every parameter is named by its *global* name (``decoder.layers.{global index}...``), so
results from different pipeline splits compare key by key.
"""

from __future__ import annotations

import io
import multiprocessing
import os
import queue
import re
import time
import traceback
from contextlib import contextmanager
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any, Callable, Iterator

import torch
import torch.distributed as dist

from mindspeed_flow.loopback import tcp_store_server

LOOPBACK = "127.0.0.1"
NO_PIPELINING = "forward_backward_no_pipelining"
ONE_F_ONE_B = "forward_backward_pipelining_without_interleaving"
_LAYER_KEY = re.compile(r"^decoder\.layers\.(\d+)\.")


class HarnessError(RuntimeError):
    """A launched rank failed, died or timed out; the message carries its traceback."""


@dataclass(frozen=True)
class TinyGPTSpec:
    """Shape, data and seed of the tiny model: everything both sides of a comparison share.

    Dropout is 0 by construction (the CPU RNG shim is only correct then), embeddings and
    output layer are untied (tied ones need Megatron DDP to get exact gradients with PP>1),
    and everything runs in fp32.
    """

    num_layers: int = 4
    hidden_size: int = 32
    num_attention_heads: int = 4
    ffn_hidden_size: int = 64
    vocab_size: int = 64
    seq_length: int = 16
    micro_batch_size: int = 2
    num_microbatches: int = 4
    position_embedding_type: str = "rope"
    seed: int = 1234


@dataclass(frozen=True)
class Event:
    """One compute step on one rank: ``kind`` is ``"F"`` (forward) or ``"B"`` (backward)."""

    rank: int
    kind: str
    microbatch: int


@dataclass
class StageResult:
    """What one rank's schedule run produced.

    ``losses`` holds the per-microbatch loss (before Megatron divides it by the number of
    microbatches) and is empty except on the last pipeline stage; ``grads`` maps the
    global name of every parameter of this stage that received a gradient to a copy of it;
    ``events`` is this rank's forward/backward order when recording was asked for.
    """

    rank: int
    pipeline_rank: int
    losses: list[float] = field(default_factory=list)
    grads: dict[str, torch.Tensor] = field(default_factory=dict)
    events: list[Event] = field(default_factory=list)


@dataclass
class Reference:
    """The single-process run: the full model's weights (global names) and its result."""

    state_dict: dict[str, Any]
    result: StageResult


# --------------------------------------------------------------------------- launching


def launch(
    worker: Callable[..., Any], world_size: int, *args: Any, timeout_s: float = 180.0
) -> list[Any]:
    """Run ``worker(rank, world_size, *args)`` in ``world_size`` fresh processes joined in
    one gloo process group on 127.0.0.1, and return their results ordered by rank.

    ``worker`` must be a module-level function (processes are spawned, not forked, so no
    parent state leaks in). The rendezvous store lives in this process on a port the OS
    picks, so concurrent launches cannot collide. Raises :class:`HarnessError` when a rank
    raises, dies or runs past ``timeout_s``; every process is stopped before this returns,
    on success or failure.
    """
    ctx = multiprocessing.get_context("spawn")
    results = ctx.Queue()
    timeout = timedelta(seconds=timeout_s)
    store = tcp_store_server(world_size, host=LOOPBACK, timeout=timeout)  # 127.0.0.1 only
    procs = [
        ctx.Process(
            target=_bootstrap,
            args=(rank, world_size, store.port, timeout_s, worker, args, results),
            name=f"megatron-cpu-rank{rank}",
            daemon=True,
        )
        for rank in range(world_size)
    ]
    try:
        for proc in procs:
            proc.start()
        return _collect(procs, results, time.monotonic() + timeout_s, timeout_s)
    finally:
        _stop(procs)
        results.close()


def _bootstrap(
    rank: int,
    world_size: int,
    port: int,
    timeout_s: float,
    worker: Callable[..., Any],
    args: tuple,
    results: Any,
) -> None:
    """Child side of :func:`launch`: join the group, run the worker, send back its result
    (serialised with ``torch.save`` so tensors do not depend on this process staying alive)
    or its traceback with the time it was raised."""
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")  # keep gloo's sockets on loopback
    torch.set_num_threads(1)  # ranks share few cores; oversubscription only slows them
    try:
        timeout = timedelta(seconds=timeout_s)
        store = dist.TCPStore(LOOPBACK, port, world_size, is_master=False, timeout=timeout)
        dist.init_process_group(
            "gloo", store=store, rank=rank, world_size=world_size, timeout=timeout
        )
        buffer = io.BytesIO()
        torch.save(worker(rank, world_size, *args), buffer)
        results.put((rank, None, buffer.getvalue(), time.time()))
    except BaseException:  # noqa: BLE001 - the parent re-raises it with the rank named
        # Timed before the group is destroyed: destroying it is what makes the peers fail.
        results.put((rank, traceback.format_exc(), None, time.time()))
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


# After a first failure, how long to wait for the other ranks' reports. One rank's error
# makes its peers fail too ("connection closed by peer"); reports are ordered by the time
# they were raised, so the cause comes first whichever report arrives first.
_FAILURE_GRACE_S = 3.0


def _collect(procs: list, results: Any, deadline: float, timeout_s: float) -> list[Any]:
    values: dict[int, Any] = {}
    failures: dict[int, tuple[float, str]] = {}
    settle_by = deadline
    while len(values) + len(failures) < len(procs) and time.monotonic() < settle_by:
        try:
            rank, error, payload, raised_at = results.get(timeout=0.2)
        except queue.Empty:
            failures.update(_dead_without_report(procs, values.keys() | failures.keys()))
        else:
            if error is None:
                values[rank] = torch.load(io.BytesIO(payload), weights_only=False)
            else:
                failures[rank] = (raised_at, error)
        if failures:
            settle_by = min(settle_by, time.monotonic() + _FAILURE_GRACE_S)
    silent = sorted(set(range(len(procs))) - values.keys() - failures.keys())
    if failures or silent:
        raise HarnessError(_describe_failures(failures, silent, timeout_s))
    return [values[rank] for rank in range(len(procs))]


def _dead_without_report(procs: list, reported: set[int]) -> dict[int, tuple[float, str]]:
    """Ranks whose process ended abnormally (killed, crashed in C++) without a report."""
    return {
        rank: (time.time(), f"died with exit code {proc.exitcode} and no result")
        for rank, proc in enumerate(procs)
        if rank not in reported and proc.exitcode not in (None, 0)
    }


def _describe_failures(
    failures: dict[int, tuple[float, str]], silent: list[int], timeout_s: float
) -> str:
    ordered = sorted(failures.items(), key=lambda item: item[1][0])
    lines = [f"rank {rank} failed:\n{text}" for rank, (_, text) in ordered]
    if silent:
        why = f"timed out after {timeout_s:.0f} s"
        if failures:
            why = "stopped after the first failure"
        lines.append(f"no result from ranks {silent} ({why})")
    return "\n".join(lines)


def _stop(procs: list) -> None:
    for proc in procs:
        if proc.is_alive():
            proc.terminate()
    for proc in procs:
        if proc.pid is None:
            continue
        proc.join(timeout=5)
        if proc.is_alive():
            proc.kill()
            proc.join()


# --------------------------------------------------------------------------- megatron side


@contextmanager
def megatron_parallel(pipeline_parallel_size: int = 1) -> Iterator[None]:
    """CPU shims plus Megatron's model-parallel state (TP=1, the given PP, DP the rest) for
    the body; both are undone on exit, so one launch can run several configurations."""
    from megatron.core import parallel_state

    from mindspeed_flow.adapters.megatron.core import enable_cpu_shims

    shims = enable_cpu_shims()
    try:
        parallel_state.initialize_model_parallel(
            pipeline_model_parallel_size=pipeline_parallel_size
        )
        try:
            yield
        finally:
            parallel_state.destroy_model_parallel()
            # destroy_model_parallel (0.12 and 0.16) leaves these lists behind, and the next
            # initialisation sets them only on the groups' members: a rank left out (rank 1 of
            # a PP=2 run after a PP=1 one) would still believe it is in the group.
            for leaked in ("_EMBEDDING_GLOBAL_RANKS", "_POSITION_EMBEDDING_GLOBAL_RANKS"):
                if hasattr(parallel_state, leaked):
                    setattr(parallel_state, leaked, None)
    finally:
        shims.remove()


@contextmanager
def megatron_virtual_parallel(pipeline_parallel_size: int, chunks: int) -> Iterator[None]:
    """:func:`megatron_parallel` plus ``chunks`` virtual stages per rank: what
    ``initialize_model_parallel(virtual_pipeline_model_parallel_size=chunks)`` adds (in
    megatron-core 0.12 and 0.16); the virtual rank is 0 in the body, all undone on exit."""
    from megatron.core import parallel_state

    with megatron_parallel(pipeline_parallel_size):
        parallel_state.set_virtual_pipeline_model_parallel_world_size(chunks)
        parallel_state.set_virtual_pipeline_model_parallel_rank(0)
        try:
            yield
        finally:
            parallel_state.set_virtual_pipeline_model_parallel_world_size(None)


def build_interleaved_chunks(spec: TinyGPTSpec, chunks: int) -> list[torch.nn.Module]:
    """This rank's ``chunks`` model chunks of the tiny ``GPTModel`` for Megatron's
    interleaved schedule (needs :func:`megatron_virtual_parallel`), chunk ``c`` from
    ``torch.manual_seed(spec.seed + c)``; the virtual rank is left at 0.

    megatron-core 0.12 reads the chunk from the global virtual rank; 0.16 wants it passed as
    ``vp_stage=`` (to ``GPTModel`` and to ``is_pipeline_*_stage``, whose ``ignore_virtual``
    now defaults to True) and refuses to build without it: both are set here."""
    import inspect

    from megatron.core import parallel_state
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec

    config = transformer_config(spec, chunks)
    takes_vp_stage = "vp_stage" in inspect.signature(GPTModel.__init__).parameters
    models = []
    for chunk in range(chunks):
        parallel_state.set_virtual_pipeline_model_parallel_rank(chunk)
        vp_stage = {"vp_stage": chunk} if takes_vp_stage else {}
        torch.manual_seed(spec.seed + chunk)
        models.append(GPTModel(
            config=config, transformer_layer_spec=get_gpt_layer_local_spec(), vocab_size=spec.vocab_size,
            max_sequence_length=spec.seq_length,
            pre_process=parallel_state.is_pipeline_first_stage(ignore_virtual=False, **vp_stage),
            post_process=parallel_state.is_pipeline_last_stage(ignore_virtual=False, **vp_stage),
            share_embeddings_and_output_weights=False, position_embedding_type=spec.position_embedding_type,
            **vp_stage))
    parallel_state.set_virtual_pipeline_model_parallel_rank(0)
    return models


def transformer_config(spec: TinyGPTSpec, chunks: int | None = None) -> Any:
    """Megatron ``TransformerConfig`` for ``spec`` under the current pipeline size (and
    ``chunks`` virtual stages per rank, if given), with the CPU-safe overrides of the
    adapter."""
    from megatron.core import parallel_state
    from megatron.core.transformer.transformer_config import TransformerConfig

    from mindspeed_flow.adapters.megatron.core import cpu_safe_config_overrides

    return TransformerConfig(
        num_layers=spec.num_layers,
        hidden_size=spec.hidden_size,
        num_attention_heads=spec.num_attention_heads,
        ffn_hidden_size=spec.ffn_hidden_size,
        hidden_dropout=0.0,
        attention_dropout=0.0,
        params_dtype=torch.float32,
        pipeline_dtype=torch.float32,
        pipeline_model_parallel_size=parallel_state.get_pipeline_model_parallel_world_size(),
        virtual_pipeline_model_parallel_size=chunks,
        **cpu_safe_config_overrides(virtual_pipeline_model_parallel_size=chunks),
    )


def build_stage_model(
    spec: TinyGPTSpec, state_dict: dict[str, Any] | None = None
) -> torch.nn.Module:
    """This rank's pipeline stage of the tiny ``GPTModel`` (needs :func:`megatron_parallel`).

    Weights start from ``torch.manual_seed(spec.seed)``, which does not give the stages of
    a split the reference's weights: for comparisons pass ``state_dict`` (global names, e.g.
    :attr:`Reference.state_dict`), and the stage loads its own slice of it, strictly.
    """
    from megatron.core import parallel_state
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec

    torch.manual_seed(spec.seed)
    model = GPTModel(
        config=transformer_config(spec),
        transformer_layer_spec=get_gpt_layer_local_spec(),
        vocab_size=spec.vocab_size,
        max_sequence_length=spec.seq_length,
        pre_process=parallel_state.is_pipeline_first_stage(),
        post_process=parallel_state.is_pipeline_last_stage(),
        share_embeddings_and_output_weights=False,
        position_embedding_type=spec.position_embedding_type,
    )
    if state_dict is not None:
        model.load_state_dict(stage_state_dict(state_dict, model), strict=True)
    return model


def layer_offset(model: torch.nn.Module) -> int:
    """Global index of the stage's first transformer layer (0 for a stage without layers)."""
    layers = model.decoder.layers
    return layers[0].layer_number - 1 if len(layers) else 0


def global_name(local_name: str, offset: int) -> str:
    """``decoder.layers.{i}.x`` of a stage whose first layer is global layer ``offset``
    -> ``decoder.layers.{offset+i}.x``; other names are the same on every stage."""
    return _LAYER_KEY.sub(lambda m: f"decoder.layers.{int(m.group(1)) + offset}.", local_name)


def stage_state_dict(full: dict[str, Any], model: torch.nn.Module) -> dict[str, Any]:
    """The entries of a full (global-name) state dict that ``model``'s stage holds, under
    the stage's local names."""
    offset = layer_offset(model)
    return {name: full[global_name(name, offset)] for name in model.state_dict()}


def full_state_dict(model: torch.nn.Module) -> dict[str, Any]:
    """The stage's state dict under global names (the whole model for PP=1), tensors copied.

    Megatron's linear layers add ``_extra_state`` entries (``None`` without Transformer
    Engine); they are kept so that a strict load accepts the dict.
    """
    offset = layer_offset(model)
    return {
        global_name(name, offset): _copy_if_tensor(value)
        for name, value in model.state_dict().items()
    }


def _copy_if_tensor(value: Any) -> Any:
    return value.detach().clone() if isinstance(value, torch.Tensor) else value


def make_microbatches(spec: TinyGPTSpec) -> list[dict[str, torch.Tensor]]:
    """Deterministic next-token batches: ``tokens``, ``labels`` (tokens shifted by one),
    ``position_ids`` and the microbatch ``index`` (used to label recorded events)."""
    generator = torch.Generator().manual_seed(spec.seed + 1)
    shape = (spec.num_microbatches, spec.micro_batch_size, spec.seq_length + 1)
    stream = torch.randint(0, spec.vocab_size, shape, generator=generator)
    positions = torch.arange(spec.seq_length).expand(spec.micro_batch_size, -1)
    return [
        {
            "tokens": seq[:, :-1],
            "labels": seq[:, 1:],
            "position_ids": positions,
            "index": torch.tensor(i),
        }
        for i, seq in enumerate(stream)
    ]


def make_forward_step(
    events: list[Event] | None = None,
) -> Callable[[Iterator, torch.nn.Module], tuple]:
    """A Megatron ``forward_step_func``: runs the stage on the next microbatch and returns
    the output with a loss function (mean token loss; 2-tuple form, so Megatron divides by
    the number of microbatches).

    With ``events``, appends ``F`` when the stage's forward starts and ``B`` when its
    backward starts, i.e. when the gradient of the stage output arrives (a tensor hook).
    """
    rank = dist.get_rank()

    def forward_step(data_iterator: Iterator, model: torch.nn.Module) -> tuple:
        batch = next(data_iterator)
        microbatch = int(batch["index"])
        if events is not None:
            events.append(Event(rank, "F", microbatch))
        output = model(batch["tokens"], batch["position_ids"], None, labels=batch["labels"])
        if events is not None and output.requires_grad:
            output.register_hook(lambda grad: events.append(Event(rank, "B", microbatch)))
        return output, _mean_loss

    return forward_step


def _mean_loss(output: torch.Tensor) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    loss = output.float().mean()
    # A copy: Megatron divides the returned loss by the number of microbatches in place.
    return loss, {"loss": loss.detach().clone()}


def resolve_schedule(schedule: str | Callable[..., Any]) -> Callable[..., Any]:
    """A schedule given by its name in ``megatron.core.pipeline_parallel.schedules``, or a
    callable with the same signature (our executor), returned as is."""
    if callable(schedule):
        return schedule
    from megatron.core.pipeline_parallel import schedules

    return getattr(schedules, schedule)


def run_schedule(
    model: torch.nn.Module,
    spec: TinyGPTSpec,
    schedule: str | Callable[..., Any] = NO_PIPELINING,
    record_events: bool = False,
) -> StageResult:
    """One training step's forward and backward of ``model`` over the spec's microbatches
    with ``schedule``; returns losses, global-name gradients and (optionally) events."""
    from megatron.core import parallel_state

    model.zero_grad(set_to_none=True)
    events: list[Event] | None = [] if record_events else None
    losses = resolve_schedule(schedule)(
        forward_step_func=make_forward_step(events),
        data_iterator=iter(make_microbatches(spec)),
        model=model,
        num_microbatches=spec.num_microbatches,
        seq_length=spec.seq_length,
        micro_batch_size=spec.micro_batch_size,
        forward_only=False,
    )
    offset = layer_offset(model)
    return StageResult(
        rank=dist.get_rank(),
        pipeline_rank=parallel_state.get_pipeline_model_parallel_rank(),
        losses=[float(item["loss"]) for item in losses],
        grads={
            global_name(name, offset): param.grad.detach().clone()
            for name, param in model.named_parameters()
            if param.grad is not None
        },
        events=events or [],
    )


def merge_stage_results(stages: list[StageResult]) -> StageResult:
    """One pipeline's stages as one result: all gradients, the last stage's losses and every
    rank's events (rank by rank). A parameter found on two stages is an error."""
    merged = StageResult(rank=-1, pipeline_rank=-1)
    for stage in sorted(stages, key=lambda s: s.pipeline_rank):
        clash = merged.grads.keys() & stage.grads.keys()
        if clash:
            raise HarnessError(f"parameters on more than one stage: {sorted(clash)}")
        merged.grads.update(stage.grads)
        merged.losses = merged.losses or stage.losses
        merged.events.extend(stage.events)
    return merged


# --------------------------------------------------------------------------- ready-made runs


def reference_worker(rank: int, world_size: int, spec: TinyGPTSpec) -> Reference:
    """Worker for :func:`run_reference`: the whole model, no pipelining."""
    with megatron_parallel(pipeline_parallel_size=1):
        model = build_stage_model(spec)
        _make_every_weight_distinct(model, spec.seed)
        state_dict = full_state_dict(model)
        return Reference(state_dict, run_schedule(model, spec, NO_PIPELINING, record_events=True))


def _make_every_weight_distinct(model: torch.nn.Module, seed: int) -> None:
    """Add small seeded noise to every parameter. Freshly built, all norm weights are 1 and
    all biases 0, so a slice loaded into the wrong layer would go unnoticed; after this any
    misplaced weight changes losses and gradients."""
    generator = torch.Generator().manual_seed(seed + 2)
    with torch.no_grad():
        for param in model.parameters():
            param.add_(0.02 * torch.randn(param.shape, generator=generator))


def pipeline_worker(
    rank: int,
    world_size: int,
    spec: TinyGPTSpec,
    state_dict: dict[str, Any],
    schedule: str,
    record_events: bool,
) -> StageResult:
    """Worker for :func:`run_pipelined`: this rank's stage, loaded from ``state_dict``."""
    with megatron_parallel(pipeline_parallel_size=world_size):
        model = build_stage_model(spec, state_dict)
        return run_schedule(model, spec, schedule, record_events)


def run_reference(spec: TinyGPTSpec, timeout_s: float = 180.0) -> Reference:
    """The single-process reference: one gloo rank, the whole model, Megatron's
    ``forward_backward_no_pipelining``. Its ``state_dict`` seeds every pipelined run."""
    (reference,) = launch(reference_worker, 1, spec, timeout_s=timeout_s)
    return reference


def run_pipelined(
    spec: TinyGPTSpec,
    state_dict: dict[str, Any],
    schedule: str = ONE_F_ONE_B,
    pipeline_parallel_size: int = 2,
    record_events: bool = True,
    timeout_s: float = 180.0,
) -> list[StageResult]:
    """Megatron's ``schedule`` (a name in its ``schedules`` module) over
    ``pipeline_parallel_size`` gloo ranks, one stage each; results ordered by rank.

    One model chunk per rank: the non-interleaved schedules. The interleaved one would need
    virtual-pipeline chunks, which :func:`build_stage_model` does not build.
    """
    return launch(
        pipeline_worker,
        pipeline_parallel_size,
        spec,
        state_dict,
        schedule,
        record_events,
        timeout_s=timeout_s,
    )
