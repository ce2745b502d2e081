"""One decoding rank per DP replica; its TP/PP peers receive each batch by broadcast.

MindSpeed-MM has every pipeline stage (and every TP rank) run ``get_batch`` on its own
loader, decoding the same images again.  Here the source rank sends a small header (the
keys, dtypes and shapes, the sample ids; or "end of epoch") with
``broadcast_object_list`` and then each tensor with ``broadcast``, over the group of the
replica's peers.  Works with gloo (CPU tensors) and with nccl/hccl (tensors on ``device``).
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
