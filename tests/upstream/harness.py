"""Upstream in the loop: MindSpeed's real ``megatron_adaptor`` and MindSpeed-MM's real
Qwen2.5-VL on CPU, in a subprocess, with or without the plugin.

What is real: MindSpeed 028de58 (its adaptor and patch manager), MindSpeed-MM 57069cd
(``VLMModel``, the Qwen2-VL ViT, ``MMGPTModel``, its config reader), and Megatron
core_v0.12.1 as the source copy inside the MindSpeed-MM tree (not a pip wheel), all
unpacked from ``shared/upstream`` by its ``unpack.sh``.  What is stood in: ``torch_npu``
and ``torchair`` (``standins/``), whose kernels are plain-torch reference implementations;
every run prints the stood-in symbols and the kernels it called.  Shimmed
(``harness_hooks/sitecustomize.py``, first on the run's ``PYTHONPATH``): torch's rendezvous
stores listen on 127.0.0.1 only, with or without the plugin (torch binds them on every
interface; ``[upstream harness] shim: ...`` on stderr).

Usage from a test (this folder is on ``sys.path`` under pytest)::

    from harness import Job, run_upstream, sample_specs

    job = Job(samples=sample_specs(3), layout="microbatches")  # or layout="packed"
    plain = run_upstream(job, tmp_path / "plain")                    # upstream as is
    ours = run_upstream(job, tmp_path / "ours", plugin=True,        # + --use-flowtrain,
                        load=plain.initial_weights)                  # same initial weights
    ours.loss, ours.grads["module.text_decoder.output_layer.weight"], ours.report

``Job`` fields choose the precision (``"fp32"``: parameters in fp32, the M-RoPE tables
still bf16 as upstream hard-codes them; ``"bf16"``: upstream's own ``--bf16`` setting),
``--use-flash-attn``, the pipeline size (``pp=2`` runs two gloo processes under
torchrun), extra upstream flags, and submodules whose forward outputs to keep
(``capture``, read back with ``run.captures()``).  Gradients are keyed by global parameter
name, so runs of different pipeline sizes compare directly.  Each run also records
``DotProductAttention.forward``'s wrapper chain and, with the plugin, the patch report.
In this folder, ``conftest.Runs`` shares named runs between tests (one subprocess each).
``upstream_sources()`` (``tests/support/pinned_upstream.py``) gives the unpacked checkouts;
``upstream_env()`` the environment a subprocess needs.
"""

from __future__ import annotations

import functools
import json
import os
import signal
import socket
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent
if str(HERE.parent) not in sys.path:  # tests/: pinned_upstream, when used outside pytest
    sys.path.insert(0, str(HERE.parent))
from pinned_upstream import Sources, upstream_sources  # noqa: E402
from process_tree import kill_tree  # noqa: E402
STANDINS = HERE / "standins"
HOOKS = HERE / "harness_hooks"  # sitecustomize.py: the shim keeping torch's stores on 127.0.0.1
DRIVER = HERE / "driver.py"
TINY_MODEL = HERE / "tiny_qwen2_5vl.json"
RUN_TIMEOUT_S = 300
# The plugin as a launch script turns it on: every feature (the schedule runtime in place of
# Megatron's forward_backward_func included, next to upstream's --variable-seq-lengths); the
# allocator stays off without a plan, pool and recipes are inert without values.
PATCH_FEATURE_FLAGS = ("--use-flowtrain",)


def upstream_env(sources: Sources, scratch: Path) -> dict[str, str]:
    """The subprocess environment: the harness's shim (``harness_hooks/sitecustomize.py``:
    torch's rendezvous stores on 127.0.0.1, with or without the plugin), stand-ins, then
    MindSpeed-MM (with Megatron's copy), then MindSpeed first on ``sys.path``; no plugin
    switch from the caller's environment."""
    env = {k: v for k, v in os.environ.items() if k not in ("MINDSPEED_FLOW_FLAGS", "PYTHONPATH")}
    env.update({
        "PYTHONPATH": os.pathsep.join(map(str, (HOOKS, STANDINS, sources.mindspeed_mm, sources.mindspeed))),
        "TORCH_EXTENSIONS_DIR": str(scratch / "torch_extensions"),  # the adaptor writes there
        "CUDA_DEVICE_MAX_CONNECTIONS": "1",
        "OMP_NUM_THREADS": "1",
        "PYTHONHASHSEED": "0",
    })
    return env


