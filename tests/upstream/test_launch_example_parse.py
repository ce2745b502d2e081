"""``doctor --src``'s launch-script check against the real parser.

The check reads the flags that Megatron, MindSpeed and MindSpeed-MM declare with ``ast``
(``mindspeed_flow.patching.source_flags``).  Here the real parser decides on the same
argument lists: MindSpeed's ``megatron_adaptor`` imported, then exactly what
``mindspeed_mm.training.pretrain`` does (``parse_args_wrapper(parse_args)`` with
``extra_args_provider_decorator(mm_extra_args_provider)``), started through
``mindspeed_flow.launch`` so the plugin's flags are registered as in a job.  Every list
must get the same verdict from both: the plugin's example and upstream's own Qwen2.5-VL
scripts parse, a planted unknown flag and wrong value counts are refused.
Only ``torch_npu`` / ``torchair`` are stood in (``standins/``).
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from harness import upstream_env
from pinned_upstream import upstream_sources

from mindspeed_flow.patching.launch_check import check_launch_script
from mindspeed_flow.patching.launch_script import read_training_command

REPO = Path(__file__).resolve().parents[2]
EXAMPLE = REPO / "scripts" / "mindspeed_mm" / "finetune_qwen2_5_vl_7b_flowtrain.sh"

PROBE = '''
import contextlib, io, json, sys
variants = json.loads(open(sys.argv[-1]).read())
sys.argv = sys.argv[:-1]  # the example's own arguments: what MindSpeed reads at import
import mindspeed.megatron_adaptor  # noqa: F401
from megatron.training.arguments import parse_args
from mindspeed.arguments import parse_args_wrapper
from mindspeed_mm.arguments import extra_args_provider_decorator
from mindspeed_mm.configs.config import mm_extra_args_provider
verdicts = {}
for name, argv in variants.items():
    sys.argv = ["pretrain_vlm.py"] + argv
    err = io.StringIO()
    try:
        with contextlib.redirect_stderr(err):
            args = parse_args_wrapper(parse_args)(extra_args_provider_decorator(mm_extra_args_provider), False)
        verdicts[name] = {"ok": True, "use_flowtrain": getattr(args, "use_flowtrain", None)}
    except SystemExit:
        verdicts[name] = {"ok": False, "error": err.getvalue().strip().splitlines()[-1]}
print(json.dumps(verdicts))
'''


def real_parses(variants: dict[str, list[str]], sources, tmp_path: Path) -> dict[str, dict]:
    """What Megatron's real ``parse_args`` (MindSpeed adaptor, MindSpeed-MM's extra arguments,
    started through ``mindspeed_flow.launch`` with ``variants["example"]``) makes of each
    argument list of ``variants``: ``{"ok": ...}`` or ``{"error": ...}`` per name (:data:`PROBE`)."""
    (tmp_path / "variants.json").write_text(json.dumps(variants))
    (tmp_path / "probe.py").write_text(PROBE)
    proc = subprocess.run([sys.executable, "-m", "mindspeed_flow.launch", "probe.py", *variants["example"],
                           str(tmp_path / "variants.json")], cwd=tmp_path,
                          env=upstream_env(sources, tmp_path), capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


def parser_words(script: Path) -> list[str]:
    """The script's training arguments; shell arithmetic (``$((...))``, not evaluated by the
    reader) becomes 1, a valid value for the integer flags that use it."""
    return ["1" if "$" in w.text else w.text for w in read_training_command(script).args]


def with_script_edit(tmp_path: Path, name: str, old: str, new: str) -> Path:
    text = EXAMPLE.read_text()
    assert text.count(old) == 1
    path = tmp_path / f"{name}.sh"
    path.write_text(text.replace(old, new))
    return path


def test_static_check_and_real_parser_agree(runs, tmp_path):
    """(``runs``: the upstream environment gate, as in the other tests here.)"""
    sources = upstream_sources()
    roots = [sources.mindspeed_mm, sources.mindspeed]
    scripts = {"example": EXAMPLE}
    scripts |= {path.stem: path for path in sorted((sources.mindspeed_mm / "examples" / "qwen2.5vl")
                                                    .glob("finetune_qwen2_5_vl_*b.sh"))}
    scripts["planted"] = with_script_edit(tmp_path, "planted", "    --use-flowtrain\n",
                                          "    --use-flowtrain \\\n    --use-flowtrian\n")
    scripts["store_true_valued"] = with_script_edit(tmp_path, "valued", "    --bf16 \\\n", "    --bf16 true \\\n")
    scripts["value_missing"] = with_script_edit(tmp_path, "missing", "    --seed 42 \\\n", "    --seed \\\n")
    real = real_parses({name: parser_words(path) for name, path in scripts.items()}, sources, tmp_path)

    assert real["example"] == {"ok": True, "use_flowtrain": True}
    assert "unrecognized arguments: --use-flowtrian" in real["planted"]["error"]
    assert "unrecognized arguments: true" in real["store_true_valued"]["error"]
    assert "--seed: expected one argument" in real["value_missing"]["error"]
    for name, script in scripts.items():
        static = check_launch_script(script, roots)
        # upstream's own scripts do not turn the plugin on: that finding is the plugin's rule, not the parser's
        parser_findings = [f for f in static.findings if f.subject != "plugin"]
        assert real[name]["ok"] == (not parser_findings), (name, real[name], parser_findings)
