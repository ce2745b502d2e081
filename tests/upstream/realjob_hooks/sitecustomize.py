"""Shims and observers of the real-job harness, loaded by ``site`` in every process of a run
(this folder is first on the run's ``PYTHONPATH``; ``pretrain_vlm.py`` itself is unmodified).

Inert unless ``REALJOB_OBSERVE`` names a folder.  Each shim acts on one upstream name, right
after the module that defines it is imported (a post-import hook), and is announced on stderr
as ``[realjob] shim: NAME (why)``; the harness collects those lines into the run's report.

Shims (CPU / torch 2.13 / numpy 2 only; none changes what the job computes beyond a bf16 rounding):

- bf16 matrix products on CPU (``aten.mm`` / ``addmm`` / ``bmm`` / ``baddbmm``, a torch dispatch
  mode on the main thread, where the job computes): the bf16 operands are widened to fp32, multiplied
  there and the product rounded to bf16.  torch's own CPU bf16 kernel does the same arithmetic
  (fp32 products and sums, one rounding at the end) but, on a CPU without bf16 instructions such
  as this one, 4-15x slower (the tiny model's 151936-word output layer alone cost ~5 s per pack);
  the sums run in another order, so a product can differ from torch's by one bf16 rounding.
  Every run of the harness has it, upstream's and the plugin's alike.

- ``megatron.core.datasets.utils.compile_helpers``: no-op (MindSpeed's ``_compile_dependencies``
  calls it; it runs ``make`` inside the upstream tree; this job uses no Megatron dataset).
- ``torch.Tensor.type()`` as seen from ``megatron/core/optimizer/*``: ``torch.cuda.<X>Tensor``
  for CPU tensors (Megatron's optimizer wrappers accept only CUDA type strings; on Ascend
  ``transfer_to_npu`` covers this).
- ``torch_npu.profiler`` / ``torch_npu.profiler.profiler.analyse`` and ``torch.npu.config``:
  names MindSpeed-MM's ``Profiler`` and ``pretrain`` touch with profiling off.
- ``megatron.core.dist_checkpointing.strategies.filesystem_async._write_item``: passes
  ``serialization_format=TORCH_SAVE`` (torch 2.13's ``_write_item`` requires it; core_v0.12.1
  does not pass it).  ``numpy.product`` = ``numpy.prod`` (removed in numpy 2).
- ``mindspeed_mm.models.transformers.base_model``'s ``DeviceMesh`` / ``init_device_mesh``: FSDP2's
  mesh on ``"cpu"`` where the module hard-codes ``"npu"`` (``pretrain_transformers.py`` with FSDP2).
- torch's rendezvous stores (torchrun's agent store, ``env://`` / ``tcp://``) listen on their
  loopback host only (``mindspeed_flow.loopback.keep_stores_on_loopback``, as the plugin's
  activation does; torch binds them on every interface), so upstream runs without the plugin
  listen on 127.0.0.1 too.

Fault injection (the fault tests only): ``REALJOB_DIE_AT=RANK:CALL:CODE`` ends rank ``RANK``
with ``os._exit(CODE)`` (no clean-up of its own, as a killed process) at its ``CALL``-th
training forward of ``VLMModel``, after saying so on stderr.

Compute emulation and module times (the layout benchmark only,
``scripts/bench_realjob_layouts.py``): ``REALJOB_EMULATE=VIT_S:LLM_S`` makes each training
forward of the ViT (``image_encoder``, on whichever rank holds it) sleep ``VIT_S`` seconds and
each forward of an LLM stage (``text_decoder``) ``LLM_S`` seconds per local layer, and their
backward twice that (a hook on the output's gradient), next to the real math: device time that
ranks do not share, as separate devices would.  ``REALJOB_MODULE_TIMES=1`` records every
training forward's wall time per module (``module_time`` records: sleep included).

Observers (write JSON lines to ``$REALJOB_OBSERVE/observe_rank{RANK}.jsonl``):

- ``VLMModel`` forward (a forward pre-hook with kwargs on each instance, registered right after
  ``__init__``, so it sees the batch exactly as the model gets it, whatever patches wrap
  ``forward``): iteration, train/eval, rank coordinates, row/segment lengths, the sample tags
  decoded from ``input_ids`` per row or per ``cu_seqlens`` segment, real tokens, label tokens.
- every core-attention module of the LLM (instance forward pre-hooks) and
  ``torch_npu.npu_fusion_attention``: layout, shapes, mask kind and whether any query attends
  to a key of another sample of the batch.
- ``TransformersModel`` forward (``pretrain_transformers.py``'s model): its batches, as ``VLMModel``'s.
- ``mindspeed_mm.training.train_step``: the step's loss dict (full precision) and grad norm.
"""

