"""Tests against upstream source checkouts skip for a module that cannot exist on this
machine (triton, imported unconditionally by Megatron-LM HEAD from
``pipeline_parallel/schedules.py``) and fail with the missing module's name otherwise.

The checkouts here are planted trees in the shape of Megatron-LM's (the import chain is
what matters: ``megatron.training`` reaches ``megatron.core.pipeline_parallel.schedules``),
so both outcomes are exercised whatever checkout a machine has.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from subprocess_utils import run_python
from tests.test_doctor import write_tree
from upstream_imports import require_importable

IMPORT_TRAINING = "import megatron.training\nprint('imported')\n"


def plant(root: Path, schedules_imports: str) -> Path:
    return write_tree(root, {
        "megatron/__init__.py": "",
        "megatron/core/__init__.py": "",
        "megatron/core/pipeline_parallel/__init__.py": "from .schedules import get_forward_backward_func\n",
        "megatron/core/pipeline_parallel/schedules.py": schedules_imports + "\ndef get_forward_backward_func():\n    pass\n",
        "megatron/training/__init__.py": "from megatron.core.pipeline_parallel import get_forward_backward_func\n",
    })


def test_a_checkout_that_imports_triton_is_skipped_with_the_reason(tmp_path):
    root = plant(tmp_path, "import os\nimport triton\nimport triton.language as tl\n")
    proc = run_python(IMPORT_TRAINING, env={"PYTHONPATH": str(root)})
    assert proc.returncode != 0  # triton is not installable on this CPU machine
    with pytest.raises(pytest.skip.Exception) as skipped:
        require_importable(proc, str(root))
    reason = str(skipped.value)
    assert "imports triton unconditionally" in reason
    assert f"{root}/megatron/core/pipeline_parallel/schedules.py:2" in reason


def test_a_module_missing_from_the_test_environment_fails_naming_it(tmp_path):
    root = plant(tmp_path, "import os\nimport regex_missing_from_this_environment\n")
    proc = run_python(IMPORT_TRAINING, env={"PYTHONPATH": str(root)})
    with pytest.raises(pytest.fail.Exception) as failed:
        require_importable(proc, str(root))
    message = str(failed.value)
    assert "'regex_missing_from_this_environment'" in message and "schedules.py:2" in message
    assert "pip install -e '.[test]'" in message


def test_an_importable_checkout_passes_through(tmp_path):
    root = plant(tmp_path, "import os\n")
    proc = run_python(IMPORT_TRAINING, env={"PYTHONPATH": str(root)})
    require_importable(proc, str(root))
    assert proc.stdout.strip() == "imported"


def test_megatron_lm_needs_regex_which_the_test_extra_installs():
    """Megatron-LM's megatron.training imports regex (training/tokenizer); it is in the
    ``test`` extra, so the tests against Megatron-LM sources can import it."""
    import configparser

    cfg = configparser.ConfigParser()
    cfg.read(Path(__file__).resolve().parents[2] / "setup.cfg")
    extra = [line.split("#")[0].strip() for line in cfg["options.extras_require"]["test"].splitlines()]
    assert "regex" in extra
    import regex  # noqa: F401  (installed by the extra)
