"""Profile points for the allocator, measured on megatron-core's own transformer layers.

A block of ``layers`` megatron-core transformer layers (the local GPT layer spec: SwiGLU
MLP, GQA, Megatron's tensor-parallel linears) runs forward and backward on random
hidden states of ``[seq, micro_batch, hidden]``; the median wall times become a
:class:`~mindspeed_flow.allocator.ProfilePoint`.  TP > 1 runs in ``tp`` spawned processes
joined over gloo on 127.0.0.1, with Megatron's parallel state set up for that TP size, so
the measured time includes Megatron's real TP all-reduces.  On the CPU the CUDA
assumptions are bridged by :func:`~.megatron_core.enable_cpu_shims`; on a CUDA GPU or an
Ascend NPU (:mod:`..devices.profile`, chosen at run time) the block, its input and the GEMM
peak live on the rank's device, TP runs over nccl / hccl and times come from device
events, with no shims.  Only the CPU path has been run.
"""

from __future__ import annotations

import json
import os
import socket
import statistics
import tempfile
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from mindspeed_flow.allocator.profile import ProfilePoint
from mindspeed_flow.allocator.specs import ModuleSpec

from ..devices.profile import ProfileDevice, select_device

LOOPBACK = "127.0.0.1"


@dataclass(frozen=True)
class BlockShape:
    """What to measure: a module's shape, a TP size, a micro batch and a sequence length."""

    module: str  # "encoder" or "backbone"
    layers: int
    hidden: int
    heads: int
    ffn: int
    query_groups: int
    tp: int
    micro_batch: int
    seq: int

    def spec(self) -> ModuleSpec:
        return ModuleSpec(layers=self.layers, hidden=self.hidden, heads=self.heads, ffn=self.ffn,
                          query_groups=self.query_groups, tokens_per_sample=self.seq)


def _block(shape: BlockShape, on_cpu: bool) -> torch.nn.Module:
    from megatron.core import parallel_state
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.transformer.transformer_block import TransformerBlock
    from megatron.core.transformer.transformer_config import TransformerConfig

    from .core import cpu_safe_config_overrides

    config = TransformerConfig(
        num_layers=shape.layers, hidden_size=shape.hidden, num_attention_heads=shape.heads,
        num_query_groups=shape.query_groups, ffn_hidden_size=shape.ffn, gated_linear_unit=True,
        activation_func=torch.nn.functional.silu, add_bias_linear=False, hidden_dropout=0.0,
        attention_dropout=0.0, params_dtype=torch.float32,
        tensor_model_parallel_size=parallel_state.get_tensor_model_parallel_world_size(),
        **(cpu_safe_config_overrides() if on_cpu else {"gradient_accumulation_fusion": False}),
    )
    return TransformerBlock(config, get_gpt_layer_local_spec())


def block_weight_count(block: torch.nn.Module) -> int:
    """Weights of the block's matrices on this rank (norms excluded): what FLOPs count."""
    return sum(p.numel() for p in block.parameters() if p.dim() == 2)


def _time_block(shape: BlockShape, device: ProfileDevice, rank: int, warmup: int,
                repeats: int) -> tuple[float, float, int]:
    """Median forward and backward seconds of the block, and its weights on this rank."""
    torch.manual_seed(0)
    block = _block(shape, on_cpu=device.kind == "cpu").to(device.torch_device(rank))
    x = torch.randn(shape.seq, shape.micro_batch, shape.hidden, device=device.torch_device(rank),
                    requires_grad=True)
    forwards, backwards = [], []
    for i in range(warmup + repeats):
        if dist.is_initialized():
            dist.barrier()
        out, forward = device.timed(lambda: block(x, attention_mask=None))
        _, backward = device.timed(lambda: out.float().square().mean().backward())
        if i >= warmup:
            forwards.append(forward)
            backwards.append(backward)
    return statistics.median(forwards), statistics.median(backwards), block_weight_count(block)


