#!/usr/bin/env python
"""``scripts/bench_attention.py`` with the device backends registered, for the device check.

bench_attention calls :func:`mindspeed_flow.attention.varlen_attention` without naming a
backend, so the backend is the one :func:`~mindspeed_flow.attention.backends.select_backend`
picks: importing ``mindspeed_flow.adapters.devices.flash_attn`` registers flash-attn's varlen
kernel for CUDA (used when flash-attn imports and the dtype is fp16/bf16; SDPA per segment
otherwise).  The picked backend is added to the JSON's settings as ``varlen_backend``.
Same arguments as bench_attention.
"""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

import torch

import mindspeed_flow.adapters.devices.flash_attn  # noqa: F401  (registers the "flash_attn" backend)
from mindspeed_flow.attention.backends import select_backend

BENCH = Path(__file__).resolve().parent / "bench_attention.py"


def main(argv: list[str]) -> int:
    spec = importlib.util.spec_from_file_location("bench_attention", BENCH)
    bench = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = bench  # its dataclasses look their module up
    spec.loader.exec_module(bench)
    rc = bench.main(argv)
    device = argv[argv.index("--device") + 1] if "--device" in argv else "cpu"
    dtype = getattr(torch, argv[argv.index("--dtype") + 1]) if "--dtype" in argv else torch.float32
    backend = select_backend(torch.device(device).type, None, dtype).name
    print(f"varlen backend: {backend}")
    if "--json" in argv:
        path = Path(argv[argv.index("--json") + 1])
        result = json.loads(path.read_text())
        result["settings"]["varlen_backend"] = backend
        path.write_text(json.dumps(result, indent=2))
    return rc


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