def sample_specs(count: int, seed: int = 0) -> list[dict]:
    """``count`` seeded samples of different shapes: an image grid (t, h, w) in patches and
    a text length.  Grids are multiples of 2 (the spatial merge); some exceed one window."""
    grids = [(1, 8, 8), (1, 4, 6), (1, 6, 4), (1, 4, 4)]
    return [{"seed": seed * 100 + i, "grid": grids[i % len(grids)], "text": 9 + 5 * i} for i in range(count)]


@dataclass(frozen=True)
class Job:
    """One upstream run: which samples, laid out how, under which upstream flags."""

    samples: list[dict]
    layout: str = "microbatches"  # one sample per microbatch, or "packed": one row, cu_seqlens
    precision: str = "fp32"
    flash_attn: bool = False
    pp: int = 1
    extra_args: tuple[str, ...] = ()
    capture: tuple[str, ...] = ()  # submodule names whose forward outputs the run saves

    def model_json(self) -> dict:
        model = json.loads(TINY_MODEL.read_text())
        parts = (model["image_encoder"]["vision_encoder"], model["image_encoder"]["vision_projector"],
                 model["text_decoder"])
        for part in parts:
            part["params_dtype"] = "bf16" if self.precision == "bf16" else "fp32"
            part["bf16"] = self.precision == "bf16"
        # mm_gpt_model asserts config.bf16 for M-RoPE (whose tables it builds in bf16 in
        # any case); in fp32 runs the flag stays on for the text decoder only, where with
        # --use-flash-attn nothing else reads it.
        model["text_decoder"]["bf16"] = True
        if self.pp == 2:  # as examples/qwen2.5vl/model_7b.json splits: the ViT on stage 0
            model["image_encoder"]["vision_encoder"]["pipeline_num_layers"] = [2, 0]
            model["text_decoder"]["pipeline_num_layers"] = [1, 1]
        return model

    def megatron_args(self, model_json: Path) -> list[str]:
        microbatches = 1 if self.layout == "packed" else len(self.samples)
        args = [
            "--use-mcore-models", "--tensor-model-parallel-size", "1",
            "--pipeline-model-parallel-size", str(self.pp), "--context-parallel-size", "1",
            "--micro-batch-size", "1", "--global-batch-size", str(microbatches),
            "--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4",
            "--seq-length", "256", "--max-position-embeddings", "4096",
            "--tokenizer-type", "NullTokenizer", "--vocab-size", "151936", "--make-vocab-size-divisible-by", "1",
            "--normalization", "RMSNorm", "--use-fused-rmsnorm", "--swiglu", "--use-fused-swiglu",
            "--no-masked-softmax-fusion", "--lr", "1e-5", "--train-iters", "1", "--seed", "42",
            "--variable-seq-lengths", "--calculate-per-token-loss",
            "--distributed-backend", "gloo", "--use-cpu-initialization",
            "--no-gradient-accumulation-fusion", "--mm-model", str(model_json),
            *self.extra_args,
        ]
        if self.precision == "bf16":
            args.append("--bf16")
        if self.flash_attn:
            args.append("--use-flash-attn")
        return args


@dataclass
class UpstreamRun:
    """What one run left: rank results (JSON), gradients and initial weights on disk."""

    workdir: Path
    results: list[dict]
    output: str  # the run's stdout and stderr
    grads_files: list[Path] = field(default_factory=list)
    initial_weights: Path | None = None
    report: str = ""  # what was stood in and which stand-in kernels each rank called

    @property
    def result(self) -> dict:
        """The last pipeline stage's result (it holds the loss)."""
        return self.results[-1]

    @property
    def loss(self) -> float:
        return self.result["loss"]

    def captures(self, rank: int = 0) -> dict[str, list[torch.Tensor]]:
        """Forward outputs of the ``Job.capture`` submodules on ``rank``, one per call."""
        return torch.load(self.workdir / f"captures_{rank}.pt", weights_only=True)

    @functools.cached_property
    def grads(self) -> dict[str, torch.Tensor]:
        """Gradients of every rank by global parameter name (layer numbers as in a
        single-stage model), so runs of different pipeline sizes compare directly."""
        merged: dict[str, torch.Tensor] = {}
        for path in self.grads_files:
            for name, grad in torch.load(path, weights_only=True).items():
                if name in merged:
                    raise AssertionError(f"{name} has gradients on two pipeline stages")
                merged[name] = grad
        return merged


