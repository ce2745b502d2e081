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
  ``--seq-length``, ``window`` (default :data:`WINDOW`) from ``dataloader_param``, decoding
  processes from ``--num-workers`` (as upstream, which overrides the data JSON's value), this rank's DP coordinates from the DP group upstream passes, decoding
  on the lowest rank of the model-parallel group (first pipeline stage, TP rank 0), the
  batches handed to the other TP/PP ranks one step at a time, packs ordered per step for
  ``pp_size`` stages.  After a checkpoint load
  (``args.iteration > 0``) the loader resumes from the state saved beside that checkpoint
  (:mod:`.loader_state`).
- ``build_iterations`` wraps it in :class:`FlowTrainIterator`: epochs one after the other,
  each microbatch recorded for the consumed-samples accounting
  (:mod:`mindspeed_flow.data.accounting`).  Under ``pretrain_transformers.py`` (MindSpeed-MM's
  ``TransformersModel``, Qwen3-VL) each pack is handed over in that model's ``seqlens`` /
  ``indices`` layout (:mod:`.transformers_batch`); the loader cuts images in the geometry of the
  job's processor either way.
- ``get_forward_backward_func`` returns the schedule wrapped by :func:`forward_backward_handoff`:
  before the schedule's first transfer, every rank of the replica takes part in one
  collective that moves the step's batches from the decoding rank to its TP/PP peers
  (:mod:`mindspeed_flow.data.handoff`); ``next(data_iterator)`` inside ``forward_step``
  never communicates, so a later pipeline stage cannot deadlock the first.  With several
  model chunks per rank (``--virtual-pipeline-model-parallel-size``) Megatron builds the
  loaders once per chunk: the later chunks get the first chunk's loader back and a
  :class:`~mindspeed_flow.data.handoff.ChunkView` of its iterator (the step's batches again,
  as upstream's per-chunk copies of one loader yield them), so nothing is decoded twice.
- ``save_checkpoint`` also writes each decoding rank's loader state beside the checkpoint:
  where it lies, which file a rank of a decoupled layout resumes from, and why encoder ranks
  write none are in :mod:`.loader_state`.

Nothing upstream is imported at module level.
"""

from __future__ import annotations

import functools
import logging
import os
import weakref
from dataclasses import dataclass, replace
from typing import Any, Callable, Optional

import torch

from mindspeed_flow.data import FlowDataLoader
from mindspeed_flow.data.accounting import record_microbatch
from mindspeed_flow.data.batch import completed_samples, pack_multiple, real_tokens
from mindspeed_flow.data.conversation import DEFAULT_TEMPLATE, template_system
from mindspeed_flow.data.handoff import ChunkView, StepBatches
from mindspeed_flow.schedule.regions import ENCODER_REGION

from .loader_state import resume_loader, save_loader_states
from .model import _argument
from .roles import role_region

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
    """What ``build_mm_dataset`` returns under ``--flow-packing``: the corpus, not its rows.

    ``records``: the record indices of ``source`` this split reads (``None``: all of them);
    ``split``: ``"train"`` or ``"valid"`` (the held-out part, see :func:`build_dataset`);
    ``template``: the data config's ``basic_parameters.template`` (the chat template, which
    decides the system turn a record without one gets; ``qwen2vl`` when the config names
    none), checked here so a template the loader does not reproduce stops the job at start-up."""

    source: str
    image_root: Optional[str]
    processor_path: Optional[str]
    min_pixels: Optional[int]
    max_pixels: Optional[int]
    records: Optional[tuple[int, ...]] = None
    split: str = "train"
    template: str = DEFAULT_TEMPLATE

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
        template = basic.get("template") or DEFAULT_TEMPLATE
        template_system(template, "--flow-packing: the data config's dataset_param.basic_parameters.template")
        return cls(str(source), basic.get("dataset_dir"), pre.get("model_name_or_path"),
                   pixels["min_pixels"] or None, pixels["max_pixels"] or None, template=template)


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

    def __init__(self, loader: FlowDataLoader, split: str = "train",
                 to_model: Optional[Callable[[dict[str, Any]], dict[str, Any]]] = None) -> None:
        super().__init__(loader)
        self.split = split  # only "train" microbatches are consumed samples; "valid"/"test" ones are evaluated
        self.to_model = to_model  # the entry script's model takes packs in another layout (pretrain_transformers.py)
        # Under a decoupled layout an encoder rank decodes the same packs as its slice's
        # backbone: only the backbone's decoding rank counts them (once per replica).
        self.records = loader.decoding and role_region() != ENCODER_REGION
        _LIVE.add(self)

    def __iter__(self) -> "FlowTrainIterator":
        return self

    def __next__(self) -> dict[str, Any]:
        batch = super().__next__()
        if self.records and self.split == "train":
            record_microbatch(completed_samples(batch["sample_ids"]), real_tokens(batch))
        return batch if self.to_model is None else self.to_model(batch)

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
    """``build_mm_dataset``: a :class:`FlowDatasetSpec` for conversation data, or a
    ``(train, valid)`` pair of them when the data config holds out a validation split.

    MindSpeed-MM's split, honoured record for record (``get_qwen2vl_dataset`` and
    ``pretrain_vlm.train_valid_test_datasets_provider``, 57069cd):

    - ``max_samples`` (not streaming): only the first ``max_samples`` records;
    - ``val_dataset``: that file is the validation set (its first ``val_max_samples``
      records if set); ``val_rate`` is then ignored, with upstream's warning;
    - else ``val_rate > 0`` (not streaming): ``datasets``' own
      ``Dataset.train_test_split(test_size=val_rate, seed=--seed)`` over the records, as
      upstream calls it on its preprocessed rows: the same held-out records, never trained
      on (see :func:`held_out_split`); a streaming dataset is not split (upstream splits
      only a ``datasets.Dataset``), so it trains on every record and evaluates nothing, as
      upstream does, said in a warning.

    Returning the pair makes ``pretrain_vlm.py`` take its ``(train, valid)`` branch: a
    loader for each, ``build_iterations(train, valid)``, evaluation at ``--eval-interval``.
    """
    param = _as_dict(_argument(args, kwargs, DATASET_PARAMS, "dataset_param"))
    if param.get("dataset_type") != "huggingface":
        return wrapped(*args, **kwargs)
    spec = FlowDatasetSpec.from_dataset_param(param)
    basic = _as_dict(param.get("basic_parameters", {}))
    streaming = bool(basic.get("streaming"))
    val_rate = basic.get("val_rate")
    if val_rate is not None and not 0.0 <= float(val_rate) <= 1.0:
        raise ValueError(f"val_rate must be between 0.0 and 1.0, got {val_rate}")
    train = spec
    if basic.get("max_samples") and not streaming:
        train = replace(spec, records=_first_records(spec.source, int(basic["max_samples"]), "max_samples"))
    val_source = basic.get("val_dataset")
    if val_source:
        if "," in str(val_source):
            raise ValueError(f"--flow-packing needs basic_parameters.val_dataset to name one .json/.jsonl file or a "
                             f"directory of them, got {val_source!r}")
        if val_rate:
            log.warning("--flow-packing: both val_dataset and val_rate are set: val_dataset is the validation set "
                        "and val_rate is ignored (as MindSpeed-MM does)")
        val_max = basic.get("val_max_samples")
        valid = replace(spec, source=str(val_source), split="valid",
                        records=_first_records(str(val_source), int(val_max), "val_max_samples") if val_max else None)
        log.info("--flow-packing: validation set %s (%s records)", val_source,
                 "all" if valid.records is None else len(valid.records))
        return train, valid
    if not val_rate:
        return train
    if streaming:
        log.warning("--flow-packing: val_rate %s with a streaming dataset: MindSpeed-MM splits only a "
                    "non-streaming dataset, so nothing is held out and nothing evaluated (same here)", val_rate)
        return train
    from megatron.training import get_args

    rows = train.records if train.records is not None else tuple(range(_record_count(spec.source)))
    kept, held = held_out_split(len(rows), float(val_rate), get_args().seed)
    log.info("--flow-packing: val_rate %s holds out %d of %d records for validation (MindSpeed-MM's split, "
             "seed %d)", val_rate, len(held), len(rows), get_args().seed)
    return (replace(train, records=tuple(rows[i] for i in kept)),
            replace(train, records=tuple(rows[i] for i in held), split="valid"))


def held_out_split(size: int, val_rate: float, seed: int) -> tuple[list[int], list[int]]:
    """``(train, held out)`` row positions of MindSpeed-MM's ``val_rate`` split of ``size``
    rows: the ``datasets`` library's own ``train_test_split(test_size=val_rate, seed=seed)``
    (what ``pretrain_vlm.py`` calls), run on a table of row numbers, so the held-out rows
    are upstream's whatever the installed ``datasets`` version does."""
    from datasets import Dataset

    split = Dataset.from_dict({"row": list(range(size))}).train_test_split(test_size=val_rate, seed=seed)
    return list(split["train"]["row"]), list(split["test"]["row"])


