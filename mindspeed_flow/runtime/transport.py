"""Point-to-point transfers with shape metadata, eager sends and bounded waits.

Every tensor travels as two messages: a small int64 header (dtype, rank of the shape, the
shape) and the data.  The receiver allocates from the header, so each microbatch may have
its own shape (packed sequences of different total length): no common ``seq_length`` is
ever assumed (Megatron's ``--variable-seq-lengths`` pattern, for every tensor).

Sends are *eager*: ``isend`` returns at once and the send buffer is kept alive until the
transport reports completion (:meth:`Transport.retire`, or :meth:`Transport.drain` at the
end of the step).  Receives block the program, but not forever.  gloo's requests neither
report completion before ``wait()`` is called (``is_completed()`` stays False) nor survive a
``wait(timeout)`` that expires (it closes the connection), so a :class:`Waiter` thread calls
the blocking ``wait()`` and the program thread waits for that thread's signal in slices,
reading the step's abort board (a key in the process group's store) between them: a wait
ends with :class:`PeerFailure` when another rank reported a failure, when the transport
fails (a peer's process died and its sockets closed), or after ``timeout_s``.
"""

from __future__ import annotations

import atexit
import logging
import queue
import threading
import time
import weakref
from collections import deque
from dataclasses import dataclass
from typing import Any, Callable, Mapping, Sequence

import torch
import torch.distributed as dist

from .errors import PeerFailure

_DTYPES = (torch.float32, torch.float16, torch.bfloat16, torch.float64, torch.int64, torch.int32,
           torch.int8, torch.uint8, torch.bool)
MAX_DIMS = 8
_HEADER = 2 + MAX_DIMS  # dtype code, number of dims, dims


def header(tensor: torch.Tensor) -> torch.Tensor:
    """The int64 header announcing ``tensor``'s dtype and shape."""
    if tensor.dtype not in _DTYPES:
        raise TypeError(f"cannot send dtype {tensor.dtype}: supported {list(_DTYPES)}")
    if tensor.dim() > MAX_DIMS:
        raise ValueError(f"cannot send a {tensor.dim()}-d tensor: at most {MAX_DIMS} dims")
    values = [_DTYPES.index(tensor.dtype), tensor.dim(), *tensor.shape]
    return torch.tensor(values + [0] * (_HEADER - len(values)), dtype=torch.int64)


def empty_from_header(values: torch.Tensor, device: torch.device) -> torch.Tensor:
    code, ndim = int(values[0]), int(values[1])
    shape = [int(v) for v in values[2:2 + ndim]]
    return torch.empty(shape, dtype=_DTYPES[code], device=device)


class AbortBoard:
    """Where the first failing rank of a step writes what failed, for everyone to read.

    A key per step in a store every rank shares (the default process group's store);
    ``None`` disables the board (waits then end by the transport's error or the timeout).
    A store that fails once (its server, torchrun's agent or rank 0, is gone) disables the
    board too: each failed request would print c10d's warning with a C++ backtrace, four
    times a second per waiting rank.
    """

    def __init__(self, store: Any | None, key: str) -> None:
        self.store = store
        self.key = key

    def post(self, message: str) -> None:
        if self.store is None:
            return
        try:
            if not self.store.check([self.key]):
                self.store.set(self.key, message)
        except Exception:  # noqa: BLE001 - the store's server may be the process that died
            self.store = None

    def read(self) -> str | None:
        if self.store is None:
            return None
        try:
            if self.store.check([self.key]):
                return self.store.get(self.key).decode()
        except Exception:  # noqa: BLE001 - as above
            self.store = None
            return None
        return None


@dataclass(frozen=True)
class WaitPolicy:
    """How long a wait may take and how often it looks at the abort board.

    Attributes:
        timeout_s: a receive or collective waiting longer fails (default 30 s).
        abort_poll_s: how often a waiting rank reads the abort board.
    """

    timeout_s: float = 30.0
    abort_poll_s: float = 0.25


