"""Talking to megatron-core: which version is installed, and the shims that let its real
pipeline schedules run on a CPU-only machine over gloo.

Importing this module is cheap: megatron is imported only inside the functions that need it,
so ``import mindspeed_flow.adapters.megatron.core`` works (and costs nothing) on a machine
without megatron-core.

The shims exist for tests and the CPU demo only. megatron-core assumes CUDA in a handful of
places (``torch.cuda.current_device()``, ``device="cuda"`` factories, ``Tensor.cuda()``, the
CUDA RNG tracker); :func:`enable_cpu_shims` redirects exactly those to the CPU so that
Megatron's own code, unedited, can be compared with ours. It refuses to run where CUDA
exists, so it can never change a real training job.
"""

from __future__ import annotations

import importlib.metadata
import re
import sys
import threading
from dataclasses import dataclass, field
from typing import Any, Callable

import torch
from torch.overrides import TorchFunctionMode

from mindspeed_flow.adapters.errors import MegatronCoreVersionError

MIN_MEGATRON_CORE = "0.12"
_DISTRIBUTION = "megatron-core"


def megatron_core_version() -> str:
    """The version of the megatron-core that ``import megatron.core`` gives.

    An already imported ``megatron.core`` is asked first, because a Megatron-LM source copy
    on ``PYTHONPATH`` (how MindSpeed-MM installs it) shadows any wheel's metadata. Otherwise
    the wheel's metadata is read without importing megatron (importing it takes seconds);
    a source copy that is not yet imported is imported as a last resort.
    """
    loaded = sys.modules.get("megatron.core")
    if loaded is not None:
        return _package_info_version()
    try:
        return importlib.metadata.version(_DISTRIBUTION)
    except importlib.metadata.PackageNotFoundError:
        return _package_info_version()


def _package_info_version() -> str:
    try:
        from megatron.core import package_info
    except ImportError as exc:
        raise MegatronCoreVersionError(
            "megatron.core is not importable: install the extra "
            "(pip install 'mindspeed-flow[megatron]') or put a Megatron-LM source copy on "
            f"PYTHONPATH ({exc})"
        ) from exc
    return str(package_info.__version__)


def _release(version: str) -> tuple[int, ...]:
    """Leading numeric release parts: ``"0.12.3rc1"`` -> ``(0, 12, 3)``.

    A hand-rolled parse keeps ``packaging`` out of the plugin's hard requirements; a
    minimum-version check needs nothing more.
    """
    match = re.match(r"\d+(?:\.\d+)*", version.strip())
    if match is None:
        raise ValueError(f"not a version: {version!r}")
    return tuple(int(part) for part in match.group(0).split("."))


def require_megatron_core(min_version: str = MIN_MEGATRON_CORE) -> str:
    """Return the installed megatron-core version, or raise naming it when it is too old.

    Raises :class:`MegatronCoreVersionError` when megatron-core is missing too.
    """
    found = megatron_core_version()
    if _release(found) < _release(min_version):
        raise MegatronCoreVersionError(
            f"megatron-core {found} is installed; mindspeed-flow needs >= {min_version}"
        )
    return found


def cpu_safe_config_overrides(
    virtual_pipeline_model_parallel_size: int | None = None,
) -> dict[str, Any]:
    """``ModelParallelConfig`` / ``TransformerConfig`` fields that keep megatron-core on CPU.

    - ``batch_p2p_comm=False``: the batched path calls ``torch.cuda.synchronize()``.
    - ``overlap_p2p_comm``: must be False for the non-interleaved 1F1B schedule (it refuses
      it), but True for the interleaved one: with PP=2, VPP=2 and batched p2p, Megatron was
      seen to give wrong gradients silently (UPSTREAM.md).
    - ``use_cpu_initialization=True``: weights are created on the CPU directly.
    - ``gradient_accumulation_fusion=False``: that fusion is an APEX CUDA kernel.
    - ``masked_softmax_fusion`` / ``bias_activation_fusion`` / ``bias_dropout_fusion`` /
      ``apply_rope_fusion`` off: their fused kernels are CUDA-only, the unfused paths are the
      reference math anyway.
    """
    interleaved = (virtual_pipeline_model_parallel_size or 1) > 1
    return {
        "batch_p2p_comm": False,
        "overlap_p2p_comm": interleaved,
        "use_cpu_initialization": True,
        "gradient_accumulation_fusion": False,
        "masked_softmax_fusion": False,
        "bias_activation_fusion": False,
        "bias_dropout_fusion": False,
        "apply_rope_fusion": False,
    }


def _cpu_if_cuda(device: Any) -> Any:
    """Map a CUDA device (``"cuda"``, ``"cuda:1"``, ``torch.device("cuda")``, an index) to
    the CPU; anything else (dtypes, tensors, CPU devices, None) passes through unchanged."""
    if isinstance(device, bool):
        return device
    if isinstance(device, int):
        return torch.device("cpu")
    if isinstance(device, str) and device.split(":")[0] == "cuda":
        return torch.device("cpu")
    if isinstance(device, torch.device) and device.type == "cuda":
        return torch.device("cpu")
    return device


class _CudaToCpuMode(TorchFunctionMode):
    """Rewrites every CUDA device a torch function is asked for into the CPU.

    Covers factories (``device=`` keyword), ``Tensor.to(...)`` (device given positionally or
    by keyword) and makes ``Tensor.cuda()`` return the tensor itself.
    """

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = dict(kwargs or {})
        if func is torch.Tensor.cuda:
            return args[0]
        if "device" in kwargs:
            kwargs["device"] = _cpu_if_cuda(kwargs["device"])
        if func is torch.Tensor.to:
            args = (args[0], *(_cpu_if_cuda(arg) for arg in args[1:]))
        return func(*args, **kwargs)