def _record_count(source: str) -> int:
    from mindspeed_flow.data.source import Corpus

    return len(Corpus.open(source))


def _first_records(source: str, count: int, name: str) -> tuple[int, ...]:
    """The first ``count`` records of ``source`` (upstream's ``select(range(count))``)."""
    size = _record_count(source)
    if count > size:
        raise ValueError(f"{name} {count} is more than the {size} records of {source}")
    return tuple(range(count))


def pack_length(margs: Any, tensor_parallel: int, context_parallel: int) -> tuple[int, int]:
    """``(multiple, capacity)``: every pack is padded to a multiple of ``multiple`` tokens,
    what Megatron's ``--sequence-parallel`` (TP) and context parallelism need of the sequence
    (:func:`~mindspeed_flow.data.batch.pack_multiple`); the capacity is ``--seq-length``, cut
    down to a multiple of it so a padded pack still fits."""
    sequence_parallel = bool(getattr(margs, "sequence_parallel", False))
    multiple = pack_multiple(tensor_parallel, context_parallel, sequence_parallel)
    capacity = margs.seq_length - margs.seq_length % multiple
    if capacity < 1:
        raise ValueError(f"--flow-packing: --seq-length {margs.seq_length} is below the {multiple} tokens a pack "
                         f"must be a multiple of (tensor parallel {tensor_parallel}, sequence parallel "
                         f"{sequence_parallel}, context parallel {context_parallel})")
    if multiple > 1:
        log.info("--flow-packing: packs padded to a multiple of %d tokens (tensor parallel %d, sequence parallel %s, "
                 "context parallel %d), capacity %d%s", multiple, tensor_parallel, sequence_parallel,
                 context_parallel, capacity,
                 "" if capacity == margs.seq_length else f" (--seq-length {margs.seq_length} cut to a multiple)")
    return multiple, capacity


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
    chunk = mpu.get_virtual_pipeline_model_parallel_rank() or 0
    shared = _CHUNK_LOADERS.get(spec) if chunk > 0 else None
    if shared is not None:
        return shared  # the first model chunk's loader: its iterator serves this chunk too (ChunkView)
    if margs.micro_batch_size != 1:
        raise ValueError(f"--flow-packing: a microbatch is one pack (B = 1); set --micro-batch-size 1 "
                         f"(got {margs.micro_batch_size}); --seq-length {margs.seq_length} is the pack capacity")
    if mpu.get_context_parallel_world_size() > 1:
        raise NotImplementedError("--flow-packing does not split packs over context-parallel ranks yet")
    dp_group = _argument(args, kwargs, DATALOADER_PARAMS, "process_group") or mpu.get_data_parallel_group()
    peers = mpu.get_model_parallel_group()
    gloo = dist.get_backend(peers) == "gloo"
    param = _as_dict(_argument(args, kwargs, DATALOADER_PARAMS, "dataloader_param"))
    multiple, capacity = pack_length(margs, mpu.get_tensor_model_parallel_world_size(),
                                     mpu.get_context_parallel_world_size())
    shard = loader_shard(dp_group, mpu.get_pipeline_model_parallel_world_size(), get_num_microbatches())
    loader = FlowDataLoader(
        spec.source, load_processor(spec.processor_path), capacity=capacity,
        dp_rank=shard.dp_rank, dp_size=shard.dp_size,
        num_workers=margs.num_workers, seed=margs.seed, window=int(param.get("window", WINDOW)),
        pp_size=shard.pp_size, step_packs=shard.step_packs,
        group=peers if dist.get_world_size(peers) > 1 else None,
        device="cpu" if gloo else torch.device("cuda", torch.cuda.current_device()),
        image_root=spec.image_root, min_pixels=spec.min_pixels, max_pixels=spec.max_pixels,
        records=spec.records, pad_multiple=multiple, template=spec.template,
        processor_file=os.path.join(str(spec.processor_path), "preprocessor_config.json"),
    )
    resume_loader(loader, spec.split, margs)
    if mpu.get_virtual_pipeline_model_parallel_world_size():
        _CHUNK_LOADERS[spec] = loader
    return loader


