"""Measure an allocator profile with megatron-core's real transformer layers.

A ViT-shaped block (the encoder) and an LLM-shaped block (the backbone) run forward and
backward at a few (tp, micro batch, sequence) points; TP ``n`` runs in ``n`` processes
(gloo on the CPU, nccl on CUDA, hccl on an NPU: ``--device``; only the CPU has been run).
TP 1, 2 and 4 are measured by default (both blocks' heads and key/value groups divide by
4); the proxy extrapolates larger TP sizes from them (``tp_calibration.py``).  On a CPU
with fewer cores than TP ranks the ranks share cores, and the times say so.
Writes a profile file (default ``configs/allocator/profiles/cpu_megatron_tiny.yaml``);
it takes minutes (TP 4 on 2 cores: most of it).

    .venv/bin/python scripts/profile_allocator.py [--out PATH] [--tp 1 2 4] [--repeats N] [--device cpu|cuda|npu|auto]
"""

from __future__ import annotations

import argparse
import datetime
import os
import sys
import warnings
from pathlib import Path

from tqdm import tqdm

from mindspeed_flow.adapters.megatron.core import megatron_core_version
from mindspeed_flow.adapters.megatron.profile import BlockShape, measure
from mindspeed_flow.adapters.devices.profile import DEVICES, DeviceUnavailableError, select_device
from mindspeed_flow.allocator import Profile

ENCODER = dict(module="encoder", layers=2, hidden=320, heads=4, ffn=864, query_groups=4)
BACKBONE = dict(module="backbone", layers=2, hidden=512, heads=8, ffn=1408, query_groups=4)
# (micro batch, tokens per sample): work per rank spans about two decades.
POINTS = {"encoder": [(1, 256), (2, 512), (4, 1024)], "backbone": [(1, 128), (1, 512), (2, 1024)]}


def shapes(tp: int) -> list[BlockShape]:
    return [BlockShape(**base, tp=tp, micro_batch=mbs, seq=seq)
            for base in (ENCODER, BACKBONE) for mbs, seq in POINTS[base["module"]]]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default="configs/allocator/profiles/cpu_megatron_tiny.yaml")
    parser.add_argument("--tp", type=int, nargs="+", default=[1, 2, 4])
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--device", choices=DEVICES, default="cpu")
    parser.add_argument("--tp-link-gbps", type=float, default=2.0,
                        help="the link TP runs over here (GB/s); not measured: the tiny_cpu cluster's figure")
    parser.add_argument("--tp-link-latency-us", type=float, default=50.0)
    args = parser.parse_args()
    warnings.filterwarnings("ignore")
    try:  # every TP size's device before anything runs: a missing one is named, no traceback
        for tp in args.tp:
            select_device(args.device, tp)
    except DeviceUnavailableError as exc:
        sys.exit(f"error: {exc}")
    points, peaks, devices = [], [], set()
    for tp in tqdm(args.tp, desc="tp sizes"):
        measured = measure(shapes(tp), warmup=2, repeats=args.repeats, device=args.device)
        devices.add(measured.device)
        points += measured.points
        peaks.append(measured.peak_tflops)
    # A one-thread GEMM does not always beat a small transformer block here (caches), so
    # the peak is the best rate seen on this device, GEMM or block: efficiency stays <= 1.
    peak = max(peaks + [p.achieved_flops / 1e12 for p in points])
    profile = Profile(
        device=", ".join(sorted(devices)),
        peak_tflops=peak, points=tuple(points),
        source=f"scripts/profile_allocator.py, megatron-core {megatron_core_version()}, "
               f"{datetime.date.today().isoformat()}, --device {args.device}, TP on 127.0.0.1, "
               f"{os.cpu_count()} CPU cores",
        tp_link_gbps=args.tp_link_gbps, tp_link_latency_us=args.tp_link_latency_us,
    )
    path = profile.save(Path(args.out))
    print(f"{len(points)} points, peak {peak * 1e3:.1f} GFLOP/s -> {path}")
    for p in points:
        print(f"  {p.module:<8} tp {p.tp} mbs {p.micro_batch} seq {p.seq:>5}: fwd {p.forward_s * 1e3:7.1f} ms "
              f"bwd {p.backward_s * 1e3:7.1f} ms, {p.achieved_flops / 1e9:5.1f} GFLOP/s "
              f"({p.achieved_flops / (peak * 1e12):.0%} of peak)")


if __name__ == "__main__":
    main()
