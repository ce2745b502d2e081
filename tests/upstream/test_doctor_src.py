"""Test 3: ``mindspeed-flow doctor --src`` on the unpacked pinned sources.

Every declared patch target is found in MindSpeed-MM 57069cd (with its Megatron copy),
MindSpeed 028de58 and Megatron-LM core_v0.12.1.  A rename planted in a copy of MindSpeed-MM
(one MindSpeed-MM target, one Megatron target of its copy) is reported as missing, by
name, with a non-zero exit.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

from pinned_upstream import upstream_sources

PLANTED = {
    "mindspeed_mm/models/vision/vlm_attentionmask_for_llm.py": (
        "def prepare_positionsids_mask_for_llm(", "def prepare_positionsids_mask_for_llm_v2(",
        "mindspeed_mm.models.vision.vlm_attentionmask_for_llm:prepare_positionsids_mask_for_llm"),
    "megatron/core/transformer/dot_product_attention.py": (
        "    def forward(", "    def forward_renamed(",
        "megatron.core.transformer.dot_product_attention:DotProductAttention.forward"),
    "mindspeed_mm/models/transformers/qwen3vl/modules.py": (
        "class Qwen3VLVisionPatchEmbed(", "class Qwen3VLVisionPatchEmbedRenamed(",
        "mindspeed_mm.models.transformers.qwen3vl.modules:Qwen3VLVisionPatchEmbed.__init__"),
}
# What --use-flowtrain patches on pretrain_transformers.py's path (the Qwen3-VL recipes), by
# feature.  conv_matmul's and recipes' act only through these targets here; packing's data targets
# are names pretrain_transformers.py imports (ENTRY_IMPORTS); its schedule and checkpoint targets
# and its accounting's train_step are Megatron's / MindSpeed-MM's loop that the entry script runs.
TRANSFORMERS_PATH = {
    "conv_matmul": ["mindspeed_mm.models.transformers.qwen3vl.modules:Qwen3VLVisionPatchEmbed.__init__"],
    "recipes": ["megatron.core.optimizer:_get_param_groups",
                "megatron.core.optimizer_param_scheduler:OptimizerParamScheduler.get_lr",
                "megatron.core.optimizer.optimizer:ChainedOptimizer.prepare_grads",
                "megatron.training.arguments:validate_args"],
    "packing": ["mindspeed_mm.data:build_mm_dataset", "mindspeed_mm.data:build_mm_dataloader",
                "mindspeed_mm.data.data_utils.utils:build_iterations",
                "megatron.core.pipeline_parallel.schedules:get_forward_backward_func",
                "megatron.training.checkpointing:save_checkpoint", "mindspeed_mm.training:train_step"],
}
ENTRY_IMPORTS = ["mindspeed_mm.data:build_mm_dataset", "mindspeed_mm.data:build_mm_dataloader",
                 "mindspeed_mm.data.data_utils.utils:build_iterations", "mindspeed_mm.training:pretrain"]


def doctor(*roots: Path) -> subprocess.CompletedProcess:
    args = [a for root in roots for a in ("--src", str(root))]
    return subprocess.run([sys.executable, "-m", "mindspeed_flow.cli", "doctor", *args, "--json"],
                          capture_output=True, text=True, timeout=300)


def test_every_declared_target_is_found_in_the_pinned_sources():
    src = upstream_sources()
    proc = doctor(src.mindspeed_mm, src.mindspeed, src.megatron_lm)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    rows = json.loads(proc.stdout)
    assert rows, "doctor checked nothing"
    not_found = [(r["target"], r["status"], r["detail"]) for r in rows if r["status"] != "found"]
    assert not_found == []


def test_a_planted_rename_is_reported_missing_with_a_nonzero_exit(tmp_path):
    src = upstream_sources()
    copy = tmp_path / "MindSpeed-MM"
    shutil.copytree(src.mindspeed_mm, copy, symlinks=True)
    for relative, (old, new, _) in PLANTED.items():
        path = copy / relative
        text = path.read_text()
        assert text.count(old) == 1, f"{relative}: the planted rename no longer applies"
        path.write_text(text.replace(old, new))
    proc = doctor(copy, src.mindspeed, src.megatron_lm)
    assert proc.returncode == 1, proc.stdout + proc.stderr
    rows = {r["target"]: r for r in json.loads(proc.stdout)}
    for _, _, target in PLANTED.values():
        assert rows[target]["status"] == "missing", rows[target]
        assert rows[target]["failure"]
    others = [t for t, r in rows.items() if r["failure"] and t not in {p[2] for p in PLANTED.values()}]
    assert others == []


def imported_names(path: Path) -> set[str]:
    """``module:name`` for every ``from module import name`` of a source file (``.module`` when relative)."""
    import ast

    tree = ast.parse(path.read_text())
    return {f"{'.' * node.level}{node.module}:{alias.name}" for node in ast.walk(tree)
            if isinstance(node, ast.ImportFrom) for alias in node.names}


def test_the_targets_of_the_transformers_path_are_declared_and_found():
    """Every target --use-flowtrain needs on pretrain_transformers.py is a declared patch of its
    feature, found in the pinned sources; the packing targets are the names the entry script
    imports, and the Qwen3-VL patch embedding is the one its model builds."""
    src = upstream_sources()
    proc = doctor(src.mindspeed_mm, src.mindspeed, src.megatron_lm)
    rows = {(r["feature"], r["target"]): r for r in json.loads(proc.stdout)}
    for feature, targets in TRANSFORMERS_PATH.items():
        for target in targets:
            assert rows[(feature, target)]["status"] == "found", rows.get((feature, target))
    entry_imports = imported_names(src.mindspeed_mm / "pretrain_transformers.py")
    assert set(ENTRY_IMPORTS) <= entry_imports
    model = src.mindspeed_mm / "mindspeed_mm" / "models" / "transformers" / "qwen3vl" / "modeling_qwen3_vl.py"
    assert ".modules:Qwen3VLVisionPatchEmbed" in imported_names(model)  # qwen3vl/modules.py, the target's module