# Megatron builds the data iterators once per model chunk (virtual pipeline rank set); upstream's
# chunks get copies of one loader.  The first chunk's loader, by spec (a frozen dataclass: equal
# specs, one key), serves the later chunks.
_CHUNK_LOADERS: dict = {}


@dataclass(frozen=True)
class LoaderShard:
    """This rank's share of the corpus: its data-parallel rank and size, the pipeline size its
    packs are ordered for, and the packs a step."""

    dp_rank: int
    dp_size: int
    pp_size: int
    step_packs: int


def loader_shard(dp_group: Any, pp_size: int, step_packs: int) -> LoaderShard:
    """The data-parallel group's rank and size, ``pp_size`` and ``step_packs`` (Megatron's
    microbatches a step) as they are; under a decoupled layout the rank's slice's instead (a
    slice is one backbone replica): every rank of a slice decodes the packs its first backbone
    stage decodes, in that order.  An encoder rank's own role differs there: one stage, a
    data-parallel group of ``encoder_dp * backbone_dp`` ranks and ``N / encoder_dp``
    microbatches a step, while its slice trains ``N`` packs of ``backbone_dp`` shards ordered
    for ``backbone_pp`` stages (its program forwards its share of them)."""
    import torch.distributed as dist

    from mindspeed_flow.adapters.megatron import roles

    layout = roles.ROLES.layout
    if layout is None:
        return LoaderShard(dist.get_rank(dp_group), dist.get_world_size(dp_group), pp_size, step_packs)
    rank = dist.get_rank()
    encoder = layout.role(rank).region == ENCODER_REGION
    return LoaderShard(layout.replica(rank), layout.backbone_dp, layout.backbone_pp,
                       step_packs * layout.encoder_dp if encoder else step_packs)