def _measure_here(shape: BlockShape, device: ProfileDevice, rank: int, warmup: int,
                  repeats: int) -> tuple[ProfilePoint, int]:
    from megatron.core import parallel_state, tensor_parallel

    from .core import enable_cpu_shims

    shims = enable_cpu_shims() if device.kind == "cpu" else None
    try:
        parallel_state.initialize_model_parallel(tensor_model_parallel_size=shape.tp)
        try:
            if shims is None:  # device weights are initialised under Megatron's TP RNG tracker
                tensor_parallel.model_parallel_cuda_manual_seed(0)
            forward, backward, weights = _time_block(shape, device, rank, warmup, repeats)
        finally:
            parallel_state.destroy_model_parallel()
    finally:
        if shims is not None:
            shims.remove()
    flops = shape.layers * shape.spec().layer_forward_flops(shape.micro_batch) / shape.tp
    return ProfilePoint(shape.module, shape.tp, shape.micro_batch, shape.seq, shape.layers,
                        forward, backward, flops, hidden=shape.hidden), weights


def _rank_main(rank: int, port: int, shapes: list[BlockShape], device: ProfileDevice, warmup: int, repeats: int,
               out_dir: str) -> None:
    """One TP rank: join the group (gloo / nccl / hccl), measure every shape, write rank 0's points."""
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    torch.set_num_threads(1)
    device.bind(rank)
    tp = shapes[0].tp
    from mindspeed_flow.loopback import keep_stores_on_loopback

    keep_stores_on_loopback()  # rank 0's tcp:// store on 127.0.0.1 (torch binds it on every interface)
    dist.init_process_group(device.dist_backend, init_method=f"tcp://{LOOPBACK}:{port}", rank=rank, world_size=tp)
    try:
        results = [_measure_here(s, device, rank, warmup, repeats) for s in shapes]
    finally:
        dist.destroy_process_group()
    if rank == 0:
        rows = [{"point": asdict(p), "weights": w} for p, w in results]
        Path(out_dir, "points.json").write_text(json.dumps(
            {"rows": rows, "peak_tflops": measure_peak_tflops(device), "device": device.name()}))


def _free_port() -> int:
    with socket.socket() as s:
        s.bind((LOOPBACK, 0))
        return s.getsockname()[1]


@dataclass(frozen=True)
class Measured:
    """Points of one TP size, each block's weights on one rank, the GEMM peak that rank 0
    measured in the same process right after them, and the device they ran on."""

    points: tuple[ProfilePoint, ...]
    weights: tuple[int, ...]
    peak_tflops: float
    device: str


def measure(shapes: list[BlockShape], warmup: int = 2, repeats: int = 5, device: str = "cpu") -> Measured:
    """Measure shapes of one TP size in ``tp`` fresh processes, on ``device`` (``"cpu"``,
    ``"cuda"``, ``"npu"`` or ``"auto"``, see :func:`..devices.profile.select_device`; a missing
    device is refused before any process starts).  All processes are joined (or killed by
    ``torch.multiprocessing``) before this returns."""
    tps = {s.tp for s in shapes}
    if len(tps) != 1:
        raise ValueError(f"measure: one TP size per call, got {sorted(tps)}")
    tp = tps.pop()
    backend = select_device(device, tp)
    with tempfile.TemporaryDirectory() as out_dir:
        mp.start_processes(_rank_main, args=(_free_port(), shapes, backend, warmup, repeats, out_dir),
                           nprocs=tp, join=True, start_method="spawn")
        data = json.loads(Path(out_dir, "points.json").read_text())
    return Measured(tuple(ProfilePoint(**r["point"]) for r in data["rows"]),
                    tuple(r["weights"] for r in data["rows"]), data["peak_tflops"], data["device"])


def measure_peak_tflops(device: ProfileDevice = ProfileDevice("cpu", "gloo"), size: int = 2048,
                        repeats: int = 10) -> float:
    """The best dense fp32 GEMM rate of this process on ``device``, in TFLOP/s (measured in a
    profiled rank, with its thread count): the reference for profile efficiencies."""
    where = device.torch_device(0)  # rank 0 measures it
    a, b = torch.randn(size, size, device=where), torch.randn(size, size, device=where)
    device.timed(lambda: a @ b)
    return 2 * size**3 / min(device.timed(lambda: a @ b)[1] for _ in range(repeats)) / 1e12
