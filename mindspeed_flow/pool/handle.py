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
        version: which put of ``key`` this is: unique per put (the producer's random
            instance id and its put counter), so a handle kept after a ``release`` never
            matches the object a later put of the same key (or into the same bytes) made.
    """

    key: str
    owner: str
    offset: int
    nbytes: int
    dtype: str
    shape: tuple[int, ...]
    meta: dict[str, Any] = field(default_factory=dict)
    version: str = ""

    def to_json(self) -> bytes:
        return json.dumps(asdict(self)).encode()

    @classmethod
    def from_json(cls, data: bytes | str) -> "Handle":
        raw = json.loads(data)
        raw["shape"] = tuple(raw["shape"])
        return cls(**raw)

    def differences(self, other: "Handle") -> list[str]:
        """The fields where ``other`` differs from this handle, as ``name X (pool: Y)``."""
        return [f"{name} {getattr(other, name)!r} (pool: {getattr(self, name)!r})" for name in ADDRESS_FIELDS
                if getattr(self, name) != getattr(other, name)]


ADDRESS_FIELDS = ("version", "owner", "offset", "nbytes", "dtype", "shape", "meta")


def check_layout(handle: Handle) -> None:
    """A handle's own fields must agree: a known dtype, a non-negative offset, and
    ``nbytes`` = the shape's element count x the dtype's size.  ``ValueError`` naming the key."""
    dtype = getattr(torch, str(handle.dtype), None)
    where = f"pool handle [{handle.key}] of {handle.owner}"
    if not isinstance(dtype, torch.dtype):
        raise ValueError(f"{where}: unknown dtype {handle.dtype!r}")
    if not isinstance(handle.offset, int) or handle.offset < 0:
        raise ValueError(f"{where}: offset {handle.offset!r} is not a byte offset >= 0")
    if any(not isinstance(d, int) or d < 0 for d in handle.shape):
        raise ValueError(f"{where}: shape {handle.shape!r} is not a list of sizes >= 0")
    count = 1
    for d in handle.shape:
        count *= d
    size = count * torch.empty((), dtype=dtype).element_size()
    if handle.nbytes != size:
        raise ValueError(f"{where}: shape {list(handle.shape)} of {handle.dtype} is {size} bytes, the handle says "
                         f"nbytes {handle.nbytes}")


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def to_bytes(tensor: torch.Tensor) -> torch.Tensor:
    """The tensor's payload as a flat ``uint8`` CPU tensor (contiguous copy if needed)."""
    flat = tensor.detach().to("cpu").contiguous().reshape(-1)
    return flat.view(torch.uint8)


def from_bytes(payload: torch.Tensor, handle: Handle) -> torch.Tensor:
    """Rebuild the tensor of ``handle`` from its ``uint8`` payload (the payload is reused)."""
    check_layout(handle)
    if payload.numel() != handle.nbytes:
        raise ValueError(f"pool object [{handle.key}] of {handle.owner}: read {payload.numel()} bytes, "
                         f"the handle says {handle.nbytes}")
    return payload.view(getattr(torch, handle.dtype)).reshape(handle.shape)


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
