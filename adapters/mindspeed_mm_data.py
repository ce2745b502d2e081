"""MindSpeed-MM's data path swapped for :class:`~mindspeed_flow.data.FlowDataLoader` (feature ``packing``).

What upstream does (``pretrain_vlm.train_valid_test_datasets_provider``, 57069cd):
``build_mm_dataset(dataset_param)`` preprocesses the whole corpus with its tokenizer into a
Hugging Face ``datasets.Dataset``; ``build_mm_dataloader(dataset, dataloader_param, ...)``
wraps it in a sampler-driven ``DataLoader`` whose Qwen2-VL collator pads rows (no
``cu_seqlens``, no per-sample positions); ``build_iterations`` cycles it; every TP/PP rank
decodes the same samples; the loader's position is not saved.

With ``--flow-packing``:

- ``build_mm_dataset`` returns a :class:`FlowDatasetSpec` for a ``"huggingface"`` dataset
  (the VLM conversation format): where the records and images are, which processor, the
  pixel bounds; nothing is preprocessed ahead.  Other dataset types pass through.
- ``build_mm_dataloader`` turns that spec into a ``FlowDataLoader``: capacity
  ``--seq-length``, ``window`` (default :data:`WINDOW`) and ``num_workers`` from
  ``dataloader_param``, this rank's DP coordinates from the DP group upstream passes, decoding
  on the lowest rank of the model-parallel group (first pipeline stage, TP rank 0), the
  batches handed to the other TP/PP ranks one step at a time, packs ordered per step for
  ``pp_size`` stages.  After a checkpoint load
  (``args.iteration > 0``) the loader resumes from the state saved beside that checkpoint.
- ``build_iterations`` wraps it in :class:`FlowTrainIterator`: epochs one after the other,
  each microbatch recorded for the consumed-samples accounting
  (:mod:`mindspeed_flow.data.accounting`).
- ``get_forward_backward_func`` returns the schedule wrapped by :func:`forward_backward_handoff`:
  before the schedule's first transfer, every rank of the replica takes part in one
  collective that moves the step's batches from the decoding rank to its TP/PP peers
  (:mod:`mindspeed_flow.data.handoff`); ``next(data_iterator)`` inside ``forward_step``
  never communicates, so a later pipeline stage cannot deadlock the first.
- ``save_checkpoint`` also writes each decoding rank's loader state,
  ``flow_loader_dprank{DP:03d}.pt`` in the checkpoint's directory (Megatron's
  ``get_checkpoint_name`` layout).

Nothing upstream is imported at module level.
"""

from __future__ import annotations

import functools
import logging
import os
import weakref
from dataclasses import dataclass
from typing import Any, Callable, Optional

import torch

from mindspeed_flow.data import FlowDataLoader
from mindspeed_flow.data.accounting import record_microbatch
from mindspeed_flow.data.batch import completed_samples
from mindspeed_flow.data.handoff import StepBatches

from .mindspeed_mm import _argument

log = logging.getLogger(__name__)

DATASET_PARAMS = ("dataset_param",)
DATALOADER_PARAMS = ("dataset", "dataloader_param", "process_group", "consumed_samples", "dataset_param", "generator")
ITERATIONS_PARAMS = ("train_dl", "val_dl", "test_dl", "iterator_type")
SAVE_PARAMS = ("iteration", "model", "optimizer", "opt_param_scheduler", "num_floating_point_operations_so_far")
# The record layout FlowDataLoader reads (MindSpeed-MM's "attr" block of the data config).
EXPECTED_ATTR = {"messages": "messages", "images": "images", "role_tag": "role", "content_tag": "content",
                 "user_tag": "user", "assistant_tag": "assistant"}

# Open packs on the decoding rank unless dataloader_param sets "window": held samples are
# decoded (uint8 pixels), about 4.7 KB per image token, so 128 packs of 8192 tokens stay
# within a few GB; the demo bench reaches the packing lower bound with 64.
WINDOW = 128

_LIVE: "weakref.WeakSet[FlowTrainIterator]" = weakref.WeakSet()


def _as_dict(config: Any) -> dict:
    return config if isinstance(config, dict) else config.to_dict()


