"""What one run of the real job left (:func:`realjob.run_real_job`): its output, the iterations
Megatron logged, and the observers' records (``realjob_hooks/sitecustomize.py``), read into
losses, consumed samples, the samples fed per iteration and DP rank, attention calls, the
stand-ins and shims it used.  Also reads back a finished run's folder (``load_run``).
"""

from __future__ import annotations

import json
import re
from collections import defaultdict
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Optional

if TYPE_CHECKING:
    from realjob import RealJob

LOSS_KEY = "loss"  # pretrain_vlm.loss_func's reporting key

ITERATION_LINE = re.compile(r"iteration\s+(\d+)/\s*(\d+) \| consumed samples:\s+(\d+) \|(.*)")
LOG_FIELD = re.compile(r" ([A-Za-z][A-Za-z _()/-]*?): ([-+0-9.eEnaif]+) \|")
VALIDATION_LINE = re.compile(r"validation loss at (?:iteration (\d+)|[^|]*?) \|(.*)")


@dataclass
class RealRun:
    """What one run left: its output, the logged iterations, and the observers' records."""

    job: RealJob
    workdir: Path
    returncode: int
    output: str
    command: list[str]
    wall_s: float
    records: list[dict] = field(default_factory=list)
    report: str = ""
    cpu_s: float = 0.0  # CPU seconds of the run's processes (user + system; all ranks and torchrun)

    # --- from the log (what Megatron prints on the last rank)
    @property
    def logged(self) -> dict[int, dict]:
        out = {}
        for match in ITERATION_LINE.finditer(self.output):
            fields = {k.strip(): v for k, v in LOG_FIELD.findall(" " + match.group(4))}
            fields["consumed samples"] = int(match.group(3))
            out[int(match.group(1))] = fields
        return out

    @property
    def losses(self) -> dict[int, float]:
        """{iteration: loss as Megatron logs it (``%.6E``)}."""
        return {i: float(f[LOSS_KEY]) for i, f in self.logged.items() if LOSS_KEY in f}

    @property
    def consumed(self) -> dict[int, int]:
        """{iteration: consumed samples as logged}."""
        return {i: f["consumed samples"] for i, f in self.logged.items()}

    @property
    def validation(self) -> list[str]:
        return [line for line in self.output.splitlines() if "validation loss at" in line]

    # --- from the observers
    def _of(self, kind: str) -> list[dict]:
        return [r for r in self.records if r["kind"] == kind]

    @property
    def batches(self) -> list[dict]:
        """Every batch the model got (all ranks, train and eval), as observed."""
        return self._of("batch")

    def _fed(self, training: bool) -> list[tuple[int, int, list[int]]]:
        grouped: dict = defaultdict(list)
        for b in self.batches:
            if b.get("training") is training and b.get("pp", 0) == 0 and b.get("tp", 0) == 0 \
                    and b.get("vpp") in (None, 0):
                tags = [t for row in b["rows"] for seg in row for t in seg["tags"]]
                grouped[((b["iteration"] or 0) + 1, b.get("dp", 0))].extend(tags)
        return [(i, dp, tags) for (i, dp), tags in sorted(grouped.items())]

    @property
    def fed(self) -> list[tuple[int, int, list[int]]]:
        """[(iteration, dp_rank, [sample tags fed to the model in that iteration])], training only,
        as the first pipeline stage's TP rank 0 of each DP replica saw them."""
        return self._fed(True)

    @property
    def evaluated(self) -> list[tuple[int, int, list[int]]]:
        """The same for evaluation forwards (keyed by the training iteration they follow)."""
        return self._fed(False)

    def real_tokens_per_iteration(self) -> dict[int, int]:
        """{iteration: tokens of the samples fed (padding and tagless filler excluded)}, over DP."""
        out: dict = defaultdict(int)
        for b in self.batches:
            if b.get("training") and b.get("pp", 0) == 0 and b.get("tp", 0) == 0 and b.get("vpp") in (None, 0):
                out[(b["iteration"] or 0) + 1] += sum(seg["end"] - seg["start"] for row in b["rows"] for seg in row
                                                      if seg["tags"])
        return dict(out)

    def fed_samples(self) -> list[int]:
        """Every training sample fed, in order (iteration, then DP rank)."""
        return [t for _, _, tags in self.fed for t in tags]

    @property
    def attention(self) -> list[dict]:
        """The LLM's core-attention calls: query shape, mask shape / kind, packed segments,
        ``samples_in_row`` and ``crosses`` (a query saw a key of another sample)."""
        return self._of("attention")

    @property
    def kernel_attention(self) -> list[dict]:
        """``torch_npu.npu_fusion_attention`` calls (ViT and LLM): layout, shapes, seqlens."""
        return self._of("fusion_attention")

    @property
    def steps(self) -> dict[int, dict]:
        """{iteration: {"losses": {...} full precision, "grad_norm": ...}} from the last stage (the
        job's last, or a later one where a plan set the pipeline size: the largest seen)."""
        steps = self._of("step")
        last = max([self.job.pp - 1] + [s.get("pp") or 0 for s in steps])
        return {s["iteration"]: s for s in steps if s.get("pp", 0) == last and s.get("tp", 0) == 0
                and s.get("dp", 0) == 0}

    @property
    def exact_losses(self) -> dict[int, float]:
        return {i: s["losses"][LOSS_KEY] for i, s in self.steps.items() if LOSS_KEY in s["losses"]}

    @property
    def shims(self) -> list[str]:
        return sorted({line.split("[realjob] ", 1)[1] for line in self.output.splitlines()
                       if "[realjob] shim:" in line})

    @property
    def stood_in(self) -> dict:
        merged: dict = {"torch_npu": set(), "torch_npu called": defaultdict(int), "torchvision": set()}
        for r in self._of("standins"):
            if "torch_npu" in r:
                merged["torch_npu"] |= set(r["torch_npu"]["stood_in"])
                for name, n in r["torch_npu"]["called"].items():
                    merged["torch_npu called"][name] += n
            if "torchvision" in r:
                merged["torchvision"] |= set(r["torchvision"]["modules"])
        return merged


