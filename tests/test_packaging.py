"""``pip install .`` and ``pip install -e .`` both map ``adapters/`` and ``patches/`` into the
package and ship the zero-edit ``.pth`` hook."""

from __future__ import annotations

import importlib.metadata
import json
import subprocess
import sys
import sysconfig
import zipfile
from pathlib import Path

import mindspeed_flow

ROOT = Path(__file__).resolve().parents[1]


def pip(*args: str, cwd: Path = ROOT) -> None:
    proc = subprocess.run([sys.executable, "-m", "pip", "--disable-pip-version-check", "-q", *args],
                          capture_output=True, text=True, timeout=300, cwd=cwd)
    assert proc.returncode == 0, proc.stdout + proc.stderr


def test_wheel_holds_the_mapped_packages_and_the_hook(tmp_path):
    pip("wheel", "--no-deps", "--no-build-isolation", "-w", str(tmp_path), str(ROOT))
    (wheel,) = tmp_path.glob("mindspeed_flow-*.whl")
    names = set(zipfile.ZipFile(wheel).namelist())
    for expected in ["mindspeed_flow/__init__.py", "mindspeed_flow/adapters/__init__.py",
                     "mindspeed_flow/adapters/megatron/training.py", "mindspeed_flow/patches/core.py",
                     "mindspeed_flow/patching/registry.py", "mindspeed_flow_autoload.pth"]:
        assert expected in names, expected
    assert not any(n.startswith(("adapters/", "patches/", "tests/")) for n in names)
    for init in sorted(ROOT.glob("mindspeed_flow/**/__init__.py")):  # no sub-package left out
        assert init.relative_to(ROOT).as_posix() in names, init


def test_plain_install_imports_from_the_installed_copy(tmp_path):
    target = tmp_path / "site"
    pip("install", "--no-deps", "--no-build-isolation", "--target", str(target), str(ROOT))
    code = ("import json, mindspeed_flow.adapters.mindspeed.feature as a, mindspeed_flow.patches.core as p; "
            "print(json.dumps([a.__file__, p.__file__]))")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                          env={"PYTHONPATH": str(target), "PATH": "/usr/bin:/bin"}, cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    for path in json.loads(proc.stdout):
        assert Path(path).is_relative_to(target)
    assert (target / "mindspeed_flow_autoload.pth").is_file()


def installed_distribution() -> importlib.metadata.Distribution:
    """The installed metadata in site-packages (a build leaves an ``.egg-info`` in the tree)."""
    (dist,) = [d for d in importlib.metadata.distributions(path=[sysconfig.get_paths()["purelib"]])
               if d.metadata["Name"] == "mindspeed-flow"]
    return dist


def test_this_environment_is_an_editable_install_of_the_working_tree():
    direct_url = json.loads(installed_distribution().read_text("direct_url.json"))
    assert direct_url["dir_info"].get("editable") is True
    import mindspeed_flow.adapters
    import mindspeed_flow.patches

    assert Path(mindspeed_flow.__file__).parent == ROOT / "mindspeed_flow"
    assert Path(mindspeed_flow.adapters.__file__).parent == ROOT / "adapters"
    assert Path(mindspeed_flow.patches.__file__).parent == ROOT / "patches"


def test_megatron_core_is_an_extra_never_a_requirement():
    requires = installed_distribution().requires or []
    hard = [r for r in requires if "extra ==" not in r]
    assert not any(r.lower().startswith("megatron") for r in hard), hard
    assert any(r.lower().startswith("megatron-core") and 'extra == "megatron"' in r for r in requires)
