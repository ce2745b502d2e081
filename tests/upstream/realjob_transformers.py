"""The Qwen3-VL real job: MindSpeed-MM's own ``pretrain_transformers.py CONFIG.yaml``, unmodified,
as ``examples/qwen3vl/finetune_qwen3vl_*.sh`` start it (torchrun), on CPU.

:class:`TransformersJob` is :class:`realjob.RealJob`'s sibling: ``realjob.run_real_job`` and
``RealJobs`` launch and observe it the same way (stand-ins, shims, observers, report), only the
script, its YAML and its assets differ.  The YAML is the recipe's own
``examples/qwen3vl/qwen3vl_full_sft_8B.yaml`` read from the pinned tree with what a tiny CPU run
changes (:meth:`TransformersJob.config`); the model and processor are a local HF directory
(``realjob_qwen3vl_assets``); the data is the ``"huggingface"`` conversation path over
``realjob_assets``' tagged corpus.

What the run needs besides the Qwen2.5-VL job's stand-ins (``../shared/upstream/README.md``):
``gpt_args.distributed_backend: gloo`` (the YAML reader rebuilds the command line from the YAML
alone; a ``false`` would be passed as a value: off switches are left out), no ``bridge``
package (no ``init_model_with_meta_device``, ``bridge_patch`` off: the
model loads from the HF directory), and the run's folder holding
``mindspeed_mm/configs/read_yaml_config.py`` (``pretrain_transformers.py`` loads it by that path
relative to the working directory, which users set to the MindSpeed-MM root).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Optional

import yaml

import realjob_qwen3vl_assets
from realjob import RUN_TIMEOUT_S, Assets, make_assets, _set_path

RECIPE = Path("examples") / "qwen3vl" / "qwen3vl_full_sft_8B.yaml"
FSDP2_CONFIG = Path("examples") / "qwen3vl" / "fsdp2_config.yaml"
READ_YAML = Path("mindspeed_mm") / "configs" / "read_yaml_config.py"


@dataclass(frozen=True)
class TransformersJob:
    """One run of ``pretrain_transformers.py``: ranks, batch sizes, the plugin's flags, data."""

    dp: int = 1
    iters: int = 8
    mbs: int = 1
    gbs: int = 4
    seq_length: int = 1024
    plugin: tuple[str, ...] = ()  # command-line flags after the YAML; () = upstream as is
    launch: str = "pth"  # "pth": torchrun pretrain_transformers.py ...; "module": -m mindspeed_flow.launch
    ckpt_format: str = "torch"
    save: Optional[str] = None  # checkpoint folder (absolute, or relative to the run's workdir)
    load: Optional[str] = None
    save_interval: Optional[int] = None
    exit_interval: Optional[int] = None
    fsdp2: bool = False  # FSDP2 (the recipe's examples/qwen3vl/fsdp2_config.yaml) instead of Megatron's DDP
    samples: int = 48
    lr: float = 1e-4
    yaml_patch: tuple = ()  # ((dotted.yaml.path, value), ...) applied to the YAML last
    extra_env: tuple = ()  # ((NAME, value), ...) for the run's environment
    timeout_s: int = RUN_TIMEOUT_S
    pp: int = 1  # what the shared report and readers ask of every job
    tp: int = 1

    @property
    def world(self) -> int:
        return self.dp

    @property
    def env(self) -> tuple:
        """The run's environment on top of the harness's: FSDP2 refuses CUDA_DEVICE_MAX_CONNECTIONS=1
        (the recipe's script sets 2)."""
        return ((("CUDA_DEVICE_MAX_CONNECTIONS", "2"),) if self.fsdp2 else ()) + self.extra_env

    @property
    def assets_name(self) -> str:
        return f"qwen3vl_assets_{self.samples}"

    def make_assets(self, root: Path) -> Assets:
        """The corpus of the Qwen2.5-VL job and, as its processor, the Qwen3-VL HF directory."""
        made = make_assets(root, self.samples)
        hf_dir = root / "qwen3vl_hf"
        if not (hf_dir / "model.safetensors").is_file():
            realjob_qwen3vl_assets.make_hf_dir(hf_dir)
        return Assets(hf_dir, made.corpus, made.val_corpus)

    def config(self, sources, workdir: Path, assets: Assets) -> dict:
        """The recipe's YAML with the tiny CPU run's changes."""
        config = yaml.safe_load((sources.mindspeed_mm / RECIPE).read_text())
        gpt = config["gpt_args"]
        # The reader writes `--key value` for every key but a true one: a switch is off by its absence.
        for key in ("fsdp2_config_path", "save", "load", "save_interval", "use_torch_fsdp2",
                    "init_model_with_meta_device"):
            gpt.pop(key, None)
        gpt.update({
            "ckpt_format": self.ckpt_format, "distributed_backend": "gloo",
            "micro_batch_size": self.mbs, "global_batch_size": self.gbs, "train_iters": self.iters,
            "lr": self.lr, "vocab_size": realjob_qwen3vl_assets.VOCAB,
            "seq_length": self.seq_length, "num_workers": 0, "eval_interval": 10 * self.iters, "eval_iters": 1,
            "distributed_timeout_minutes": 4,
        })
        if self.save or self.load:  # exact resume: the optimizer and RNG states too (the recipe skips both)
            for key in ("no_load_optim", "no_load_rng", "no_save_optim", "no_save_rng"):
                gpt.pop(key, None)
        if self.save:  # the reader turns each key into --key value (Megatron's save / resume flags)
            gpt.update({"save": str(workdir / self.save), "save_interval": self.save_interval or self.iters})
        if self.load:
            gpt["load"] = str(workdir / self.load)
        if self.exit_interval:
            gpt["exit_interval"] = self.exit_interval
        if self.fsdp2:
            fsdp2 = workdir / "fsdp2_config.yaml"
            fsdp2.write_text((sources.mindspeed_mm / FSDP2_CONFIG).read_text())
            gpt.update({"use_torch_fsdp2": True, "fsdp2_config_path": str(fsdp2)})
        data = config["data"]["dataset_param"]
        data["preprocess_parameters"].update({
            "model_name_or_path": str(assets.processor), "use_fast_tokenizer": False,
            "image_max_pixels": realjob_qwen3vl_assets.MAX_PIXELS,
            "image_min_pixels": realjob_qwen3vl_assets.MIN_PIXELS,
        })
        data["basic_parameters"].update({
            "dataset_dir": str(assets.corpus.parent), "dataset": str(assets.corpus),
            "cache_dir": str(workdir / "hf_cache"), "preprocessing_num_workers": None,
        })
        config["data"]["dataloader_param"]["pin_memory"] = False
        model = config["model"]
        model["init_from_hf_path"] = str(assets.processor)
        model["patch"]["bridge_patch"] = False
        tools = workdir / "tools.json"
        tools.write_text((sources.mindspeed_mm / "mindspeed_mm" / "tools" / "tools.json").read_text())
        config["MM_TOOL_PATH"] = str(tools)
        for path, value in self.yaml_patch:
            _set_path(config, path, value)
        return config

    def script_and_args(self, sources, workdir: Path, assets: Assets) -> tuple[Path, list[str]]:
        """``pretrain_transformers.py CONFIG.yaml`` (then the plugin's flags); writes the YAML."""
        path = workdir / "qwen3vl.yaml"
        path.write_text(yaml.safe_dump(self.config(sources, workdir, assets), sort_keys=False))
        reader = workdir / READ_YAML
        if not reader.exists():
            reader.parent.mkdir(parents=True, exist_ok=True)
            reader.symlink_to(sources.mindspeed_mm / READ_YAML)
        return sources.mindspeed_mm / "pretrain_transformers.py", [str(path)]