def load_run(job: RealJob, workdir: Path) -> Optional[RealRun]:
    """A finished run of ``job`` left in ``workdir`` by :func:`run_real_job`, or ``None``."""
    result = Path(workdir) / "result.json"
    if not result.is_file():
        return None
    meta = json.loads(result.read_text())
    if meta["job"] != repr(job):
        return None
    records = [json.loads(line) for path in sorted((Path(workdir) / "observe").glob("observe_rank*.jsonl"))
               for line in path.read_text().splitlines() if line.strip()]
    run = RealRun(job, Path(workdir), meta["returncode"], (Path(workdir) / "output.log").read_text(),
                  meta["command"], meta["wall_s"], records, cpu_s=meta["cpu_s"])
    run.report = describe(run) + " (reused)"
    return run


def describe(run: RealRun) -> str:
    name = run.workdir.name
    standins = run.stood_in
    in_env = dict(run.job.env).get("MINDSPEED_FLOW_FLAGS")
    flags = " ".join(run.job.plugin) or (f"MINDSPEED_FLOW_FLAGS={in_env!r}" if in_env else "none (upstream as is)")
    lines = [f"[real job] {name}: pp={run.job.pp} tp={run.job.tp} dp={run.job.dp} plugin: {flags}; "
             f"launch {run.job.launch}; rc {run.returncode}; {run.wall_s:.0f} s wall, {run.cpu_s:.0f} s CPU; "
             f"{len(run.losses)} iterations logged",
             f"[real job] {name}: stood in: torch_npu ({len(standins['torch_npu'])}): "
             f"{', '.join(sorted(standins['torch_npu']))}",
             f"[real job] {name}: stood in: torchvision (import-only): {', '.join(sorted(standins['torchvision']))}",
             f"[real job] {name}: torch_npu kernels called: {dict(standins['torch_npu called'])}"]
    lines += [f"[real job] {name}: {shim}" for shim in run.shims]
    return "\n".join(lines)