@dataclass(frozen=True)
class FlowDatasetSpec:
    """What ``build_mm_dataset`` returns under ``--flow-packing``: the corpus, not its rows."""

    source: str
    image_root: Optional[str]
    processor_path: Optional[str]
    min_pixels: Optional[int]
    max_pixels: Optional[int]

    @classmethod
    def from_dataset_param(cls, dataset_param: dict) -> "FlowDatasetSpec":
        basic = _as_dict(dataset_param.get("basic_parameters", {}))
        pre = _as_dict(dataset_param.get("preprocess_parameters", {}))
        attr = _as_dict(dataset_param.get("attr", {}) or {})
        differ = {k: attr[k] for k, v in EXPECTED_ATTR.items() if attr.get(k, v) != v}
        if differ:
            raise ValueError(f"--flow-packing reads records with the keys {EXPECTED_ATTR}; the data config's "
                             f"'attr' block differs: {differ}")
        source = basic.get("dataset")
        if not source or "," in str(source):
            raise ValueError(f"--flow-packing needs basic_parameters.dataset to name one .json/.jsonl file or a "
                             f"directory of them, got {source!r}")
        pixels = {k: pre.get(f"image_{k}") for k in ("min_pixels", "max_pixels")}
        return cls(str(source), basic.get("dataset_dir"), pre.get("model_name_or_path"),
                   pixels["min_pixels"] or None, pixels["max_pixels"] or None)


def load_processor(path: Optional[str]) -> Any:
    """``None`` (demo tokenizer), a ``tokenizers`` JSON file, or a local model directory
    (its processor, through ``transformers``; never fetched)."""
    if path is None or str(path).endswith(".json"):
        return path
    from transformers import AutoProcessor

    return AutoProcessor.from_pretrained(path, local_files_only=True)


class FlowTrainIterator(StepBatches):
    """The train loop's data iterator: the loader's epochs one after another, each step's
    batches handed to the replica's TP/PP peers by :func:`forward_backward_handoff`
    (:class:`~mindspeed_flow.data.handoff.StepBatches`).

    On the decoding rank each microbatch handed out is recorded for the consumed-samples
    accounting.  ``save_state`` is the loader's ``state_dict`` (the name Megatron's
    ``maybe_save_dataloader_state`` looks for)."""

    def __init__(self, loader: FlowDataLoader) -> None:
        super().__init__(loader)
        _LIVE.add(self)

    def __iter__(self) -> "FlowTrainIterator":
        return self

    def __next__(self) -> dict[str, Any]:
        batch = super().__next__()
        if self.loader.decoding:
            record_microbatch(completed_samples(batch["sample_ids"]), batch["input_ids"].shape[1])
        return batch

    def save_state(self) -> dict[str, Any]:
        if self.kept:
            log.warning("--flow-packing: saving the loader state with %d batches handed off but not taken yet: "
                        "a resume continues after them", self.kept)
        return self.loader.state_dict()


# How deep to look through wrappers of the train loop's iterator (Megatron's RerunDataIterator...).
_WRAPPER_ATTRS = ("iterable", "iterator", "_iterator", "data_iterator")


def flow_iterators(data_iterator: Any) -> list[FlowTrainIterator]:
    """The :class:`FlowTrainIterator` behind each of ``data_iterator`` (one, or a list per
    model chunk), looking through wrappers such as Megatron's ``RerunDataIterator``; each
    once, in list order (the same order on every rank)."""
    found: list[FlowTrainIterator] = []
    for it in data_iterator if isinstance(data_iterator, (list, tuple)) else [data_iterator]:
        for _ in range(4):
            if it is None or isinstance(it, FlowTrainIterator):
                break
            it = next((getattr(it, a) for a in _WRAPPER_ATTRS if getattr(it, a, None) is not None), None)
        if isinstance(it, FlowTrainIterator) and all(it is not f for f in found):
            found.append(it)
    return found


def forward_backward_handoff(wrapped: Callable[..., Any], instance: Any, args: tuple, kwargs: dict) -> Any:
    """``get_forward_backward_func``: whatever schedule it returns (Megatron's 1F1B or
    interleaved, or the plugin's runtime), wrapped so that each call first hands the step's
    ``num_microbatches`` batches of every packing iterator to the replica's TP/PP peers.
    Every rank of a replica calls ``forward_backward_func`` at the start of its train step
    and of each evaluation step, before any point-to-point transfer: no stage can wait there
    for an activation (issue 19, defect 1)."""
    func = wrapped(*args, **kwargs)
    if getattr(func, "_flow_handoff", False):
        return func

    @functools.wraps(func)
    def with_handoff(*fargs: Any, **fkwargs: Any) -> Any:
        iterators = flow_iterators(fkwargs.get("data_iterator"))
        if iterators:
            n = fkwargs.get("num_microbatches")
            if n is None:
                raise TypeError("--flow-packing: forward_backward_func was called without num_microbatches=; "
                                "the step's batches cannot be handed off")
            for iterator in iterators:
                iterator.handoff(int(n))
        return func(*fargs, **fkwargs)

    with_handoff._flow_handoff = True  # type: ignore[attr-defined]
    return with_handoff


