"""A tiny megatron-core ``GPTModel`` run by Megatron's own pipeline schedules on CPU gloo ranks:
the ground truth that the self-test (``mindspeed-flow selftest``, section ``megatron-pp2``)
and the schedule regression tests compare pipelined runs and the plugin's executor with.

A deterministic tiny model and data, Megatron's ``forward_backward_*`` functions run in N
gloo processes on 127.0.0.1 (:func:`mindspeed_flow.spawn.run_cpu_ranks`), a single-process
reference without pipelining, and a per-rank record of the order in which forward and
backward passes ran::

    spec = TinyGPTSpec()
    reference = run_reference(spec)
    stages = run_pipelined(spec, reference.state_dict, pipeline_parallel_size=2)
    merged = merge_stage_results(stages)      # compare merged.grads with reference.result.grads

To run something else under the same conditions (the plugin's executor, say), write a
module-level worker ``worker(rank, world_size, *args)`` that enters :func:`megatron_parallel`,
builds the stage with :func:`build_stage_model` and calls :func:`run_schedule` with a
callable that has Megatron's ``forward_backward_func`` signature; launch it with
:func:`~mindspeed_flow.spawn.run_cpu_ranks`.

Every parameter is named by its *global* name (:mod:`.global_names`), so results from
different pipeline splits compare key by key.  megatron-core is imported inside functions only.
"""

from __future__ import annotations

from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator

import torch
import torch.distributed as dist

from mindspeed_flow.spawn import run_cpu_ranks

from .global_names import global_name, global_state_dict, layer_offset, stage_state_dict
from .parallel import megatron_parallel

NO_PIPELINING = "forward_backward_no_pipelining"
ONE_F_ONE_B = "forward_backward_pipelining_without_interleaving"
RANK_NAME = "megatron-cpu-rank"  # the spawned processes are megatron-cpu-rank0, 1, ...


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



# --------------------------------------------------------------------------- megatron side


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
            raise RuntimeError(f"parameters on more than one stage: {sorted(clash)}")
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
        state_dict = global_state_dict(model)
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
    (reference,) = run_cpu_ranks(reference_worker, 1, spec, timeout_s=timeout_s, name=RANK_NAME)
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
    return run_cpu_ranks(pipeline_worker, pipeline_parallel_size, spec, state_dict, schedule, record_events,
                         timeout_s=timeout_s, name=RANK_NAME)
