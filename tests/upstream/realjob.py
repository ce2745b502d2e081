"""The real job: MindSpeed-MM's own ``pretrain_vlm.py``, unmodified, as users start it.

``torchrun [--nproc-per-node N] pretrain_vlm.py ARGS`` (the plugin's ``.pth`` hook picks up
``--use-flowtrain`` / ``--flow-*`` in ARGS), or ``torchrun -m mindspeed_flow.launch
pretrain_vlm.py ARGS``; from the pinned MindSpeed-MM tree (``tests/support/pinned_upstream.py``), on its
``"huggingface"`` data path (``build_mm_dataset`` -> ``DataCollatorForQwen2vl`` ->
``build_mm_dataloader`` in sampler mode -> ``build_iterations``), with a real
``Qwen2_5_VLProcessor`` made offline and a small tagged conversation corpus with generated
images (``realjob_assets``), Megatron's optimizer and ``save_checkpoint`` / ``load_checkpoint``.

Stood in: ``torch_npu`` and ``torchair`` (``standins/``), torchvision (import-only,
``standins/torchvision``).  Shimmed (``realjob_hooks/sitecustomize.py``, on the run's
``PYTHONPATH``): ``compile_helpers`` no-op, ``Tensor.type()`` CUDA strings for Megatron's
optimizer, ``torch_npu.profiler`` / ``torch.npu.config``, core_v0.12.1's ``torch_dist`` writer
(``_write_item`` without ``serialization_format``, ``np.product``).  Every run's report names
them (``run.report``, printed).  What a run left is read by ``realjob_run.RealRun``.

    from realjob import RealJob, run_real_job
    run = run_real_job(RealJob(pp=2, plugin=("--use-flowtrain",)), tmp_path / "pp2_flow")
    run.losses[8], run.consumed[8], run.fed, run.attention
"""

from __future__ import annotations

import json
import os
import resource
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Optional

HERE = Path(__file__).resolve().parent
if str(HERE.parent / "support") not in sys.path:  # tests/support: pinned_upstream, when used outside pytest
    sys.path.insert(0, str(HERE.parent / "support"))
if str(HERE) not in sys.path:
    sys.path.insert(0, str(HERE))
from pinned_upstream import upstream_sources  # noqa: E402

import realjob_assets  # noqa: E402
from process_tree import kill_tree  # noqa: E402
from realjob_run import RealRun, describe, load_run  # noqa: E402

HOOKS = HERE / "realjob_hooks"
STANDINS = HERE / "standins"
TORCHVISION_STANDIN = STANDINS / "torchvision"
TINY_MODEL = HERE / "tiny_qwen2_5vl.json"
RUN_TIMEOUT_S = 480

