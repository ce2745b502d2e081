"""One decoding rank per DP replica; its TP/PP peers receive each batch by broadcast.

MindSpeed-MM has every pipeline stage (and every TP rank) run ``get_batch`` on its own
loader, decoding the same images again.  Here the source rank sends a small header (the
keys, dtypes and shapes, the sample ids; or "end of epoch") with
``broadcast_object_list`` and then each tensor with ``broadcast``, over the group of the
replica's peers.  Works with gloo (CPU tensors) and with nccl/hccl (tensors on ``device``).

A training loop uses the step hand-off instead (:func:`send_step` / :func:`receive_step`,
driven by :class:`.handoff.StepBatches`): all of one step's batches in one header and one
broadcast per dtype, at a point every peer reaches before the step's first point-to-point
transfer (a broadcast inside ``next()`` deadlocks a pipeline: see :mod:`.handoff`).
"""

from __future__ import annotations

from typing import Any, Iterator, Optional

import torch

from .batch import TENSOR_KEYS


def source_rank(group: Any, src: Optional[int]) -> Optional[int]:
    """Global rank that decodes: ``src``, else the group's lowest rank (None without a group)."""
    if group is None:
        return None
    import torch.distributed as dist

    ranks = dist.get_process_group_ranks(group)
    chosen = min(ranks) if src is None else src
    if chosen not in ranks:
        raise ValueError(f"source rank {chosen} is not in the broadcast group {sorted(ranks)}")
    return chosen


def is_source(group: Any, src: Optional[int]) -> bool:
    if group is None:
        return True
    import torch.distributed as dist

    return dist.get_rank() == src


def _header(header: Optional[dict], src: int, group: Any, device: torch.device) -> dict:
    import torch.distributed as dist

    box = [header]
    dist.broadcast_object_list(box, src=src, group=group, device=device if device.type != "cpu" else None)
    return box[0]


def send(batch: dict[str, Any], src: int, group: Any, device: torch.device) -> None:
    import torch.distributed as dist

    meta = [(k, str(batch[k].dtype).removeprefix("torch."), tuple(batch[k].shape)) for k in TENSOR_KEYS]
    _header({"end": False, "meta": meta, "sample_ids": batch["sample_ids"]}, src, group, device)
    for k in TENSOR_KEYS:
        dist.broadcast(batch[k].to(device).contiguous(), src=src, group=group)


def send_end(src: int, group: Any, device: torch.device) -> None:
    _header({"end": True}, src, group, device)


def receive_epoch(src: int, group: Any, device: torch.device) -> Iterator[dict[str, Any]]:
    """Batches from the source rank until it says the epoch ended."""
    import torch.distributed as dist

    while True:
        header = _header(None, src, group, device)
        if header["end"]:
            return
        batch: dict[str, Any] = {}
        for key, dtype, shape in header["meta"]:
            batch[key] = torch.empty(shape, dtype=getattr(torch, dtype), device=device)
            dist.broadcast(batch[key], src=src, group=group)
        batch["sample_ids"] = header["sample_ids"]
        yield batch


# --------------------------------------------------------------------------- the step hand-off
#
# A pipeline stage after the first asks for its batch only once it received the previous
# stage's activation, so a collective inside ``next(data_iterator)`` deadlocks every
# pipeline.  The step hand-off moves all of one step's batches at once, at a point every
# rank of the group reaches before the schedule's first point-to-point transfer (the start
# of ``forward_backward_func``): one header, then one flat tensor per dtype.


def _flat_layout(metas: list[list[tuple[str, str, tuple]]]) -> dict[str, list[tuple[int, int, str, tuple]]]:
    """dtype -> [(batch, offset, key, shape)] in batch and key order, the same on every rank."""
    layout: dict[str, list[tuple[int, int, str, tuple]]] = {}
    offsets: dict[str, int] = {}
    for b, meta in enumerate(metas):
        for key, dtype, shape in meta:
            numel = 1
            for d in shape:
                numel *= int(d)
            layout.setdefault(dtype, []).append((b, offsets.get(dtype, 0), key, tuple(shape)))
            offsets[dtype] = offsets.get(dtype, 0) + numel
    return {dtype: entries + [(-1, offsets[dtype], "", ())] for dtype, entries in sorted(layout.items())}


def send_step(batches: list[dict[str, Any]], src: int, group: Any, device: torch.device) -> None:
    """The source rank's half of :func:`receive_step`: ``batches`` (CPU or ``device``
    tensors) to every peer of ``group``: one header, one ``broadcast`` per dtype."""
    import torch.distributed as dist

    metas = [[(k, str(b[k].dtype).removeprefix("torch."), tuple(b[k].shape)) for k in TENSOR_KEYS] for b in batches]
    _header({"end": False, "step": metas, "sample_ids": [b["sample_ids"] for b in batches]}, src, group, device)
    for dtype, entries in _flat_layout(metas).items():
        if entries[-1][1] == 0:
            continue  # nothing of this dtype (empty tensors only)
        flat = torch.cat([batches[b][key].reshape(-1) for b, _, key, _ in entries[:-1]]).to(device)
        dist.broadcast(flat, src=src, group=group)


def send_failure(message: str, src: int, group: Any, device: torch.device) -> None:
    """Tell the peers waiting in :func:`receive_step` that the source rank failed."""
    _header({"end": False, "error": message}, src, group, device)


def receive_step(src: int, group: Any, device: torch.device, host: bool = True) -> list[dict[str, Any]]:
    """One step's batches from the source rank (:func:`send_step`): views of one buffer per
    dtype, received on ``device`` (what the backend needs) and, with ``host``, copied to host
    memory once received, as the decoding rank's batches and an upstream loader's are: a whole
    step's batches then take accelerator memory only during the hand-off, at the start of the
    step, not while the step's activations live.  Raises ``RuntimeError`` with the source's
    message if it failed to produce them."""
    import torch.distributed as dist

    header = _header(None, src, group, device)
    if "error" in header:
        raise RuntimeError(f"the decoding rank {src} failed to produce this step's batches: {header['error']}")
    metas = header["step"]
    batches: list[dict[str, Any]] = [{} for _ in metas]
    for dtype, entries in _flat_layout(metas).items():
        flat = torch.empty(entries[-1][1], dtype=getattr(torch, dtype), device=device)
        if flat.numel():
            dist.broadcast(flat, src=src, group=group)
        if host and flat.device.type != "cpu":
            flat = flat.cpu()
        for (b, offset, key, shape), (_, end, _, _) in zip(entries[:-1], entries[1:]):
            batches[b][key] = flat[offset:end].view(shape)
    for batch, ids in zip(batches, header["sample_ids"]):
        batch["sample_ids"] = ids
    return batches
