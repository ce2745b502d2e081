"""``FlowDataLoader``: one DP rank's online-packing multimodal loader with exact resume.

Pipeline: :class:`.stream.RankStream` (this rank's shard, decoded in worker processes by
torchdata's ``StatefulDataLoader``) -> the overlong policy (:mod:`.overlong`) ->
``BestFitPacker`` (open packs in a bounded window) -> ``dispatch`` (the packs of one step
ordered by cost for the pipeline) -> :func:`.batch.collate_pack` (the join, on
``JOIN_THREADS`` threads of this process: packs are yielded in order).  With a ``group``, only
the decoding rank reads; its TP/PP peers receive the batches from it (:mod:`.broadcast`):

- in a training loop, one step at a time: :class:`.handoff.StepBatches` wraps the loader and
  its ``handoff(n)`` moves a whole step's batches in one collective that every rank of the
  group calls before the schedule's first point-to-point transfer; ``next()`` never
  communicates, so a pipeline stage that asks for its batch only after a receive cannot
  deadlock (PP >= 2);
- iterating the loader itself (``for batch in loader`` on every peer) broadcasts each batch
  as it is yielded: only for peers that ask for each batch at the same time (TP ranks, tests),
  never for pipeline stages.

Exact resume: ``state_dict()`` holds the ``StatefulDataLoader`` state (epoch, position of
each worker, so samples decoded ahead in the workers are decoded again after a resume,
never lost), the packer (pickled: its open packs, their order and its counters), the keys
of the samples held in open or not yet yielded packs (re-decoded by ``load_state_dict``,
which is deterministic, instead of storing pixels), and the counters.  A resumed loader
yields exactly the packs the uninterrupted one would have yielded.

Resuming with a different ``dp_size``, ``dp_rank``, ``num_workers``, ``seed``,
``capacity``, ``window``, ``overlong``, pixel bounds, chat template or corpus size is refused with a
:class:`.errors.ResumeMismatch` (a ``ValueError``) naming what differs.  A new DP layout is
refused because the epoch's remaining samples are spread over every rank's state and
re-sharding them would need all ranks' states at once; the other settings change the order
or the lengths of held samples.
"""

from __future__ import annotations

import logging
import os
import pickle
import warnings
from collections import deque
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any, Iterator, Literal, Optional, Sequence

import numpy as np
import torch
from torchdata.stateful_dataloader import StatefulDataLoader

from mindspeed_flow.packing import BestFitPacker, CostModel, dispatch

from . import broadcast
from .batch import collate_pack, real_tokens
from .conversation import DEFAULT_TEMPLATE, template_system
from .decode import BadSample, Decoder, Sample, from_wire, to_wire
from .errors import ResumeMismatch
from .images import QWEN2_VL, ImageGeometry
from .overlong import POLICIES, OverlongPolicy, fit
from .sharding import check_rank
from .source import Corpus
from .stats import LoaderStats
from .stream import RankStream
from .tokenizer import load_tokenizer

log = logging.getLogger("mindspeed_flow.data")

STATE_FORMAT = 1
# Settings that must match on resume (see the module docstring).
RESUME_KEYS = ("dp_rank", "dp_size", "num_workers", "seed", "capacity", "window", "corpus_size", "shuffle",
               "overlong", "min_pixels", "max_pixels", "records", "image_geometry", "template")
Key = tuple[int, int]  # (record index, chunk)
# Packs joined at once on threads of the decoding process.  The join (normalising a pack's
# pixels into a fresh float32 buffer) is most of this process's work and releases the GIL,
# so joining on threads overlaps it with receiving the next samples from the workers.
JOIN_THREADS = 2


def default_cost_model(capacity: int) -> CostModel:
    """The cost a pack of ``capacity`` tokens is ordered by when none is given: its tokens plus
    attention's ``sum l^2 / capacity`` (a full pack of one sample costs twice its tokens)."""
    return CostModel(linear=1.0, quadratic=1.0 / capacity)


