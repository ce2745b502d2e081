"""Where handles, claims and heartbeats live: a tiny key-value index every process of a
pool can read.  One implementation per kind of sharing: a dict (threads), a directory in
``/dev/shm`` (processes of one node), a ``torch.distributed`` store (any cluster)."""

from __future__ import annotations

import os
import threading
from pathlib import Path
from typing import Any, Protocol
from urllib.parse import quote, unquote


class Index(Protocol):
    def set(self, key: str, value: bytes) -> None: ...

    def get(self, key: str) -> bytes | None: ...

    def delete(self, key: str) -> None: ...

    def has(self, key: str) -> bool: ...


class MemoryIndex:
    """A dict behind a lock: threads of one process."""

    def __init__(self) -> None:
        self.data: dict[str, bytes] = {}
        self.lock = threading.Lock()

    def set(self, key: str, value: bytes) -> None:
        with self.lock:
            self.data[key] = value

    def get(self, key: str) -> bytes | None:
        with self.lock:
            return self.data.get(key)

    def delete(self, key: str) -> None:
        with self.lock:
            self.data.pop(key, None)

    def has(self, key: str) -> bool:
        with self.lock:
            return key in self.data


class FileIndex:
    """One file per key in a directory (``/dev/shm`` is memory): atomic writes by rename."""

    def __init__(self, root: Path) -> None:
        self.root = root
        root.mkdir(parents=True, exist_ok=True)

    def path(self, key: str) -> Path:
        return self.root / quote(key, safe="")

    def set(self, key: str, value: bytes) -> None:
        target = self.path(key)
        tmp = target.with_name(f".{target.name}.{os.getpid()}.{threading.get_ident()}")
        tmp.write_bytes(value)
        os.replace(tmp, target)

    def get(self, key: str) -> bytes | None:
        try:
            return self.path(key).read_bytes()
        except FileNotFoundError:
            return None

    def delete(self, key: str) -> None:
        self.path(key).unlink(missing_ok=True)

    def has(self, key: str) -> bool:
        return self.path(key).exists()

    def keys(self, prefix: str) -> list[str]:
        """The keys that start with ``prefix`` (none when the directory is gone)."""
        try:
            names = os.listdir(self.root)
        except FileNotFoundError:
            return []
        return sorted(key for key in map(unquote, names) if key.startswith(prefix) and not key.startswith("."))


class StoreIndex:
    """A ``torch.distributed`` store (``TCPStore``), under a prefix of its own."""

    def __init__(self, store: Any, prefix: str) -> None:
        import torch.distributed as dist

        self.store = dist.PrefixStore(prefix, store)

    def set(self, key: str, value: bytes) -> None:
        self.store.set(key, value)

    def get(self, key: str) -> bytes | None:
        if not self.store.check([key]):
            return None
        try:
            return self.store.get(key)
        except RuntimeError:  # deleted between check and get
            return None

    def delete(self, key: str) -> None:
        self.store.delete_key(key)

    def has(self, key: str) -> bool:
        return bool(self.store.check([key]))