def _run_in_own_group(command: list[str], cwd: Path, env: dict[str, str]) -> tuple[int, str]:
    """Run to completion; on timeout kill torchrun and every process under it (its workers
    are in sessions of their own and would keep the pipe open)."""
    proc = subprocess.Popen(command, cwd=cwd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True, start_new_session=True)
    try:
        output, _ = proc.communicate(timeout=RUN_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        kill_tree(proc.pid)
        output, _ = proc.communicate()
        return -signal.SIGKILL, f"timed out after {RUN_TIMEOUT_S} s\n{output}"
    return proc.returncode, output


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def one_stage_layout(workdir: Path) -> Path:
    """A schedule layout of one stage.  At PP=1 without a layout the schedule feature hands
    back Megatron's own ``forward_backward_no_pipelining``; naming one puts the plugin's
    runtime on the path of the single-stage runs too, so their equality is the runtime's."""
    path = workdir / "one_stage_layout.yaml"
    path.write_text("regions:\n  - {name: llm, layers: 2}\n")
    return path


def run_upstream(job: Job, workdir: Path, plugin: bool = False, load: Path | None = None,
                 save_initial: bool = True, extra_plugin_flags: tuple[str, ...] = PATCH_FEATURE_FLAGS,
                 driver: Path = DRIVER) -> UpstreamRun:
    """Run ``driver`` (``driver.py``, or a script built on it) once under ``job``; with
    ``plugin`` through ``mindspeed_flow.launch`` plus ``extra_plugin_flags``.  Raises with the
    child's output when it fails."""
    sources = upstream_sources()
    workdir.mkdir(parents=True, exist_ok=True)
    model_json = workdir / "model.json"
    model_json.write_text(json.dumps(job.model_json(), indent=1))
    ranks = range(job.pp)
    spec = {"samples": job.samples, "layout": job.layout,
            "result": str(workdir / "result_{rank}.json"), "grads": str(workdir / "grads_{rank}.pt"),
            "captures": str(workdir / "captures_{rank}.pt"), "capture": list(job.capture),
            "load": str(load) if load else None,
            "save": str(workdir / "initial_{rank}.pt") if save_initial else None}
    (workdir / "job.json").write_text(json.dumps(spec))
    env = upstream_env(sources, workdir)
    env["MINDSPEED_FLOW_HARNESS_JOB"] = str(workdir / "job.json")
    flags = list(extra_plugin_flags) if plugin else []
    if "--use-flowtrain" in flags and job.pp == 1:
        flags += ["--flow-schedule-config", str(one_stage_layout(workdir))]
    script = [*(["-m", "mindspeed_flow.launch"] if plugin else []), str(driver),
              *job.megatron_args(model_json), *flags]
    if job.pp == 1:
        env.update({"RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "1", "MASTER_ADDR": "127.0.0.1",
                    "MASTER_PORT": str(_free_port())})
        command = [sys.executable, *script]
    else:
        command = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(job.pp),
                   "--master-addr", "127.0.0.1", "--master-port", str(_free_port()), *script]
    # cwd is the work folder, not the driver's: the script's folder must come from the launcher.
    returncode, output = _run_in_own_group(command, workdir, env)
    if returncode != 0:
        raise RuntimeError(f"upstream run failed ({returncode}): {' '.join(command)}\n{output[-8000:]}")
    results = [json.loads(Path(spec["result"].format(rank=r)).read_text()) for r in ranks]
    run = UpstreamRun(workdir, results, output, [Path(spec["grads"].format(rank=r)) for r in ranks],
                      workdir / "initial_{rank}.pt" if save_initial else None)
    standin = run.results[0]["standin"]
    lines = [f"[upstream harness] {workdir.name}: plugin {'on' if plugin else 'off'}; stood in "
             f"({len(standin['stood_in'])}): {', '.join(standin['stood_in'])}"]
    lines += [f"[upstream harness] {workdir.name} rank {rank}: stand-in kernels called: "
              f"{result['standin']['called']}" for rank, result in enumerate(run.results)]
    run.report = "\n".join(lines)
    print(run.report)
    return run