@dataclass(frozen=True)
class RealJob:
    """One real-job run: parallel sizes, batch sizes, the plugin's flags, checkpoints, data."""

    pp: int = 1
    tp: int = 1
    dp: int = 1
    vpp: Optional[int] = None
    iters: int = 8
    mbs: int = 1
    gbs: int = 4
    seq_length: int = 256
    plugin: tuple[str, ...] = ()  # () = upstream as is; e.g. ("--use-flowtrain",), ("--flow-packing",)
    launch: str = "pth"  # "pth": torchrun pretrain_vlm.py ... ; "module": torchrun -m mindspeed_flow.launch ...
    ckpt_format: str = "torch"
    save: Optional[str] = None  # folder (absolute, or relative to the run's workdir)
    load: Optional[str] = None
    save_interval: Optional[int] = None
    exit_interval: Optional[int] = None
    val_rate: float = 0.0
    val_dataset: bool = False  # a separate validation file (basic_parameters.val_dataset)
    eval_interval: Optional[int] = None
    eval_iters: Optional[int] = None
    extra_args: tuple[str, ...] = ()  # more upstream flags ("--sequence-parallel", ...)
    samples: int = 48
    precision: str = "bf16"
    lr: float = 1e-3
    text_layers: Optional[int] = None  # LLM layers (default: 2, or 1 per pipeline stage and chunk)
    model_patch: tuple = ()  # ((dotted.json.path, value), ...) applied to the model JSON last
    data_patch: tuple = ()  # the same for the data JSON
    env: tuple = ()  # ((NAME, value), ...) for the run's environment
    timeout_s: int = RUN_TIMEOUT_S
    # ranks when not pp * tp * dp (a decoupled layout: the encoder's ranks come on top)
    world_size: Optional[int] = None

    @property
    def world(self) -> int:
        return self.world_size or self.pp * self.tp * self.dp

    def model_json(self) -> dict:
        model = json.loads(TINY_MODEL.read_text())
        chunks = self.pp * (self.vpp or 1)
        layers = self.text_layers or max(2, chunks)
        text = model["text_decoder"]
        vision = model["image_encoder"]["vision_encoder"]
        text["num_layers"] = layers
        if self.vpp:
            per = layers // chunks
            text["pipeline_num_layers"] = [[per] * self.pp for _ in range(self.vpp)]
            vision["pipeline_num_layers"] = [[vision["num_layers"]] + [0] * (self.pp - 1)] + \
                [[0] * self.pp for _ in range(self.vpp - 1)]
        else:
            base, extra = divmod(layers, self.pp)
            text["pipeline_num_layers"] = [base + (1 if i < extra else 0) for i in range(self.pp)]
            vision["pipeline_num_layers"] = [vision["num_layers"]] + [0] * (self.pp - 1)
        if self.precision != "bf16":
            raise ValueError("the real job runs bf16 (mm_gpt_model asserts it for M-RoPE)")
        for path, value in self.model_patch:
            _set_path(model, path, value)
        return model

    def data_json(self, assets: "Assets", workdir: Path) -> dict:
        basic = {
            "template": "qwen2vl", "dataset_dir": str(assets.corpus.parent), "dataset": str(assets.corpus),
            "cache_dir": str(workdir / "hf_cache"), "train_on_prompt": False, "mask_history": False,
            "preprocessing_batch_size": 1000, "preprocessing_num_workers": None, "max_samples": None,
            "tool_format": None, "val_rate": self.val_rate,
        }
        if self.val_dataset:
            basic["val_dataset"] = str(assets.val_corpus)
        data = {
            "dataset_param": {
                "dataset_type": "huggingface",
                "preprocess_parameters": {
                    "model_name_or_path": str(assets.processor), "use_fast_tokenizer": False,
                    "split_special_tokens": False, "image_max_pixels": realjob_assets.MAX_PIXELS,
                    "image_min_pixels": realjob_assets.MIN_PIXELS, "video_max_pixels": 16384,
                    "video_min_pixels": 0, "video_fps": 2.0, "video_maxlen": 64,
                },
                "basic_parameters": basic,
                "attr": {"system": None, "images": "images", "videos": None, "messages": "messages",
                         "role_tag": "role", "content_tag": "content", "user_tag": "user",
                         "assistant_tag": "assistant", "observation_tag": None, "function_tag": None,
                         "system_tag": None},
            },
            "dataloader_param": {
                "dataloader_mode": "sampler", "drop_last": True, "sampler_type": "BaseRandomBatchSampler",
                "collate_param": {"model_name": "qwen2vl", "ignore_pad_token_for_loss": True},
                "pin_memory": False, "shuffle": True,
            },
        }
        for path, value in self.data_patch:
            _set_path(data, path, value)
        return data

    @property
    def assets_name(self) -> str:
        """The assets folder's name (jobs with the same assets share it)."""
        return f"assets_{self.samples}"

    def make_assets(self, root: Path) -> "Assets":
        return make_assets(root, self.samples)

    def script_and_args(self, sources, workdir: Path, assets: "Assets") -> tuple[Path, list[str]]:
        """``pretrain_vlm.py`` and its arguments; writes the model, data and tools JSON into ``workdir``."""
        model_json, data_json = workdir / "model.json", workdir / "data.json"
        model_json.write_text(json.dumps(self.model_json(), indent=1))
        data_json.write_text(json.dumps(self.data_json(assets, workdir), indent=1))
        tools = workdir / "tools.json"  # beside the job: MindSpeed-MM refuses paths outside the working folder
        tools.write_text((sources.mindspeed_mm / "mindspeed_mm" / "tools" / "tools.json").read_text())
        return sources.mindspeed_mm / "pretrain_vlm.py", self.args(workdir, model_json, data_json, tools)

    def args(self, workdir: Path, model_json: Path, data_json: Path, tools_json: Path) -> list[str]:
        layers = self.model_json()["text_decoder"]["num_layers"]
        args = [
            "--use-mcore-models", "--tensor-model-parallel-size", str(self.tp),
            "--pipeline-model-parallel-size", str(self.pp), "--context-parallel-size", "1",
            "--micro-batch-size", str(self.mbs), "--global-batch-size", str(self.gbs),
            "--tokenizer-type", "NullTokenizer", "--vocab-size", "151936", "--seq-length", str(self.seq_length),
            "--make-vocab-size-divisible-by", "1", "--normalization", "RMSNorm", "--use-fused-rmsnorm",
            "--swiglu", "--use-fused-swiglu", "--no-masked-softmax-fusion",
            "--lr", str(self.lr), "--lr-decay-style", "cosine", "--weight-decay", "0",
            "--train-iters", str(self.iters), "--lr-warmup-fraction", "0.1", "--clip-grad", "0.0",
            "--adam-beta1", "0.9", "--adam-beta2", "0.999", "--seed", "42", "--bf16", "--use-flash-attn",
            "--variable-seq-lengths", "--num-workers", "0", "--distributed-timeout-minutes", "4",
            "--num-layers", str(layers), "--hidden-size", "64", "--num-attention-heads", "4",
            "--max-position-embeddings", "4096",
            "--mm-data", str(data_json), "--mm-model", str(model_json), "--mm-tool", str(tools_json),
            "--log-interval", "1", "--ckpt-format", self.ckpt_format,
            "--distributed-backend", "gloo", "--use-cpu-initialization", "--no-gradient-accumulation-fusion",
        ]
        if self.vpp:
            args += ["--virtual-pipeline-model-parallel-size", str(self.vpp)]
        if self.save:
            args += ["--save", str(workdir / self.save)]
            args += ["--save-interval", str(self.save_interval or self.iters)]
        if self.load:
            args += ["--load", str(workdir / self.load)]
        if self.exit_interval:
            args += ["--exit-interval", str(self.exit_interval)]
        args += ["--eval-interval", str(self.eval_interval or 10 * self.iters),
                 "--eval-iters", str(self.eval_iters if self.eval_iters is not None else 1)]
        return [*args, *self.extra_args]