class Pending:
    """A request handed to a :class:`Waiter`: ``done`` is set once ``wait()`` returned or
    raised (then ``error`` holds the exception)."""

    __slots__ = ("work", "done", "error", "buffers", "what")

    def __init__(self, work: Any, buffers: tuple, what: Callable[[], str]) -> None:
        self.work = work
        self.done = threading.Event()
        self.error: BaseException | None = None
        self.buffers = buffers  # kept alive until the request completes
        self.what = what


class Waiter:
    """A daemon thread calling the blocking ``wait()`` of requests, in the order given.

    Stopped at interpreter exit (:func:`stop_waiters`, an ``atexit`` handler, which runs
    while the interpreter is still whole): a daemon thread that is inside a C++ ``wait()``
    when the interpreter finalizes is killed with ``pthread_exit`` as soon as the wait
    returns and it asks for the GIL, which unwinds through C++ frames that may not be
    unwound and ends the process with ``terminate called without an active exception``
    (SIGABRT, issue 19 defect 5).  So at exit each waiter gets a stop marker after its
    requests and is joined; one still inside a request that does not complete within
    :data:`EXIT_GRACE_S` is named in a warning.  ``_loop`` keeps no reference to a request
    it finished (its buffers and the backend's work object are freed while Python runs).
    """

    def __init__(self, name: str) -> None:
        self.queue: queue.SimpleQueue[Pending | None] = queue.SimpleQueue()
        self.current: Pending | None = None  # the request whose wait() runs now
        self.thread = threading.Thread(target=self._loop, name=name, daemon=True)
        self.thread.start()
        _WAITERS.add(self)

    def submit(self, work: Any, buffers: tuple = (), what: Callable[[], str] = str) -> Pending:
        pending = Pending(work, buffers, what)
        self.queue.put(pending)
        return pending

    def stop(self, timeout: float | None = None) -> bool:
        """Let the thread finish the requests submitted so far and end; ``True`` once it
        has ended (within ``timeout`` seconds)."""
        if self.thread.is_alive():
            self.queue.put(None)
            self.thread.join(timeout)
        return not self.thread.is_alive()

    def _loop(self) -> None:
        while True:
            pending = self.queue.get()
            if pending is None:
                return
            self.current = pending
            try:
                pending.work.wait()
            except BaseException as exc:  # noqa: BLE001 - handed to the program thread
                pending.error = exc
            self.current = None
            pending.done.set()
            del pending  # nothing of a finished request stays referenced by this thread


EXIT_GRACE_S = 5.0
_WAITERS: "weakref.WeakSet[Waiter]" = weakref.WeakSet()


def stop_waiters(timeout_s: float = EXIT_GRACE_S) -> list[str]:
    """Stop every live :class:`Waiter` (see its docstring); returns a description of each
    one that is still inside a request after ``timeout_s`` in all."""
    deadline = time.monotonic() + timeout_s
    stuck = []
    for waiter in list(_WAITERS):
        if not waiter.stop(max(0.0, deadline - time.monotonic())):
            current = waiter.current
            stuck.append(f"{waiter.thread.name}: {current.what() if current is not None else 'a request'}")
    if stuck:
        logging.getLogger("mindspeed_flow.runtime").warning(
            "mindspeed-flow runtime: at exit, %d waiter thread(s) are still inside a transfer that did not "
            "complete (%s); the process may abort when the interpreter finalizes", len(stuck), "; ".join(stuck))
    return stuck


atexit.register(stop_waiters)


def wait(pending: Pending, policy: WaitPolicy, board: AbortBoard) -> None:
    """Wait for ``pending`` to complete; raise :class:`PeerFailure` if a rank reported a
    failure, the transport failed or the timeout passed."""
    start = time.monotonic()
    while not pending.done.wait(policy.abort_poll_s):
        reported = board.read()
        if reported is not None:
            raise PeerFailure(f"stopped while waiting for {pending.what()}: {reported}")
        if time.monotonic() - start > policy.timeout_s:
            raise PeerFailure(f"no progress for {policy.timeout_s:g} s waiting for {pending.what()}")
    if pending.error is not None:
        time.sleep(0.2)  # a failing peer posts its report before its sockets close
        exc = pending.error
        reported = board.read()
        cause = reported or (f"the transport failed ({type(exc).__name__}: {str(exc).strip()[:200]}); "
                             "did the peer die?")
        raise PeerFailure(f"{pending.what()} failed: {cause}") from exc