def build_iterations(wrapped: Callable[..., Any], instance: Any, args: tuple, kwargs: dict) -> Any:
    """``build_iterations``: a :class:`FlowTrainIterator` for a ``FlowDataLoader``."""
    loaders = [_argument(args, kwargs, ITERATIONS_PARAMS, name) for name in ("train_dl", "val_dl", "test_dl")]
    if not any(isinstance(dl, FlowDataLoader) for dl in loaders):
        return wrapped(*args, **kwargs)
    if any(dl is not None and not isinstance(dl, FlowDataLoader) for dl in loaders):
        raise TypeError("--flow-packing: all of train/valid/test loaders must be FlowDataLoaders or none")
    return tuple(None if dl is None else _chunk_view(dl) or FlowTrainIterator(dl, split, _model_batch_for_entry(dl))
                 for dl, split in zip(loaders, ("train", "valid", "test")))


def _model_batch_for_entry(loader: FlowDataLoader) -> Optional[Callable[[dict[str, Any]], dict[str, Any]]]:
    """How the entry script's model takes ``loader``'s packs: ``pretrain_transformers.py``'s
    ``TransformersModel`` in upstream's ``seqlens`` / ``indices`` layout
    (:func:`~.transformers_batch.transformers_model_batch`), an image-less pack with a fake
    image in the loader's geometry and token ids (only a decoding rank has them); ``None``
    (the plugin's batch contract as it is) for ``pretrain_vlm.py``'s ``VLMModel``."""
    import sys

    from .transformers_path import ENTRY, entry_script

    if entry_script(sys.argv) != ENTRY:
        return None
    from .transformers_batch import fake_image, transformers_model_batch

    if not loader.decoding:
        return transformers_model_batch
    return functools.partial(transformers_model_batch, fake=fake_image(loader.geometry, loader.special))


def _chunk_view(loader: FlowDataLoader) -> Optional[ChunkView]:
    """A later model chunk's iterator over the first chunk's loader: a view of that chunk's
    iterator (the same batches, nothing decoded or handed off twice); ``None`` otherwise."""
    primary = next((it for it in list(_LIVE) if it.loader is loader), None)
    return None if primary is None else ChunkView(primary)


def save_checkpoint(wrapped: Callable[..., Any], instance: Any, args: tuple, kwargs: dict) -> Any:
    """``save_checkpoint``: the model's checkpoint, then the loader state of each live
    iterator's decoding rank (:func:`~.loader_state.save_loader_states`)."""
    result = wrapped(*args, **kwargs)
    save_loader_states(list(_LIVE), _argument(args, kwargs, SAVE_PARAMS, "iteration"))
    return result
