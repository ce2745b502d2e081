"""``shm``: processes of one node.  Each producer's segment is a POSIX shared-memory block
(``/dev/shm/msf-<pool>-<owner>``), the index a directory under ``/dev/shm``; consumers map the
owner's block and copy the bytes out, no producer involvement.

What is left in ``/dev/shm``: ``close()`` unlinks the participant's own segment, and the
last participant to close (every other one closed or dead) removes the index directory and
the segments of participants that died.  A pool whose participants were all killed (a
process group SIGKILLed) leaves its files: :func:`clean` (``mindspeed-flow pool-clean``)
removes every pool none of whose participants runs, and segments no process maps.
Segments are not left to Python's resource tracker (it would warn about, and try to remove
again, segments this module already removed when a participant failed)."""

from __future__ import annotations

import mmap
import os
import shutil
import time
import warnings
from multiprocessing import resource_tracker, shared_memory
from pathlib import Path

import torch

from .base import Pool
from .errors import ProducerDied
from .handle import Handle
from .index import FileIndex

SHM_ROOT = Path("/dev/shm")  # where Linux keeps POSIX shared memory
INDEX_PREFIX = "mindspeed_flow_pool-"
SEGMENT_PREFIX = "msf-"
ORPHAN_AGE_S = 60.0  # a segment no process maps, and no pool names, is garbage after this long


class ShmPool(Pool):
    """Args (besides :class:`~.base.Pool`'s): ``name`` of the pool (every process of it
    passes the same), ``owner`` (default ``pid<pid>``)."""

    backend = "shm"

    def __init__(self, capacity_bytes: int, *, name: str, owner: str | None = None, **options) -> None:
        self.name = name
        owner = owner or f"pid{os.getpid()}"
        self.segment = shared_memory.SharedMemory(name=self._segment_name(owner), create=True, size=capacity_bytes)
        # ours to remove (close, the last participant, clean()): not the resource tracker's, which
        # would warn at exit about segments already removed after a failure
        resource_tracker.unregister(self.segment._name, "shared_memory")  # noqa: SLF001 - the tracked name
        self.view = torch.frombuffer(self.segment.buf, dtype=torch.uint8)
        self.mapped: dict[str, torch.Tensor] = {}
        super().__init__(FileIndex(SHM_ROOT / f"{INDEX_PREFIX}{name}"), owner, capacity_bytes, **options)
        self.index.set(f"pid/{owner}", str(os.getpid()).encode())

    def _segment_name(self, owner: str) -> str:
        return _segment_name(self.name, owner)

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
        (SHM_ROOT / self.segment.name).unlink(missing_ok=True)
        _remove_if_done(self.index.root, self.name)


def _process_alive(pid: int) -> bool:
    """Running (not ended, not a zombie waiting to be reaped)."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (FileNotFoundError, IndexError):
        return False
    return state not in ("Z", "X")


def _segment_name(name: str, owner: str) -> str:
    return f"{SEGMENT_PREFIX}{name}-{owner}"


def _participants(root: Path) -> dict[str, tuple[int | None, bool]]:
    """owner -> (pid, closed) of every participant the pool's index knows."""
    index = FileIndex.__new__(FileIndex)  # read only: never create a directory that is gone
    index.root = root
    out = {}
    for key in index.keys("pid/"):
        owner = key[len("pid/"):]
        raw = index.get(key)
        out[owner] = (int(raw) if raw and raw.isdigit() else None, index.has(f"closed/{owner}"))
    return out


def _in_use(participants: dict[str, tuple[int | None, bool]]) -> bool:
    return any(not closed and pid is not None and _process_alive(pid) for pid, closed in participants.values())


def _remove_pool(root: Path, name: str, participants: dict[str, tuple[int | None, bool]]) -> list[Path]:
    removed = []
    for owner in participants:
        segment = SHM_ROOT / _segment_name(name, owner)
        if segment.exists():
            segment.unlink(missing_ok=True)
            removed.append(segment)
    if root.exists():
        shutil.rmtree(root, ignore_errors=True)
        removed.append(root)
    return removed


def _remove_if_done(root: Path, name: str) -> None:
    """The last participant out (every other one closed or dead) removes the index and the
    segments the dead left."""
    participants = _participants(root)
    if not _in_use(participants):
        _remove_pool(root, name, participants)


def _mapped_paths() -> set[str]:
    """Files under /dev/shm that some process maps (``/proc/*/maps``)."""
    mapped = set()
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/maps") as f:
                for line in f:
                    if "/dev/shm/" in line:
                        mapped.add(line.split(None, 5)[-1].strip().removesuffix(" (deleted)"))
        except OSError:
            continue
    return mapped


def clean(prefix: str = "", *, dry_run: bool = False, orphan_age_s: float = ORPHAN_AGE_S) -> list[Path]:
    """Remove what ``shm`` pools named ``prefix*`` left in ``/dev/shm`` when none of their
    participants runs any more (killed, e.g. a whole process group SIGKILLed): the index
    directory and every participant's segment; and segments of no pool that no process maps
    (older than ``orphan_age_s``).  A pool with a live participant is never touched.  The
    removed (with ``dry_run``: the removable) paths."""
    removed: list[Path] = []
    busy: list[str] = []
    for root in sorted(SHM_ROOT.glob(f"{INDEX_PREFIX}{prefix}*")):
        if not root.is_dir():
            continue
        name = root.name[len(INDEX_PREFIX):]
        participants = _participants(root)
        if _in_use(participants):
            busy.append(name)
            continue
        if dry_run:
            removed += [p for p in (SHM_ROOT / _segment_name(name, o) for o in participants) if p.exists()] + [root]
        else:
            removed += _remove_pool(root, name, participants)
    mapped = _mapped_paths()
    now = time.time()
    for segment in sorted(SHM_ROOT.glob(f"{SEGMENT_PREFIX}{prefix}*")):
        if segment in removed or any(segment.name.startswith(_segment_name(n, "")) for n in busy):
            continue
        try:
            if str(segment) in mapped or now - segment.stat().st_mtime < orphan_age_s:
                continue
            if not dry_run:
                segment.unlink()
        except FileNotFoundError:
            continue
        removed.append(segment)
    return removed


def destroy(prefix: str) -> None:
    """Remove everything pools named ``prefix*`` have in ``/dev/shm`` (index directories and
    segments), live or not.  Only when every participant of those pools has ended (the
    train job calls it after its ranks stopped); :func:`clean` checks that itself."""
    for path in [*SHM_ROOT.glob(f"{INDEX_PREFIX}{prefix}*"), *SHM_ROOT.glob(f"{SEGMENT_PREFIX}{prefix}*")]:
        if path.is_dir():
            shutil.rmtree(path, ignore_errors=True)
        else:
            path.unlink(missing_ok=True)