class Transport:
    """One rank's sends and receives within a group of ranks, for one step.

    Args:
        ranks: plan rank -> global rank (Megatron's pipeline group ranks).
        group: the process group holding them (``None``: the default group).
        channels: channel -> its own process group (:func:`.fifo.channel_groups`), for a
            backend that matches messages in posting order; a transfer on a channel not
            listed (or with ``None``: every transfer) goes on ``group``.
        policy, board: see :func:`wait`.
        waiters: (sends, receives) :class:`Waiter` threads, kept by the executor.
        max_pending_sends: back-pressure: with this many tensors' sends outstanding, the
            oldest is waited for before another is posted (``None``: unbounded, all are
            waited for at the end of the step).
    """

    def __init__(self, ranks: Sequence[int], group: Any, policy: WaitPolicy, board: AbortBoard,
                 waiters: tuple[Waiter, Waiter], max_pending_sends: int | None = None,
                 channels: Mapping[str, Any] | None = None) -> None:
        self.ranks = list(ranks)
        self.group = group
        self.channels = dict(channels or {})
        self.policy = policy
        self.board = board
        self.send_waiter, self.recv_waiter = waiters
        self.max_pending_sends = max_pending_sends
        self.pending: deque[Pending] = deque()
        self.peak_pending = 0

    def send(self, tensor: torch.Tensor, peer: int, tag: int, what: Callable[[], str],
             channel: str | None = None) -> None:
        """Post ``tensor`` to plan rank ``peer`` on ``channel``'s group without waiting (eager)."""
        data = tensor.detach().contiguous()
        meta = header(data)
        dst = self.ranks[peer]
        while self.max_pending_sends is not None and len(self.pending) >= 2 * self.max_pending_sends:
            wait(self.pending.popleft(), self.policy, self.board)  # a tensor is two messages
        for buffer, t in ((meta, 2 * tag), (data, 2 * tag + 1)):
            work = self._post(dist.isend, buffer, dst, t, what, channel)
            self.pending.append(self.send_waiter.submit(work, (buffer,), what))
        self.peak_pending = max(self.peak_pending, len(self.pending) // 2)

    def recv(self, peer: int, tag: int, device: torch.device, what: Callable[[], str],
             channel: str | None = None) -> torch.Tensor:
        """Block until plan rank ``peer``'s tensor with ``tag`` has arrived on ``channel``'s
        group; return it."""
        src = self.ranks[peer]
        meta = torch.empty(_HEADER, dtype=torch.int64)
        work = self._post(dist.irecv, meta, src, 2 * tag, what, channel)
        wait(self.recv_waiter.submit(work, (), what), self.policy, self.board)
        data = empty_from_header(meta, device)
        work = self._post(dist.irecv, data, src, 2 * tag + 1, what, channel)
        wait(self.recv_waiter.submit(work, (), what), self.policy, self.board)
        return data

    def _post(self, post: Callable, buffer: torch.Tensor, peer: int, tag: int, what: Callable[[], str],
              channel: str | None) -> Any:
        """``isend``/``irecv`` on ``channel``'s group; a connection that is already closed (the
        peer stopped after reporting a failure, or died) fails with the peer's report when
        there is one."""
        try:
            return post(buffer, peer, group=self.channels.get(channel, self.group), tag=tag)
        except RuntimeError as exc:
            reported = self.board.read()
            cause = reported or (f"the transport failed ({type(exc).__name__}: {str(exc).strip()[:200]}); "
                                 "did the peer die?")
            raise PeerFailure(f"{what()} failed: {cause}") from exc

    def retire(self) -> None:
        """Drop completed sends from the head of the queue (their buffers can go)."""
        while self.pending and self.pending[0].done.is_set():
            wait(self.pending.popleft(), self.policy, self.board)

    def drain(self) -> None:
        """Wait for every outstanding send (end of the step)."""
        while self.pending:
            wait(self.pending.popleft(), self.policy, self.board)
