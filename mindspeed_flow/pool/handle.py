"""A pooled object's global address and metadata.

A handle is what a producer's ``put`` returns and what the pool's index stores under the
key: any process that can read the index can locate the bytes (``owner`` contributed the
memory, ``offset``/``nbytes`` locate them in the owner's segment) and rebuild the tensor
(``dtype``, ``shape``) without asking the producer anything.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from typing import Any

import torch


@dataclass(frozen=True)
class Handle:
    """Where one pooled tensor lives.

    Attributes:
        key: the global key it was put under.
        owner: the producer whose segment holds the bytes (its pool identity).
        offset: byte offset in the owner's segment.
        nbytes: size of the payload in bytes.
        dtype: ``torch`` dtype name (``"float32"``, ``"bfloat16"``, ...).
        shape: tensor shape.
        meta: the producer's metadata (sample ids, token counts, microbatch, ...); JSON.
    """

    key: str
    owner: str
    offset: int
    nbytes: int
    dtype: str
    shape: tuple[int, ...]
    meta: dict[str, Any] = field(default_factory=dict)

    def to_json(self) -> bytes:
        return json.dumps(asdict(self)).encode()

    @classmethod
    def from_json(cls, data: bytes | str) -> "Handle":
        raw = json.loads(data)
        raw["shape"] = tuple(raw["shape"])
        return cls(**raw)


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def to_bytes(tensor: torch.Tensor) -> torch.Tensor:
    """The tensor's payload as a flat ``uint8`` CPU tensor (contiguous copy if needed)."""
    flat = tensor.detach().to("cpu").contiguous().reshape(-1)
    return flat.view(torch.uint8)


def from_bytes(payload: torch.Tensor, handle: Handle) -> torch.Tensor:
    """Rebuild the tensor of ``handle`` from its ``uint8`` payload (the payload is reused)."""
    dtype = getattr(torch, handle.dtype, None)
    if not isinstance(dtype, torch.dtype):
        raise ValueError(f"pool object [{handle.key}] of {handle.owner}: unknown dtype {handle.dtype!r}")
    if payload.numel() != handle.nbytes:
        raise ValueError(f"pool object [{handle.key}] of {handle.owner}: read {payload.numel()} bytes, "
                         f"the handle says {handle.nbytes}")
    return payload.view(dtype).reshape(handle.shape)


def check_meta(key: str, meta: dict | None) -> dict:
    """Metadata must survive JSON: refuse anything that would not come back equal."""
    meta = dict(meta or {})
    try:
        back = json.loads(json.dumps(meta))
    except (TypeError, ValueError) as exc:
        raise TypeError(f"pool put [{key}]: metadata is not JSON-serialisable: {exc}") from None
    if back != meta:
        raise TypeError(f"pool put [{key}]: metadata does not round-trip through JSON "
                        "(tuples become lists, non-string keys become strings); use lists and str keys")
    return meta
