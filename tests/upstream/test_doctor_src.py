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
}


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