from __future__ import annotations

import importlib.abc
import importlib.util
import json
import os
import sys
import threading

OBSERVE = os.environ.get("REALJOB_OBSERVE")
_LOCK = threading.Lock()
_STATE: dict = {"segments": None, "iteration": None, "training": True}


def _say(line: str) -> None:
    sys.stderr.write(f"[realjob] {line}\n")


def _rank() -> int:
    return int(os.environ.get("RANK", "0"))


def _emit(kind: str, **fields) -> None:
    fields["kind"] = kind
    fields["rank"] = _rank()
    with _LOCK, open(os.path.join(OBSERVE, f"observe_rank{_rank()}.jsonl"), "a") as out:
        out.write(json.dumps(fields) + "\n")


class _PostImport(importlib.abc.MetaPathFinder):
    """Runs callbacks right after the named modules are executed."""

    def __init__(self, hooks: dict):
        self.hooks = hooks
        self._busy: set = set()

    def find_spec(self, name, path=None, target=None):
        if name not in self.hooks or name in self._busy:
            return None
        self._busy.add(name)
        try:
            spec = importlib.util.find_spec(name)
        finally:
            self._busy.discard(name)
        if spec is None or spec.loader is None:
            return spec
        loader, callbacks = spec.loader, self.hooks[name]

        class _Loader(importlib.abc.Loader):
            def create_module(self, spec):
                return loader.create_module(spec)

            def exec_module(self, module):
                loader.exec_module(module)
                for callback in callbacks:
                    callback(module)

        spec.loader = _Loader()
        return spec


# ----------------------------------------------------------------------------------- shims

def _shim_compile_helpers(module) -> None:
    module.compile_helpers = lambda: None
    _say("shim: megatron.core.datasets.utils.compile_helpers -> no-op (runs `make` in the upstream tree)")


def _shim_tensor_type() -> None:
    import torch

    inner = torch.Tensor.type
    optimizer_dir = os.sep + os.path.join("megatron", "core", "optimizer") + os.sep

    def from_optimizer() -> bool:
        # the caller, seen through at most two wrappers (MindSpeed wraps Tensor.type too)
        frame = sys._getframe(2)
        for _ in range(3):
            if frame is None:
                return False
            if optimizer_dir in frame.f_code.co_filename:
                return True
            frame = frame.f_back
        return False

    def type_(self, *args, **kwargs):
        result = inner(self, *args, **kwargs)
        if not args and not kwargs and isinstance(result, str) and result.startswith("torch.") \
                and ".cuda." not in result and from_optimizer():
            return "torch.cuda." + result[len("torch."):]
        return result

    torch.Tensor.type = type_
    _say("shim: torch.Tensor.type() -> 'torch.cuda.<X>Tensor' for callers in megatron/core/optimizer "
         "(CPU tensors; transfer_to_npu's job on Ascend)")