def _set_path(tree: dict, path: str, value) -> None:
    *parents, last = path.split(".")
    for key in parents:
        tree = tree[key]
    tree[last] = value


@dataclass(frozen=True)
class Assets:
    processor: Path
    corpus: Path
    val_corpus: Path

    @property
    def tokenizer_json(self) -> Path:
        return self.processor / "tokenizer.json"


def make_assets(root: Path, samples: int, seed: int = 0) -> Assets:
    """The processor directory and the corpus (once per folder: reused when present)."""
    done = root / "done"
    processor, corpus, val = root / "processor", root / "corpus" / "data.json", root / "val" / "data.json"
    if not done.is_file():
        realjob_assets.make_processor(processor)
        realjob_assets.make_corpus(corpus.parent, samples, seed)
        realjob_assets.make_corpus(val.parent, 8, seed + 1, first=10000 - 8)
        done.write_text("ok\n")
    return Assets(processor, corpus, val)


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def run_env(sources, workdir: Path, assets: Assets, job: RealJob) -> dict[str, str]:
    drop = ("MINDSPEED_FLOW_FLAGS", "PYTHONPATH", "RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")
    env = {k: v for k, v in os.environ.items() if k not in drop}
    env.update({
        "PYTHONPATH": os.pathsep.join(map(str, (HOOKS, STANDINS, TORCHVISION_STANDIN, sources.mindspeed_mm,
                                                sources.mindspeed))),
        "REALJOB_OBSERVE": str(workdir / "observe"),
        "REALJOB_TOKENIZER": str(assets.tokenizer_json),
        "TORCH_EXTENSIONS_DIR": str(workdir.parent / "torch_extensions"),
        "HF_DATASETS_CACHE": str(workdir / "hf_cache"),
        "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1",
        "CUDA_DEVICE_MAX_CONNECTIONS": "1", "OMP_NUM_THREADS": "1", "PYTHONHASHSEED": "0",
        "TOKENIZERS_PARALLELISM": "false", "PYTHONUNBUFFERED": "1",
    })
    env.update(dict(job.env))
    return env


def command(job: RealJob, script: Path, args: list[str]) -> list[str]:
    torchrun = Path(sys.executable).parent / "torchrun"
    launcher = [str(torchrun)] if torchrun.is_file() else [sys.executable, "-m", "torch.distributed.run"]
    launcher += ["--nproc-per-node", str(job.world), "--master-addr", "127.0.0.1",
                 "--master-port", str(_free_port())]
    if job.launch == "module":
        launcher += ["-m", "mindspeed_flow.launch"]
    elif job.launch != "pth":
        raise ValueError(f"launch must be 'pth' or 'module', got {job.launch!r}")
    return [*launcher, str(script), *args, *job.plugin]


