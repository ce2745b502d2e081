"""The stand-in's device: every ``cuda`` / ``npu`` / integer device is the CPU.

On Ascend, ``torch_npu.contrib.transfer_to_npu`` redirects ``torch.cuda.*`` and
``device="cuda"`` to the NPU.  Here the same redirection ends on the CPU: a torch function
mode rewrites ``device=`` arguments and ``Tensor.to/cuda/npu`` targets, and the
``torch.cuda`` / ``torch.npu`` module functions that Megatron and MindSpeed call (device
queries, RNG, streams, memory statistics) get CPU meanings.
"""

from __future__ import annotations

import contextlib
from typing import Any, Callable

import torch
from torch.overrides import TorchFunctionMode

from ._record import declare

ACCELERATOR_TYPES = ("cuda", "npu", "privateuseone")


def to_cpu_device(device: Any) -> Any:
    """A CUDA / NPU device (name, ``torch.device`` or bare index) -> ``"cpu"``; else unchanged."""
    if isinstance(device, bool):
        return device
    if isinstance(device, int):
        return "cpu"
    if isinstance(device, str) and device.split(":")[0] in ACCELERATOR_TYPES:
        return "cpu"
    if isinstance(device, torch.device) and device.type in ACCELERATOR_TYPES:
        return "cpu"
    return device


class AcceleratorToCpuMode(TorchFunctionMode):
    """Rewrites the device of factories and of ``Tensor.to`` / ``.cuda()`` / ``.npu()`` to CPU."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = dict(kwargs or {})
        if "device" in kwargs:
            kwargs["device"] = to_cpu_device(kwargs["device"])
        name = getattr(func, "__name__", "")
        if name in ("cuda", "npu"):  # Tensor.cuda(device=None, non_blocking=False)
            return args[0]
        if name == "to" and len(args) > 1:
            args = (args[0], to_cpu_device(args[1]), *args[2:])
        return func(*args, **kwargs)


class _NoOpStream:
    """A stream that runs everything at once (CPU work is synchronous)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        pass

    def wait_stream(self, other: Any) -> None:
        pass

    def wait_event(self, event: Any) -> None:
        pass

    def synchronize(self) -> None:
        pass

    def record_event(self, event: Any = None) -> Any:
        return event if event is not None else _NoOpEvent()


class _NoOpEvent:
    def __init__(self, *args: Any, **kwargs: Any) -> None:
        pass

    def record(self, stream: Any = None) -> None:
        pass

    def wait(self, stream: Any = None) -> None:
        pass

    def synchronize(self) -> None:
        pass

    def query(self) -> bool:
        return True

    def elapsed_time(self, other: Any) -> float:
        return 0.0


def _lazy_call(fn: Callable[[], Any], **kwargs: Any) -> None:
    """CUDA defers RNG work until the device is initialised; the CPU is always ready."""
    fn()


def _returning(value: Any) -> Callable[..., Any]:
    """A fresh function returning ``value``: every name gets its own function object
    (dynamo's trace rules refuse one object registered under two torch names)."""

    def constant(*args: Any, **kwargs: Any) -> Any:
        return value

    return constant


def _calling(fn: Callable[..., Any], keep: int) -> Callable[..., Any]:
    """A fresh function passing the first ``keep`` arguments to ``fn`` (device args dropped)."""

    def call(*args: Any, **kwargs: Any) -> Any:
        return fn(*args[:keep])

    return call


CPU_MEANINGS: dict[str, Any] = {
    "is_available": _returning(True),
    "is_initialized": _returning(True),
    "device_count": _returning(1),
    "current_device": _returning(0),
    "set_device": _returning(None),
    "synchronize": _returning(None),
    "empty_cache": _returning(None),
    "get_device_name": _returning("cpu (torch_npu stand-in)"),
    "get_device_capability": _returning((0, 0)),
    "memory_allocated": _returning(0),
    "max_memory_allocated": _returning(0),
    "memory_reserved": _returning(0),
    "max_memory_reserved": _returning(0),
    "reset_peak_memory_stats": _returning(None),
    "reset_max_memory_allocated": _returning(None),
    "memory_stats": _returning({}),
    # The CPU generator itself: torch.manual_seed calls torch.cuda.manual_seed_all.
    "manual_seed": _calling(torch.default_generator.manual_seed, 1),
    "manual_seed_all": _calling(torch.default_generator.manual_seed, 1),
    "seed": _calling(torch.default_generator.seed, 0),
    "initial_seed": _calling(torch.default_generator.initial_seed, 0),
    "get_rng_state": _calling(torch.get_rng_state, 0),
    "set_rng_state": _calling(torch.set_rng_state, 1),
    "default_generators": (torch.default_generator,),
    "_lazy_call": _lazy_call,
    "_is_in_bad_fork": _returning(False),
    "Stream": _NoOpStream,
    "Event": _NoOpEvent,
    "current_stream": _calling(_NoOpStream, 0),
    "default_stream": _calling(_NoOpStream, 0),
    "stream": _calling(contextlib.nullcontext, 0),
    "device": _calling(contextlib.nullcontext, 0),
    # FSDP2's activation checkpointing asks the device module which autocast dtypes it has.
    "get_amp_supported_dtype": _returning([torch.float16, torch.bfloat16, torch.float32]),
}
declare(*(f"torch.cuda.{name} (-> cpu)" for name in CPU_MEANINGS))


RNG_NAMES = ("manual_seed", "manual_seed_all", "seed", "initial_seed", "get_rng_state", "set_rng_state")


def redirect_module(module: Any, names: tuple[str, ...] = tuple(CPU_MEANINGS)) -> None:
    """Give ``module`` (``torch.cuda``, ``torch.cuda.random``, ``torch_npu.npu``) the CPU
    meanings of ``names``, each as its own function object."""
    for name in names:
        value = CPU_MEANINGS[name]
        if callable(value) and not isinstance(value, type):
            value = _calling(value, 8)
        setattr(module, name, value)


_MODE: AcceleratorToCpuMode | None = None


def enter_cpu_mode() -> None:
    """Enter the device-rewriting mode for the rest of the process (once)."""
    global _MODE
    if _MODE is None:
        _MODE = AcceleratorToCpuMode()
        _MODE.__enter__()
