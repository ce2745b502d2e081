"""``shm``: processes of one node.  Each producer's segment is a POSIX shared-memory block
(``/dev/shm/<pool>-<owner>``), the index a directory under ``/dev/shm``; consumers map the
owner's block and copy the bytes out, no producer involvement."""

from __future__ import annotations

import os
import shutil
import warnings
import mmap
from multiprocessing import shared_memory
from pathlib import Path

import torch

from .base import Pool
from .errors import ProducerDied
from .handle import Handle
from .index import FileIndex

SHM_ROOT = Path("/dev/shm")  # where Linux keeps POSIX shared memory


class ShmPool(Pool):
    """Args (besides :class:`~.base.Pool`'s): ``name`` of the pool (every process of it
    passes the same), ``owner`` (default ``pid<pid>``)."""

    backend = "shm"

    def __init__(self, capacity_bytes: int, *, name: str, owner: str | None = None, **options) -> None:
        self.name = name
        owner = owner or f"pid{os.getpid()}"
        self.segment = shared_memory.SharedMemory(name=self._segment_name(owner), create=True, size=capacity_bytes)
        self.view = torch.frombuffer(self.segment.buf, dtype=torch.uint8)
        self.mapped: dict[str, torch.Tensor] = {}
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
            view = self.mapped.get(handle.owner)
            if view is None:
                view = self.mapped[handle.owner] = self._map(handle)
        return view[handle.offset: handle.offset + handle.nbytes].clone()

    def _map(self, handle: Handle) -> torch.Tensor:
        """The owner's block, mapped read-only straight from ``/dev/shm`` (not through
        ``SharedMemory``, whose resource tracker would unlink a block it does not own)."""
        path = SHM_ROOT / self._segment_name(handle.owner)
        try:
            with open(path, "rb") as f:
                block = mmap.mmap(f.fileno(), 0, prot=mmap.PROT_READ)
        except FileNotFoundError:
            raise ProducerDied(f"pool get [{handle.key}]: the segment of producer {handle.owner} is gone "
                               "(it closed or died before the object was read)") from None
        with warnings.catch_warnings():  # read-only on purpose: consumers only copy out
            warnings.simplefilter("ignore", UserWarning)
            return torch.frombuffer(block, dtype=torch.uint8)

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
        self.mapped.clear()
        try:
            self.segment.close()
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