def _shim_bf16_gemm() -> None:
    import torch
    from torch.utils._python_dispatch import TorchDispatchMode

    aten = torch.ops.aten
    gemms = {aten.mm.default, aten.addmm.default, aten.bmm.default, aten.baddbmm.default}

    def bf16_on_cpu(value) -> bool:
        return isinstance(value, torch.Tensor) and value.dtype == torch.bfloat16 and value.device.type == "cpu"

    class Bf16GemmInFp32(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            kwargs = kwargs or {}
            if func in gemms:
                tensors = [a for a in args if isinstance(a, torch.Tensor)]
                if tensors and all(bf16_on_cpu(t) for t in tensors):
                    wide = [a.float() if isinstance(a, torch.Tensor) else a for a in args]
                    return func(*wide, **kwargs).to(torch.bfloat16)
            return func(*args, **kwargs)

    Bf16GemmInFp32().__enter__()  # for the life of the process (thread-local: the main thread's)
    _say("shim: bf16 matrix products on CPU computed in fp32, rounded to bf16 (torch's CPU bf16 GEMM: the "
         "same arithmetic, 4-15x slower without bf16 instructions)")


def _shim_fsdp2_mesh(module) -> None:
    """``base_model``'s FSDP2 device mesh: the device type it hard-codes (``"npu"``) -> ``"cpu"``."""
    from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
    from torch_npu._device import to_cpu_device

    class CpuDeviceMesh:
        """``DeviceMesh(device_type, ...)`` / ``DeviceMesh.from_group(group, device_type, ...)`` on the CPU."""

        def __new__(cls, device_type, *args, **kwargs):
            return DeviceMesh(to_cpu_device(device_type), *args, **kwargs)

        @staticmethod
        def from_group(group, device_type, *args, **kwargs):
            return DeviceMesh.from_group(group, to_cpu_device(device_type), *args, **kwargs)

    def init_cpu_device_mesh(device_type, *args, **kwargs):
        return init_device_mesh(to_cpu_device(device_type), *args, **kwargs)

    module.DeviceMesh = CpuDeviceMesh
    module.init_device_mesh = init_cpu_device_mesh
    _say("shim: mindspeed_mm.models.transformers.base_model DeviceMesh / init_device_mesh: device 'npu' -> 'cpu' "
         "(FSDP2's mesh device is hard-coded; on GPUs it would be 'cuda')")


def _shim_torch_npu(module) -> None:
    import types

    import torch

    profiler = types.ModuleType("torch_npu.profiler")
    profiler.__doc__ = "realjob shim: torch_npu.profiler (profiling is off in the real job)"
    inner = types.ModuleType("torch_npu.profiler.profiler")

    def analyse(*args, **kwargs):
        raise RuntimeError("torch_npu.profiler.profiler.analyse: realjob shim, no NPU profiler here")

    inner.analyse = analyse
    profiler.profiler = inner

    class _Inactive:
        """What ``torch_npu.profiler.profile(...)`` builds; MindSpeed-MM only starts it when
        profiling is enabled, which the real job never is."""

        def __init__(self, *args, **kwargs):
            pass

        def __getattr__(self, name):
            raise RuntimeError(f"torch_npu.profiler.profile().{name}: realjob shim, profiling is off")

    profiler.ProfilerLevel = types.SimpleNamespace(Level0="Level0", Level1="Level1", Level2="Level2")
    profiler.AiCMetrics = types.SimpleNamespace(PipeUtilization="PipeUtilization",
                                                ArithmeticUtilization="ArithmeticUtilization")
    profiler.ProfilerActivity = types.SimpleNamespace(CPU="CPU", NPU="NPU")
    profiler._ExperimentalConfig = lambda *args, **kwargs: None
    profiler.schedule = lambda *args, **kwargs: None
    profiler.tensorboard_trace_handler = lambda *args, **kwargs: None
    profiler.profile = _Inactive
    sys.modules["torch_npu.profiler"] = profiler
    sys.modules["torch_npu.profiler.profiler"] = inner
    module.profiler = profiler
    npu = getattr(torch, "npu", None) or module.npu
    if not hasattr(npu, "config"):
        npu.config = types.SimpleNamespace(allow_internal_format=False)
    _say("shim: torch_npu.profiler (ProfilerLevel, AiCMetrics, ProfilerActivity, _ExperimentalConfig, schedule, "
         "tensorboard_trace_handler, profile: inert), torch_npu.profiler.profiler.analyse (raises), "
         "torch.npu.config (names MindSpeed-MM's Profiler / pretrain touch with profiling off)")
    if OBSERVE:
        _observe_fusion_attention(module)


def _shim_write_item(module) -> None:
    from torch.distributed.checkpoint.filesystem import SerializationFormat

    import functools

    inner = module._write_item

    @functools.wraps(inner)
    def _write_item(*args, **kwargs):
        if len(args) < 6 and "serialization_format" not in kwargs:
            kwargs["serialization_format"] = SerializationFormat.TORCH_SAVE
        return inner(*args, **kwargs)

    module._write_item = _write_item
    _say("shim: megatron.core.dist_checkpointing.strategies.filesystem_async._write_item -> "
         "serialization_format=TORCH_SAVE (torch 2.13 requires it, core_v0.12.1 omits it)")


def _shim_numpy(module) -> None:
    if not hasattr(module, "product"):
        module.product = module.prod
        _say("shim: numpy.product = numpy.prod (removed in numpy 2; core_v0.12.1 dist_checkpointing calls it)")


# -------------------------------------------------------------------------------- observers

_DECODER = None


def _decode(ids) -> str:
    global _DECODER
    if _DECODER is None:
        from tokenizers import Tokenizer

        _DECODER = Tokenizer.from_file(os.environ["REALJOB_TOKENIZER"])
    return _DECODER.decode([int(i) for i in ids], skip_special_tokens=False)


def _tags(text: str) -> list[int]:
    import re

    return [int(m) for m in re.findall(r"sample-(\d{4})", text)]


def _coords() -> dict:
    try:
        from megatron.core import parallel_state as ps

        return {"pp": ps.get_pipeline_model_parallel_rank(), "tp": ps.get_tensor_model_parallel_rank(),
                "dp": ps.get_data_parallel_rank(), "vpp": ps.get_virtual_pipeline_model_parallel_rank()}
    except Exception:  # noqa: BLE001  (before parallel state exists)
        return {}


def _iteration():
    try:
        from megatron.training import get_args

        return getattr(get_args(), "curr_iteration", None)
    except Exception:  # noqa: BLE001
        return None


def _maybe_die() -> None:
    """``REALJOB_DIE_AT`` (see the module docstring): counts this rank's training forwards."""
    rank, call, code = (int(x) for x in os.environ["REALJOB_DIE_AT"].split(":"))
    if _rank() != rank:
        return
    _STATE["forwards"] = _STATE.get("forwards", 0) + 1
    if _STATE["forwards"] == call:
        _say(f"fault injection: rank {rank} dies at training forward {call} (os._exit({code}))")
        sys.stderr.flush()
        os._exit(code)


def _vlm_pre_hook(module, args, kwargs):
    import torch

    if module.training and os.environ.get("REALJOB_DIE_AT"):
        _maybe_die()
    _emulate(module)

    ids = kwargs.get("input_ids", args[0] if args else None)
    if ids is None:
        return None
    ids = ids.detach().cpu()
    cu = kwargs.get("cu_seqlens")
    mask = kwargs.get("attention_mask")
    labels = kwargs.get("labels")
    rows = []
    segments = []  # per row: list of (start, end) of each sample
    for row in range(ids.shape[0]):
        if cu is not None and ids.shape[0] == 1:
            bounds = [int(x) for x in torch.as_tensor(cu).flatten().tolist()]
            spans = list(zip(bounds[:-1], bounds[1:]))
        else:
            length = int(mask[row].sum()) if isinstance(mask, torch.Tensor) and mask.dim() == 2 else ids.shape[1]
            spans = [(0, length)]
        segments.append(spans)
        rows.append([{"start": a, "end": b, "tags": _tags(_decode(ids[row, a:b]))} for a, b in spans])
    real = sum(b - a for spans in segments for a, b in spans)
    label_tokens = int((labels[..., 1:] != -100).sum()) if isinstance(labels, torch.Tensor) else None
    _STATE["segments"] = segments
    _emit("batch", iteration=_iteration(), training=bool(module.training), **_coords(), shape=list(ids.shape),
          cu_seqlens=cu is not None, rows=rows, real_tokens=real, label_tokens=label_tokens,
          pixel_rows=int(kwargs["pixel_values"].shape[0]) if isinstance(kwargs.get("pixel_values"), torch.Tensor)
          else None)
    return None


def _segment_ids(length: int, spans) -> list[int]:
    seg = [-1] * length
    for k, (a, b) in enumerate(spans):
        for i in range(a, min(b, length)):
            seg[i] = k
    return seg


def _mask_crosses(mask, spans) -> bool | None:
    """Whether a dense mask (True = masked, Megatron's convention) lets a query of one sample
    see a key of another; ``None`` when the mask's size does not match the batch."""
    import torch

    m = mask.detach()
    while m.dim() > 2:
        m = m[0]
    s = m.shape[-1]
    if m.shape[-2] != s or not spans or spans[-1][1] > s:
        return None
    seg = torch.tensor(_segment_ids(s, spans))
    allowed = ~m.bool()
    other = seg[:, None] != seg[None, :]
    valid = (seg[:, None] >= 0) & (seg[None, :] >= 0)
    return bool((allowed & other & valid).any())


def _attention_pre_hook(module, args, kwargs):
    import torch

    names = ("query", "key", "value", "attention_mask", "attn_mask_type", "attention_bias", "packed_seq_params")
    bound = dict(zip(names, args))
    bound.update({k: v for k, v in kwargs.items() if k in names})
    query, mask, packed = bound.get("query"), bound.get("attention_mask"), bound.get("packed_seq_params")
    segments = _STATE["segments"] or []
    multi = [spans for spans in segments if len(spans) > 1]
    record = {"module": type(module).__name__, "iteration": _iteration(), "training": bool(module.training),
              **_coords(), "query": list(query.shape) if isinstance(query, torch.Tensor) else None,
              "mask": None if mask is None else list(mask.shape),
              "mask_type": str(bound.get("attn_mask_type")), "packed": packed is not None,
              "samples_in_row": [len(spans) for spans in segments]}
    crosses = False
    if packed is not None:
        cu = getattr(packed, "cu_seqlens_q", None)
        bounds = set(int(x) for x in torch.as_tensor(cu).flatten().tolist()) if cu is not None else set()
        record["cu_seqlens_q"] = sorted(bounds)
        for spans in multi:
            if not {a for a, _ in spans} <= bounds:
                crosses = True
    elif multi:
        if isinstance(mask, torch.Tensor):
            verdicts = [_mask_crosses(mask, spans) for spans in multi]
            crosses = any(v is None or v for v in verdicts)
        else:
            crosses = True  # several samples in a row, no mask and no segments: one causal span
    record["crosses"] = crosses
    _emit("attention", **record)
    return None


def _observe_fusion_attention(module) -> None:
    import functools

    inner = module.npu_fusion_attention

    @functools.wraps(inner)
    def npu_fusion_attention(*args, **kwargs):
        q = args[0] if args else kwargs.get("query")
        mask = kwargs.get("atten_mask")
        seq = kwargs.get("actual_seq_qlen")
        _emit("fusion_attention", iteration=_iteration(), layout=kwargs.get("input_layout", args[4] if len(args) > 4
                                                                           else None),
              query=list(q.shape), mask=None if mask is None else list(mask.shape),
              sparse_mode=kwargs.get("sparse_mode"),
              actual_seq_qlen=None if seq is None else [int(x) for x in seq])
        return inner(*args, **kwargs)

    module.npu_fusion_attention = npu_fusion_attention
    _say("observer: torch_npu.npu_fusion_attention (calls recorded)")


def _after_init(cls, watch) -> None:
    """``watch(instance)`` right after each ``cls.__init__``."""
    import functools

    init = cls.__init__

    @functools.wraps(init)
    def __init__(self, *args, **kwargs):
        init(self, *args, **kwargs)
        watch(self)

    cls.__init__ = __init__


def _watch_vlm(vlm) -> None:
    vlm.register_forward_pre_hook(_vlm_pre_hook, with_kwargs=True)
    _emulate(vlm)
    for sub in vlm.modules():
        if "DotProductAttention" in type(sub).__name__ and "text_decoder" in _path_of(vlm, sub):
            sub.register_forward_pre_hook(_attention_pre_hook, with_kwargs=True)


def _observe_vlm(module) -> None:
    _after_init(module.VLMModel, _watch_vlm)
    _say("observer: VLMModel batches and the LLM's core-attention calls (instance forward pre-hooks)")


def _observe_transformers_model(module) -> None:
    """``pretrain_transformers.py``'s model: its batches, as ``VLMModel``'s (no Megatron core attention)."""
    _after_init(module.TransformersModel, lambda model: model.register_forward_pre_hook(_vlm_pre_hook,
                                                                                           with_kwargs=True))
    _say("observer: TransformersModel batches (instance forward pre-hook)")


def _timed_module(module, name: str, sleep_s: float) -> None:
    """``module``'s training forwards sleep ``sleep_s`` (and their backward twice that) under
    ``REALJOB_EMULATE``; under ``REALJOB_MODULE_TIMES`` each one's wall time is recorded."""
    import time

    if getattr(module, "_realjob_timed", False):
        return
    module._realjob_timed = True
    record = os.environ.get("REALJOB_MODULE_TIMES") == "1"

    def before(mod, args, kwargs):
        if mod.training:
            mod._realjob_started = time.perf_counter()
            time.sleep(sleep_s)
        return None

    def after(mod, args, kwargs, output):
        if not mod.training:
            return None
        if record:
            _emit("module_time", module=name, forward_s=time.perf_counter() - mod._realjob_started,
                  iteration=_iteration())
        first = output[0] if isinstance(output, (tuple, list)) else output
        if sleep_s and getattr(first, "requires_grad", False):
            first.register_hook(lambda grad: (time.sleep(2 * sleep_s), grad)[1])
        return None

    module.register_forward_pre_hook(before, with_kwargs=True)
    module.register_forward_hook(after, with_kwargs=True)


def _emulate(vlm) -> None:
    """The ``REALJOB_EMULATE`` / ``REALJOB_MODULE_TIMES`` hooks on a ``VLMModel``'s parts, once
    each: after ``__init__`` and again at each forward (a part a patch adds after the
    observer's ``__init__``, as the transposed ViT replica, gets them there)."""
    if not (os.environ.get("REALJOB_EMULATE") or os.environ.get("REALJOB_MODULE_TIMES")):
        return
    vit_s, llm_s = (float(x) for x in os.environ.get("REALJOB_EMULATE", "0:0").split(":"))
    encoder = getattr(vlm, "image_encoder", None)
    if encoder is not None:
        _timed_module(encoder, "vit", vit_s)
    decoder = getattr(vlm, "text_decoder", None)
    if decoder is not None:
        layers = len(getattr(getattr(decoder, "decoder", None), "layers", ())) or 1
        _timed_module(decoder, "llm", llm_s * layers)


def _path_of(root, target) -> str:
    for name, sub in root.named_modules():
        if sub is target:
            return name
    return ""


def _observe_train_step(module) -> None:
    import functools

    inner = module.train_step

    @functools.wraps(inner)  # the plugin checks the signature it patches
    def train_step(*args, **kwargs):
        result = inner(*args, **kwargs)
        loss_dict, skipped, grad_norm = result[0], result[1], result[2]
        losses = {}
        for key, value in (loss_dict or {}).items():
            try:
                losses[key] = float(value[0] / value[1]) if isinstance(value, (tuple, list)) else float(value)
            except Exception:  # noqa: BLE001
                losses[key] = repr(value)
        _emit("step", iteration=(_iteration() or 0) + 1, **_coords(), losses=losses, skipped=int(skipped or 0),
              grad_norm=None if grad_norm is None else float(grad_norm))
        return result

    module.train_step = train_step
    _say("observer: mindspeed_mm.training.train_step (losses in full precision)")


if OBSERVE:
    os.makedirs(OBSERVE, exist_ok=True)
    _HOOKS = {
        "megatron.core.datasets.utils": [_shim_compile_helpers],
        "torch_npu": [_shim_torch_npu],
        "megatron.core.dist_checkpointing.strategies.filesystem_async": [_shim_write_item],
        "numpy": [_shim_numpy],
        "mindspeed_mm.models.vlm_model": [_observe_vlm],
        "mindspeed_mm.models.transformers_model": [_observe_transformers_model],
        "mindspeed_mm.models.transformers.base_model": [_shim_fsdp2_mesh],
        "mindspeed_mm.training": [_observe_train_step],
        "torch": [lambda module: _shim_tensor_type(), lambda module: _shim_bf16_gemm()],
    }
    sys.meta_path.insert(0, _PostImport(_HOOKS))
    from mindspeed_flow.loopback import keep_stores_on_loopback

    keep_stores_on_loopback()
    _say("shim: torch rendezvous stores on 127.0.0.1 (torchrun's agent store, env:// / tcp://: torch binds "
         "them on every interface; mindspeed_flow.loopback.keep_stores_on_loopback)")
    for _name in [n for n in _HOOKS if n in sys.modules]:  # already imported (never, normally)
        for _callback in _HOOKS[_name]:
            _callback(sys.modules[_name])


def _report_standins() -> None:
    """At exit: what this process had stood in (torch_npu / torchair / torchvision) and called."""
    report = {}
    if "torch_npu" in sys.modules:
        try:
            from torch_npu import _record

            report["torch_npu"] = _record.summary()
        except Exception:  # noqa: BLE001
            pass
    tv = sys.modules.get("torchvision")
    if tv is not None:
        report["torchvision"] = {"standin": bool(getattr(tv, "STANDIN", False)),
                                 "modules": list(getattr(tv, "STOOD_IN", []))}
    if report:
        _emit("standins", **report)


if OBSERVE:
    import atexit

    atexit.register(_report_standins)
