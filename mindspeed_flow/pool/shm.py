"""``shm``: processes of one node.  Each producer's segment is a POSIX shared-memory block
(``/dev/shm/<pool>-<owner>``), the index a directory under ``/dev/shm``; consumers map the
owner's block and copy the bytes out, no producer involvement."""

from __future__ import annotations

import os
import shutil
from multiprocessing import resource_tracker, shared_memory
from pathlib import Path

import torch

from .base import Pool
from .handle import Handle
from .index import FileIndex

SHM_ROOT = Path("/dev/shm") if Path("/dev/shm").is_dir() else Path("/tmp")


class ShmPool(Pool):
    """Args (besides :class:`~.base.Pool`'s): ``name`` of the pool (every process of it
    passes the same), ``owner`` (default ``pid<pid>``)."""

    backend = "shm"

    def __init__(self, capacity_bytes: int, *, name: str, owner: str | None = None, **options) -> None:
        self.name = name
        owner = owner or f"pid{os.getpid()}"
        self.segment = shared_memory.SharedMemory(name=self._segment_name(owner), create=True, size=capacity_bytes)
        self.view = torch.frombuffer(self.segment.buf, dtype=torch.uint8)
        self.mapped: dict[str, shared_memory.SharedMemory] = {}
        super().__init__(FileIndex(SHM_ROOT / f"mindspeed_flow_pool-{name}"), owner, capacity_bytes, **options)
        self.index.set(f"pid/{owner}", str(os.getpid()).encode())

    def _segment_name(self, owner: str) -> str:
        return f"msf-{self.name}-{owner}"

    def write(self, handle: Handle, payload: torch.Tensor) -> None:
        self.view[handle.offset: handle.offset + handle.nbytes].copy_(payload)

    def read(self, handle: Handle) -> torch.Tensor:
        if handle.owner == self.owner:
            view = self.view
        else:
            segment = self.mapped.get(handle.owner)
            if segment is None:
                try:
                    segment = shared_memory.SharedMemory(name=self._segment_name(handle.owner))
                except FileNotFoundError:
                    from .errors import ProducerDied

                    raise ProducerDied(f"pool get [{handle.key}]: the segment of producer {handle.owner} is "
                                       "gone (it closed or died before the object was read)") from None
                # the owner unlinks its segment; this process only maps it
                resource_tracker.unregister(segment._name, "shared_memory")  # noqa: SLF001
                self.mapped[handle.owner] = segment
            view = torch.frombuffer(segment.buf, dtype=torch.uint8)
        return view[handle.offset: handle.offset + handle.nbytes].clone()

    def owner_alive(self, owner: str) -> bool:
        """Same node: the producer's process id answers at once."""
        raw = self.index.get(f"pid/{owner}")
        if raw is None:
            return super().owner_alive(owner)
        return _process_alive(int(raw)) and super().owner_alive(owner)

    def close(self) -> None:
        if self.closed:
            return
        super().close()
        del self.view
        for segment in [*self.mapped.values(), self.segment]:
            try:
                segment.close()
            except BufferError:  # a tensor still maps it: the mapping ends with the process
                pass
        self.segment.unlink()


def _process_alive(pid: int) -> bool:
    """Running (not ended, not a zombie waiting to be reaped)."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (FileNotFoundError, IndexError):
        return False
    return state not in ("Z", "X")


def destroy(prefix: str) -> None:
    """Remove what pools named ``prefix*`` left in ``/dev/shm``: index directories, and
    the segments of producers that died without closing.  Call it when every participant
    of those pools has ended."""
    for path in [*SHM_ROOT.glob(f"mindspeed_flow_pool-{prefix}*"), *SHM_ROOT.glob(f"msf-{prefix}*")]:
        if path.is_dir():
            shutil.rmtree(path, ignore_errors=True)
        else:
            path.unlink(missing_ok=True)