def _cpu_current_device() -> torch.device:
    """Stand-in for ``torch.cuda.current_device()``: Megatron passes its result as the
    ``device=`` of buffers and p2p receive tensors."""
    return torch.device("cpu")


def _cpu_synchronize(device: Any = None) -> None:
    """Stand-in for ``torch.cuda.synchronize()``: Megatron's p2p calls it after exchanging
    tensor shapes (``variable_seq_lengths``); CPU work is synchronous already."""


def _swap_cuda_function(name: str, replacement: Callable) -> Callable[[], None]:
    original = getattr(torch.cuda, name)
    setattr(torch.cuda, name, replacement)

    def undo() -> None:
        setattr(torch.cuda, name, original)

    return undo


def _patch_current_device() -> Callable[[], None]:
    return _swap_cuda_function("current_device", _cpu_current_device)


def _patch_synchronize() -> Callable[[], None]:
    return _swap_cuda_function("synchronize", _cpu_synchronize)


def _enter_cuda_to_cpu_mode() -> Callable[[], None]:
    mode = _CudaToCpuMode()
    mode.__enter__()
    thread = threading.get_ident()

    def undo() -> None:
        # TorchFunctionMode.__exit__ pops whatever mode is on top of this thread's stack:
        # check it is ours rather than silently popping someone else's.
        if threading.get_ident() != thread:
            raise RuntimeError("CpuShims.remove() must run on the thread that enabled them")
        stack = torch.overrides._get_current_function_mode_stack()
        if not stack or stack[-1] is not mode:
            raise RuntimeError(
                "CpuShims.remove(): another torch function mode was entered after the CPU "
                "shims and is still active; exit it first"
            )
        mode.__exit__(None, None, None)

    return undo


def _install_inference_rng_tracker() -> Callable[[], None]:
    """Swap Megatron's CUDA RNG tracker for its inference tracker, whose ``fork()`` is a
    no-op context (the training tracker saves and restores CUDA RNG states).

    Only correct with dropout 0 (hidden and attention): a random op inside a fork would
    draw from the global CPU generator instead of a tracked per-rank state, so its result
    would depend on how many draws came before, i.e. on the schedule.
    ``initialize_rng_tracker`` does nothing once a tracker exists, so the module globals
    are reset here and put back by the returned undo.
    """
    from megatron.core.tensor_parallel import random as mp_random

    saved = (mp_random._CUDA_RNG_STATE_TRACKER, mp_random._CUDA_RNG_STATE_TRACKER_INITIALIZED)
    mp_random._CUDA_RNG_STATE_TRACKER_INITIALIZED = False
    mp_random.initialize_rng_tracker(inference_rng_tracker=True)

    def undo() -> None:
        mp_random._CUDA_RNG_STATE_TRACKER, mp_random._CUDA_RNG_STATE_TRACKER_INITIALIZED = saved

    return undo


@dataclass
class CpuShims:
    """Handle to the applied CPU shims. :meth:`remove` undoes them, last applied first."""

    _undo: list[Callable[[], None]] = field(default_factory=list, repr=False)

    @property
    def active(self) -> bool:
        """Whether these shims are the ones currently applied."""
        return _ACTIVE is self

    def remove(self) -> None:
        """Leave the device mode, restore ``torch.cuda.current_device`` and put Megatron's
        RNG tracker back. Calling it again does nothing."""
        global _ACTIVE
        with _LOCK:
            self._undo_all()
            if _ACTIVE is self:
                _ACTIVE = None

    def _undo_all(self) -> None:
        while self._undo:
            self._undo[-1]()
            self._undo.pop()


_ACTIVE: CpuShims | None = None
_LOCK = threading.Lock()

# Megatron is imported by the first shim, before any torch behaviour changes.
_SHIMS = (_install_inference_rng_tracker, _patch_current_device, _patch_synchronize, _enter_cuda_to_cpu_mode)


def enable_cpu_shims() -> CpuShims:
    """Apply every CPU shim megatron-core needs (see UPSTREAM.md) and return their handle.

    - ``torch.cuda.current_device()`` returns the CPU device, ``torch.cuda.synchronize()``
      does nothing;
    - a torch function mode maps ``device="cuda"`` / ``torch.device("cuda")`` to the CPU for
      tensor factories and ``Tensor.to``, and makes ``Tensor.cuda()`` a no-op;
    - Megatron's RNG tracker becomes its inference tracker: correct **only with dropout 0**.

    Pair it with :func:`cpu_safe_config_overrides` in the model config. Idempotent: a second
    call returns the handle already active. The device mode is a torch function mode, which
    torch keeps per thread: it covers the calling thread, so call this (and ``remove()``)
    from the thread that runs the model.

    Raises ``RuntimeError`` where ``torch.cuda.is_available()``: the shims are for CPU-only
    machines and must never change a job on a device machine.
    """
    global _ACTIVE
    if torch.cuda.is_available():
        raise RuntimeError(
            "enable_cpu_shims() refuses to run: CUDA is available here, and the CPU shims "
            "are never applied on a device machine"
        )
    with _LOCK:
        if _ACTIVE is not None:
            return _ACTIVE
        require_megatron_core()
        shims = CpuShims()
        try:
            for apply in _SHIMS:
                shims._undo.append(apply())
        except BaseException:
            shims._undo_all()
            raise
        _ACTIVE = shims
        return shims
