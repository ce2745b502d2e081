"""Peak memory of ``mindspeed-flow average-checkpoints`` against loading every input.

Writes N Megatron torch-format checkpoints of S shards (mp_rank_XX_YYY) of a given size,
then runs, each in a fresh process so peak RSS (``VmHWM``) is its own:

* baseline: ``torch.load`` every shard of every input, average in memory, save;
* streaming: :func:`mindspeed_flow.recipes.averaging.average_checkpoints`.

Prints both peaks, the peak of the imports alone, the ratios, and the shard and input sizes.
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import tempfile
from pathlib import Path

import torch
from tqdm import tqdm

SHARD_NAMES = ("mp_rank_00_000", "mp_rank_00_001", "mp_rank_01_000", "mp_rank_01_001")


def write_inputs(root: Path, inputs: int, shard_mb: int) -> list[Path]:
    numel = shard_mb * 2**20 // 4 // 8
    paths = []
    for i in tqdm(range(inputs), desc="writing inputs"):
        path = root / f"in{i}"
        (path / "release").mkdir(parents=True)
        (path / "latest_checkpointed_iteration.txt").write_text("release")
        for shard in SHARD_NAMES:
            (path / "release" / shard).mkdir()
            model = {f"decoder.layers.{k}.weight": torch.randn(numel) for k in range(8)}
            torch.save({"model": model, "iteration": 1}, path / "release" / shard / "model_optim_rng.pt")
        paths.append(path)
    return paths


BASELINE = r"""
import sys, torch
from pathlib import Path
out, ins = Path(sys.argv[1]), [Path(p) for p in sys.argv[2:]]
shards = sorted(p.relative_to(ins[0]) for p in ins[0].glob("release/mp_rank_*/model_optim_rng.pt"))
loaded = [[torch.load(i / s, map_location="cpu", weights_only=False) for s in shards] for i in ins]
for k, s in enumerate(shards):
    model = {n: sum(m[k]["model"][n] for m in loaded) / len(ins) for n in loaded[0][k]["model"]}
    (out / s).parent.mkdir(parents=True, exist_ok=True)
    torch.save({"model": model, "iteration": 1}, out / s)
"""

STREAMING = r"""
import sys
from mindspeed_flow.recipes.averaging import average_checkpoints
average_checkpoints(sys.argv[1], sys.argv[2:])
"""

IMPORTS_ONLY = "import sys, torch, mindspeed_flow.recipes.averaging\n"

PEAK = "\nprint('PEAK_KB', [l.split()[1] for l in open('/proc/self/status') if l.startswith('VmHWM')][0])\n"


def peak_mb(code: str, out: Path, inputs: list[Path]) -> float:
    result = subprocess.run([sys.executable, "-c", code + PEAK, str(out), *map(str, inputs)],
                            check=True, capture_output=True, text=True)
    line = [x for x in result.stdout.splitlines() if x.startswith("PEAK_KB")][0]
    return int(line.split()[1].strip("'[]")) / 1024


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--inputs", type=int, default=3)
    parser.add_argument("--shard-mb", type=int, default=64)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        inputs = write_inputs(root, args.inputs, args.shard_mb)
        base = peak_mb(BASELINE, root / "baseline", inputs)
        stream = peak_mb(STREAMING, root / "streaming", inputs)
        idle = peak_mb(IMPORTS_ONLY, root / "idle", inputs)
    total = args.inputs * len(SHARD_NAMES) * args.shard_mb
    print(f"{args.inputs} inputs x {len(SHARD_NAMES)} shards x {args.shard_mb} MB (all inputs {total} MB)")
    print(f"baseline (load all inputs) peak RSS: {base:.0f} MB")
    print(f"average-checkpoints (streaming) peak RSS: {stream:.0f} MB")
    print(f"python + torch imports alone: {idle:.0f} MB")
    print(f"above imports: baseline {base - idle:.0f} MB, streaming {stream - idle:.0f} MB "
          f"({(stream - idle) / args.shard_mb:.1f} shards)")
    print(f"ratio baseline / streaming: {base / stream:.2f}x (above imports {(base - idle) / (stream - idle):.2f}x)")


if __name__ == "__main__":
    main()