def _run_in_own_group(cmd: list[str], cwd: Path, env: dict[str, str], timeout: int) -> tuple[int, str]:
    """Run to completion; on timeout kill torchrun and every process under it."""
    with open(cwd / "output.log", "w+") as log:
        proc = subprocess.Popen(cmd, cwd=cwd, env=env, stdout=log, stderr=subprocess.STDOUT, text=True,
                                start_new_session=True)
        try:
            proc.wait(timeout=timeout)
            code = proc.returncode
        except subprocess.TimeoutExpired:
            kill_tree(proc.pid)  # torchrun's workers are in sessions of their own
            proc.wait()
            code = -signal.SIGKILL
        finally:
            kill_tree(proc.pid)  # stray workers
        log.seek(0)
        output = log.read()
    if code == -signal.SIGKILL:
        output = f"[realjob] timed out after {timeout} s\n{output}"
    return code, output


def run_real_job(job: RealJob, workdir: Path, check: bool = True, assets: Optional[Path] = None) -> RealRun:
    """Run ``job``'s script (``pretrain_vlm.py``; a ``TransformersJob``: ``pretrain_transformers.py``)
    once in ``workdir`` (checkpoint paths relative to it).
    Raises with the output's tail when the run fails, unless ``check`` is false."""
    sources = upstream_sources()
    workdir = Path(workdir)
    workdir.mkdir(parents=True, exist_ok=True)
    made = job.make_assets(Path(assets) if assets else workdir.parent / f"realjob_{job.assets_name}")
    observe = workdir / "observe"
    if observe.is_dir():
        for old in observe.iterdir():
            old.unlink()
    cmd = command(job, *job.script_and_args(sources, workdir, made))
    env = run_env(sources, workdir, made, job)
    start, usage = time.monotonic(), resource.getrusage(resource.RUSAGE_CHILDREN)
    code, output = _run_in_own_group(cmd, workdir, env, job.timeout_s)
    wall = time.monotonic() - start
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    cpu = (after.ru_utime - usage.ru_utime) + (after.ru_stime - usage.ru_stime)
    records = []
    if observe.is_dir():
        for path in sorted(observe.glob("observe_rank*.jsonl")):
            records += [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    run = RealRun(job, workdir, code, output, cmd, wall, records, cpu_s=cpu)
    (workdir / "result.json").write_text(json.dumps({"job": repr(job), "returncode": code, "wall_s": wall,
                                                      "cpu_s": cpu, "command": cmd}))
    run.report = describe(run)
    print(run.report)
    if check and code != 0:
        raise RuntimeError(f"real job failed ({code}) after {wall:.0f} s: {' '.join(cmd)}\n{output[-12000:]}")
    return run


def same_job(job: RealJob, **changes) -> RealJob:
    return replace(job, **changes)


class RealJobs:
    """Runs shared by name within a session (``conftest.real_jobs``): a name runs once; asking
    again for it with another job is an error (two tests would read different runs)."""

    def __init__(self, root: Path, reuse: Optional[Path] = None):
        self.root = Path(root)
        # REALJOB_REUSE=<a real_jobs folder of an earlier session>: runs of the same job found there
        # are read back instead of run again (for developing assertions; CI never sets it).
        self.reuse = Path(reuse) if reuse else (Path(os.environ["REALJOB_REUSE"]) if os.environ.get("REALJOB_REUSE")
                                                else None)
        self._done: dict[str, tuple[RealJob, RealRun]] = {}
        self.reports: list[str] = []

    def run(self, name: str, job: RealJob, check: bool = True) -> RealRun:
        if name in self._done:
            known, run = self._done[name]
            if known != job:
                raise ValueError(f"real job {name!r} already ran as {known}, asked again as {job}")
        else:
            run = load_run(job, self.reuse / name) if self.reuse else None
            if run is None:
                run = run_real_job(job, self.root / name, check=False, assets=self.root / job.assets_name)
            self._done[name] = (job, run)
            self.reports.append(run.report)
        if check and run.returncode != 0:
            raise RuntimeError(f"real job {name!r} failed ({run.returncode}) after {run.wall_s:.0f} s: "
                               f"{' '.join(run.command)}\n{run.output[-12000:]}")
        return run

    @property
    def wall_s(self) -> dict[str, float]:
        return {name: run.wall_s for name, (_, run) in self._done.items()}

    @property
    def cpu_s(self) -> dict[str, float]:
        return {name: run.cpu_s for name, (_, run) in self._done.items()}