class FlowDataLoader:
    """Iterate to get packed microbatches (see :mod:`.batch` for the contract); one ``for``
    loop is one epoch (or the rest of it), the next loop starts the next epoch.

    Args:
        source: a ``.jsonl``/``.json`` file or a directory of them (MindSpeed-MM records).
        tokenizer_or_processor: see :func:`.tokenizer.load_tokenizer`; ``None``: the demo
            tokenizer beside the corpus.
        capacity: tokens per pack.
        dp_rank, dp_size: this rank's data-parallel coordinates (the shard it reads).
        num_workers: decoding processes (0: decode in this process).
        seed: drives the per-epoch shuffle (the same on every rank).
        window: open packs the online packer keeps (the look-ahead).  Held samples are
            decoded (pixels included): memory grows with ``window * capacity``.
        overlong: samples longer than ``capacity``: ``"split"``, ``"truncate"``, ``"drop"``
            or ``"error"`` (see :mod:`.overlong`).
        bad_input: ``"skip"`` (count, log a warning with the place, continue) or ``"fail"``
            (raise naming the place).
        step_packs, pp_size, cost_model: packs are ordered ``step_packs`` at a time by
            ``dispatch(costs, 1, pp_size)`` (heaviest first; zig-zag for PP > 1).
        group, src: with a process group of the DP replica's TP/PP peers, only global rank
            ``src`` (default: the group's lowest rank) reads and decodes; the others receive
            the batches from it, tensors on ``device`` (see the module docstring: per step
            through :class:`.handoff.StepBatches`, or per batch when iterated directly).
        image_root: directory that image paths are relative to (default: each shard's).
        min_pixels, max_pixels: dynamic-resolution bounds (default: the processor's; without
            an image processor 3136 and 262144).
        processor_file: where the processor's configuration lies, named in the error raised
            when its image processor lacks a value the images need (patch, merge or temporal
            size, mean/std, pixel bounds: :meth:`.images.ImageGeometry.from_processor`).
            Without an image processor (a bare tokenizer, the demo one) images are cut as
            Qwen2-VL's (:data:`.images.QWEN2_VL`).
        records: the global record indices this loader reads (a subset of the corpus, e.g.
            the training or the held-out part of a validation split); ``None``: all.  The
            epoch order and the DP shards are drawn over the subset.
        pad_multiple: every pack is padded to a multiple of this many tokens (TP x CP with
            sequence parallelism, see :func:`.batch.pack_multiple`); ``capacity`` must be a
            multiple of it.  The padding is counted in ``stats.pad_tokens``.
        prefetch_factor: samples each worker decodes ahead (8: the workers keep decoding
            while this process packs and joins).
        template: MindSpeed-MM's chat template the records are written in (its
            ``basic_parameters.template``): ``"qwen2vl"`` or ``"qwen3_vl_nothink"``, which
            differ in the system turn a record without one gets; another name is refused
            (:func:`.conversation.template_system`).
    """

    def __init__(
        self,
        source: str | os.PathLike,
        tokenizer_or_processor: Any = None,
        capacity: int = 8192,
        dp_rank: int = 0,
        dp_size: int = 1,
        num_workers: int = 2,
        seed: int = 1234,
        window: int = 1024,
        overlong: OverlongPolicy = "split",
        *,
        bad_input: Literal["skip", "fail"] = "skip",
        shuffle: bool = True,
        step_packs: int = 1,
        pp_size: int = 1,
        cost_model: Optional[CostModel] = None,
        group: Any = None,
        src: Optional[int] = None,
        device: str | torch.device = "cpu",
        image_root: Optional[str | os.PathLike] = None,
        min_pixels: Optional[int] = None,
        max_pixels: Optional[int] = None,
        prefetch_factor: int = 8,
        records: Optional[Sequence[int]] = None,
        pad_multiple: int = 1,
        processor_file: str = "preprocessor_config.json",
        template: str = DEFAULT_TEMPLATE,
    ) -> None:
        if overlong not in POLICIES:
            raise ValueError(f"overlong must be one of {POLICIES}, got {overlong!r}")
        if bad_input not in ("skip", "fail"):
            raise ValueError(f"bad_input must be 'skip' or 'fail', got {bad_input!r}")
        if step_packs < 1:
            raise ValueError(f"step_packs must be >= 1, got {step_packs}")
        if pad_multiple < 1 or capacity % pad_multiple:
            raise ValueError(f"capacity {capacity} must be a multiple of pad_multiple {pad_multiple} (>= 1): a padded "
                             f"pack must still fit the capacity")
        self.pad_multiple = pad_multiple
        self.template, default_system = template, template_system(template)
        check_rank(dp_rank, dp_size)  # here, not first in a decoding worker
        self.capacity, self.window, self.overlong, self.bad_input = capacity, window, overlong, bad_input
        self.dp_rank, self.dp_size, self.num_workers, self.seed, self.shuffle = dp_rank, dp_size, num_workers, seed, shuffle
        self.step_packs, self.pp_size = step_packs, pp_size
        self.cost_model = cost_model or default_cost_model(capacity)
        self.prefetch_factor = prefetch_factor
        self.group, self.device = group, torch.device(device)
        self.src = broadcast.source_rank(group, src)
        self.decoding = broadcast.is_source(group, self.src)
        self.stats = LoaderStats(capacity=capacity)
        self.epoch = 0
        if not self.decoding:
            return
        corpus = Corpus.open(source)
        self._records = None if records is None else _check_records(records, len(corpus), source)
        size = len(corpus) if self._records is None else len(self._records)
        if size < dp_size:
            raise ValueError(f"{source}: {size} record(s){'' if records is None else ' selected'} for {dp_size} "
                             f"DP ranks: DP rank {dp_rank} would have no sample to read")
        tokenizer = load_tokenizer(tokenizer_or_processor, corpus.root)
        image_processor = getattr(tokenizer_or_processor, "image_processor", None)
        geometry = QWEN2_VL if image_processor is None else ImageGeometry.from_processor(image_processor,
                                                                                         processor_file)
        self.geometry = geometry
        self._decoder = Decoder(
            corpus, tokenizer, Path(image_root) if image_root is not None else None,
            min_pixels if min_pixels is not None else geometry.min_pixels,
            max_pixels if max_pixels is not None else geometry.max_pixels, geometry, default_system,
        )
        self.special = tokenizer.special  # the tokens a consumer needs to add an image of its own
        self._image_token_id = tokenizer.special.image_pad
        self._pad_id = tokenizer.special.pad
        self._packer = BestFitPacker(capacity, window=window, overlong="error")
        self._held: dict[Key, Sample] = {}  # samples of open, closed-but-unordered and ready packs
        self._closed: list[list[Key]] = []  # closed packs waiting for their step's dispatch
        self._ready: deque[list[Key]] = deque()  # ordered packs, next to be yielded
        self._joining: deque[tuple[list[Key], Future]] = deque()  # the next packs, being joined (in order)
        self._stream_state: Optional[dict] = None  # StatefulDataLoader state; None: epoch start
        self._drained = False  # True once the epoch's stream has ended (the packer is flushed)
        self._live: Optional[StatefulDataLoader] = None

    # ------------------------------------------------------------------ iteration
    def __iter__(self) -> Iterator[dict[str, Any]]:
        """One epoch; with a group every peer must iterate in lockstep (a broadcast per
        batch): a pipeline uses :class:`.handoff.StepBatches` instead."""
        if not self.decoding:
            yield from broadcast.receive_epoch(self.src, self.group, self.device)
            return
        for batch in self._epoch():
            if self.group is not None:
                broadcast.send(batch, self.src, self.group, self.device)
            yield batch
        if self.group is not None:
            broadcast.send_end(self.src, self.group, self.device)

    def decoded_epoch(self) -> Iterator[dict[str, Any]]:
        """The decoding rank's epoch (or the rest of it) without sending anything to the
        group: what :class:`.handoff.StepBatches` hands off step by step."""
        if not self.decoding:
            raise RuntimeError(f"rank is not the decoding rank of its group (source rank {self.src}): "
                               "it receives its batches and decodes none")
        return self._epoch()

    def _epoch(self) -> Iterator[dict[str, Any]]:
        with ThreadPoolExecutor(JOIN_THREADS, thread_name_prefix="flow-join") as joiner:
            if not self._drained:
                self._stream_state = self._current_stream_state()
                loader = self._stream_loader()
                self._live = loader
                for item in loader:
                    self._take(item)
                    yield from self._joined(joiner, final=False)
                self._live = None
                self._stream_state = None
                self._drained = True  # the epoch's records are all read; what is left is in the packer
                self._closed.extend(self._packer.flush())
                self._order_closed(final=True)
            yield from self._joined(joiner, final=True)
        self._drained = False
        self.epoch += 1
        self.stats.epochs += 1

    def _stream_loader(self) -> StatefulDataLoader:
        stream = RankStream(self._decoder, self.seed, self.dp_rank, self.dp_size, self.shuffle, self._records)
        stream.epoch = self.epoch
        extra = {} if self.num_workers == 0 else {"prefetch_factor": self.prefetch_factor}
        with warnings.catch_warnings():  # torchdata 0.11 calls torch's deprecated set_vital
            warnings.filterwarnings("ignore", message=".*set_vital.*")
            loader = StatefulDataLoader(stream, batch_size=None, num_workers=self.num_workers,
                                        collate_fn=to_wire, **extra)
        if self._stream_state is not None:
            loader.load_state_dict(self._stream_state)
        return loader

    def _current_stream_state(self) -> Optional[dict]:
        return self._live.state_dict() if self._live is not None else self._stream_state

    def _take(self, item: Sample | BadSample) -> None:
        item = from_wire(item)
        self.stats.samples_seen += 1
        if isinstance(item, BadSample):
            self._bad(item.kind, item.index, item.sample_id, item.reason)
            return
        pieces = fit(item, self.capacity, self.overlong, self._image_token_id, self.geometry.merge)
        if pieces is None:
            policy = "fail" if self.overlong == "error" else "skip"
            self._bad("overlong", item.index, item.sample_id,
                      f"{len(item)} tokens > capacity {self.capacity} (overlong={self.overlong!r}"
                      f"{'' if self.overlong in ('drop', 'error') else '; an image alone exceeds the capacity'})",
                      policy)
            return
        self.stats.samples_packed += 1
        for piece in pieces:
            self.stats.chunks += 1
            self._held[piece.key] = piece
            self._closed.extend(self._packer.add(piece.key, len(piece)))
        self._order_closed(final=False)

    def _bad(self, kind: str, index: int, sample_id: str, reason: str, policy: Optional[str] = None) -> None:
        self.stats.bad[kind] += 1
        shard, _ = self._decoder.corpus.locate(index)
        message = f"{kind}: {shard.path} sample {sample_id}: {reason}"
        if (policy or self.bad_input) == "fail":
            raise ValueError(f"{message} (policy: fail)")
        log.warning("%s (policy: skip; %d %s so far on DP rank %d)", message, self.stats.bad[kind], kind, self.dp_rank)

    def _order_closed(self, final: bool) -> None:
        while len(self._closed) >= self.step_packs or (final and self._closed):
            step, self._closed = self._closed[:self.step_packs], self._closed[self.step_packs:]
            costs = [self.cost_model.cost([len(self._held[k]) for k in pack]) for pack in step]
            (order,) = dispatch(costs, dp_size=1, pp_size=self.pp_size)
            self._ready.extend(step[i] for i in order)

    def _joined(self, joiner: ThreadPoolExecutor, final: bool) -> Iterator[dict[str, Any]]:
        """Start joining ready packs (up to ``JOIN_THREADS`` ahead), then yield the joined ones
        in order: the first pack as soon as it is joined, any pack when ``JOIN_THREADS`` are
        in flight, all of them when ``final``.  A pack stays in ``_joining`` (and its samples in
        ``_held``) until it is yielded, so a state taken meanwhile lists it as ready."""
        while True:
            while self._ready and len(self._joining) < JOIN_THREADS:
                pack = self._ready.popleft()
                samples = [self._held[k] for k in pack]
                self._joining.append((pack, joiner.submit(collate_pack, samples, self.pad_multiple, self._pad_id,
                                                                     self.geometry)))
            if not self._joining or not (final or self._ready or self._joining[0][1].done()):
                return
            pack, joined = self._joining.popleft()
            yield self._emit(pack, joined.result())

    def _emit(self, pack: list[Key], batch: dict[str, Any]) -> dict[str, Any]:
        for k in pack:
            del self._held[k]
        tokens = real_tokens(batch)
        self.stats.packs += 1
        self.stats.tokens += tokens
        self.stats.pad_tokens += batch["input_ids"].shape[1] - tokens
        return batch

    # ------------------------------------------------------------------ state
    def _settings(self) -> dict[str, Any]:
        return {"dp_rank": self.dp_rank, "dp_size": self.dp_size, "num_workers": self.num_workers, "seed": self.seed,
                "capacity": self.capacity, "window": self.window, "shuffle": self.shuffle, "overlong": self.overlong,
                "template": None if self.template == DEFAULT_TEMPLATE else self.template,  # older states: qwen2vl
                **({"corpus_size": len(self._decoder.corpus), "min_pixels": self._decoder.min_pixels,
                    "max_pixels": self._decoder.max_pixels, "records": _records_digest(self._records),
                    "image_geometry": _geometry_key(self.geometry)}
                   if self.decoding else {})}

    def state_dict(self) -> dict[str, Any]:
        """A snapshot to resume from (see the module docstring); peers that only receive
        hold no data position and return their settings only."""
        state: dict[str, Any] = {"format": STATE_FORMAT, **self._settings(), "decoding": self.decoding}
        if not self.decoding:
            return state
        return {
            **state,
            "epoch": self.epoch,
            "stream": self._current_stream_state(),
            "drained": self._drained,
            "packer": pickle.dumps(self._packer),
            "held": sorted(self._held),
            "closed": [list(p) for p in self._closed],
            "ready": [list(p) for p, _ in self._joining] + [list(p) for p in self._ready],
            "stats": self.stats.to_dict(),
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if state.get("format") != STATE_FORMAT:
            raise ResumeMismatch(f"loader state format {state.get('format')!r} is not {STATE_FORMAT}")
        mine = self._settings()
        differ = [f"{k}: saved {state.get(k)!r}, now {mine[k]!r}" for k in RESUME_KEYS
                  if k in mine and state.get(k) != mine[k]]
        if differ:
            raise ResumeMismatch("cannot resume this loader state: " + "; ".join(differ) +
                                 " (resume with the saved settings; a new DP layout would need every rank's state "
                                 "to re-shard the epoch's remaining samples)")
        if not self.decoding:
            return
        self._live = None  # an unfinished loop's position is replaced by the saved one
        self._joining.clear()  # packs being joined are listed as ready in the state: joined again
        self.epoch = int(state["epoch"])
        self._stream_state = state["stream"]
        self._drained = bool(state["drained"])
        self._packer = pickle.loads(state["packer"])
        self._held = self._redecode([tuple(k) for k in state["held"]])
        self._closed = [[tuple(k) for k in p] for p in state["closed"]]
        self._ready = deque([tuple(k) for k in p] for p in state["ready"])
        self.stats = LoaderStats.from_dict(state["stats"])

    def _redecode(self, keys: list[Key]) -> dict[Key, Sample]:
        """The held samples again, from their records (decoding is deterministic)."""
        held: dict[Key, Sample] = {}
        for index in sorted({i for i, _ in keys}):
            sample = self._decoder(index)
            pieces = None if isinstance(sample, BadSample) else fit(sample, self.capacity, self.overlong,
                                                                  self._image_token_id, self.geometry.merge)
            if pieces is None:
                raise ResumeMismatch(f"resume: sample {self._decoder.corpus.place(index)} was packed before the "
                                     f"checkpoint but cannot be decoded now (did its file change?)")
            held.update((p.key, p) for p in pieces)
        missing = [k for k in keys if k not in held]
        if missing:
            raise ResumeMismatch(f"resume: chunks {missing[:5]} of held samples are missing after re-decoding")
        return {k: held[k] for k in keys}


def _check_records(records: Sequence[int], corpus_size: int, source: Any) -> np.ndarray:
    """``records`` as int64 indices, refused when one is out of the corpus or repeated."""
    indices = np.asarray(records, dtype=np.int64).reshape(-1)
    if indices.size and (indices.min() < 0 or indices.max() >= corpus_size):
        raise ValueError(f"records: indices must lie in [0, {corpus_size}) (the records of {source}), "
                         f"got {int(indices.min())}..{int(indices.max())}")
    if np.unique(indices).size != indices.size:
        raise ValueError("records: an index appears more than once")
    return indices


def _geometry_key(geometry: ImageGeometry) -> Optional[tuple]:
    """The image geometry a state was saved with (patches, merge, mean/std change every held
    sample's pixels and lengths); ``None`` for Qwen2-VL's default, so states saved before
    the geometry was recorded still resume."""
    def key(g: ImageGeometry) -> tuple:
        return g.patch, g.merge, g.temporal_patch, g.mean, g.std

    return None if key(geometry) == key(QWEN2_VL) else key(geometry)


def _records_digest(records: Optional[np.ndarray]) -> Optional[str]:
    """A short fingerprint of a record subset (what a resumed loader must read again)."""
    if records is None:
        return None
    import hashlib

    return f"{records.size}:{hashlib.sha256(records.tobytes()).hexdigest()[:16]}"