def build_dataset(wrapped: Callable[..., Any], instance: Any, args: tuple, kwargs: dict) -> Any:
    """``build_mm_dataset``: a :class:`FlowDatasetSpec` for conversation data."""
    param = _as_dict(_argument(args, kwargs, DATASET_PARAMS, "dataset_param"))
    if param.get("dataset_type") != "huggingface":
        return wrapped(*args, **kwargs)
    return FlowDatasetSpec.from_dataset_param(param)


def loader_state_path(checkpoints: str, iteration: int, dp_rank: int) -> str:
    from megatron.training.checkpointing import get_checkpoint_name

    return get_checkpoint_name(checkpoints, iteration, basename=f"flow_loader_dprank{dp_rank:03d}.pt")


def build_dataloader(wrapped: Callable[..., Any], instance: Any, args: tuple, kwargs: dict) -> Any:
    """``build_mm_dataloader``: a ``FlowDataLoader`` for a :class:`FlowDatasetSpec`."""
    spec = _argument(args, kwargs, DATALOADER_PARAMS, "dataset")
    if not isinstance(spec, FlowDatasetSpec):
        return wrapped(*args, **kwargs)
    import torch.distributed as dist
    from megatron.core import mpu
    from megatron.core.num_microbatches_calculator import get_num_microbatches
    from megatron.training import get_args

    margs = get_args()
    if margs.micro_batch_size != 1:
        raise ValueError(f"--flow-packing: a microbatch is one pack (B = 1); set --micro-batch-size 1 "
                         f"(got {margs.micro_batch_size}); --seq-length {margs.seq_length} is the pack capacity")
    if mpu.get_context_parallel_world_size() > 1:
        raise NotImplementedError("--flow-packing does not split packs over context-parallel ranks yet")
    dp_group = _argument(args, kwargs, DATALOADER_PARAMS, "process_group") or mpu.get_data_parallel_group()
    peers = mpu.get_model_parallel_group()
    gloo = dist.get_backend(peers) == "gloo"
    param = _as_dict(_argument(args, kwargs, DATALOADER_PARAMS, "dataloader_param"))
    loader = FlowDataLoader(
        spec.source, load_processor(spec.processor_path), capacity=margs.seq_length,
        dp_rank=dist.get_rank(dp_group), dp_size=dist.get_world_size(dp_group),
        num_workers=int(param.get("num_workers", 2)), seed=margs.seed, window=int(param.get("window", WINDOW)),
        pp_size=mpu.get_pipeline_model_parallel_world_size(), step_packs=get_num_microbatches(),
        group=peers if dist.get_world_size(peers) > 1 else None,
        device="cpu" if gloo else torch.device("cuda", torch.cuda.current_device()),
        image_root=spec.image_root, min_pixels=spec.min_pixels, max_pixels=spec.max_pixels,
    )
    if getattr(margs, "load", None) and getattr(margs, "iteration", 0) > 0 and loader.decoding:
        path = loader_state_path(margs.load, margs.iteration, loader.dp_rank)
        if os.path.isfile(path):
            loader.load_state_dict(torch.load(path, weights_only=False)["flow_loader"])
        else:
            log.warning("--flow-packing: no loader state %s for iteration %d: the data starts from the first "
                        "epoch again (samples seen before the checkpoint may repeat)", path, margs.iteration)
    return loader


def build_iterations(wrapped: Callable[..., Any], instance: Any, args: tuple, kwargs: dict) -> Any:
    """``build_iterations``: a :class:`FlowTrainIterator` for a ``FlowDataLoader``."""
    loaders = [_argument(args, kwargs, ITERATIONS_PARAMS, name) for name in ("train_dl", "val_dl", "test_dl")]
    if not any(isinstance(dl, FlowDataLoader) for dl in loaders):
        return wrapped(*args, **kwargs)
    if any(dl is not None and not isinstance(dl, FlowDataLoader) for dl in loaders):
        raise TypeError("--flow-packing: all of train/valid/test loaders must be FlowDataLoaders or none")
    return tuple(None if dl is None else FlowTrainIterator(dl) for dl in loaders)


def save_checkpoint(wrapped: Callable[..., Any], instance: Any, args: tuple, kwargs: dict) -> Any:
    """``save_checkpoint``: the model's checkpoint, then each decoding rank's loader state."""
    result = wrapped(*args, **kwargs)
    from megatron.training import get_args

    iteration = _argument(args, kwargs, SAVE_PARAMS, "iteration")
    save_dir = get_args().save
    for iterator in list(_LIVE):
        loader = iterator.loader
        if loader.decoding and save_dir:
            path = loader_state_path(save_dir, iteration, loader.dp_rank)
            os.makedirs(os.path.dirname(path), exist_ok=True)
            torch.save({"flow_loader": iterator.save_state()}, path + ".tmp")
            os.replace(path + ".tmp", path)
    return result
