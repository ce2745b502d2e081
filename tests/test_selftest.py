"""``mindspeed-flow selftest``: routed to the checkout's ``scripts/selftest.py`` from an editable
install, a clear refusal from an installed (non-editable) copy of the package."""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
from pathlib import Path

import mindspeed_flow
from mindspeed_flow.selftest import SCRIPT, checkout_root, selftest_command

REPO = Path(__file__).resolve().parents[1]


def cli(*args: str, **kwargs) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "mindspeed_flow.cli", *args], capture_output=True,
                          text=True, timeout=300, **kwargs)


def test_help_names_the_options_and_the_checkout_requirement():
    proc = cli("selftest", "--help")
    assert proc.returncode == 0, proc.stderr
    for option in ("--only SECTION", "--list", "--out DIR"):
        assert option in proc.stdout
    assert "runs that script when the package is an editable install" in " ".join(proc.stdout.split())


def test_editable_checkout_routes_to_its_script():
    assert checkout_root() == REPO  # the suite runs from the editable install of this checkout
    command = selftest_command(REPO, ["--only", "packing"])
    assert command == [sys.executable, str(REPO / SCRIPT), "--only", "packing"]


def test_list_names_every_section_of_the_script():
    proc = cli("selftest", "--list")
    assert proc.returncode == 0, proc.stderr
    names = [line.split()[0] for line in proc.stdout.splitlines() if line.strip()]
    assert names == ["doctor", "megatron-pp2", "packing", "attention", "schedules"]


def test_only_runs_that_section_for_real(tmp_path):
    proc = cli("selftest", "--only", "packing", "--out", str(tmp_path))
    assert proc.returncode == 0, proc.stdout + proc.stderr
    headers = re.findall(r"^=== \d+\. .*\[(\S+)\]", proc.stdout, flags=re.M)
    assert headers == ["packing"]
    packs, bound = (int(x.replace(",", "")) for x in
                    re.search(r"([\d,]+) packs, lower bound ([\d,]+)", proc.stdout).groups())
    assert bound <= packs <= 1.05 * bound
    dispatched, round_robin = map(float, re.search(r"dispatch ([\d.]+), round-robin ([\d.]+)", proc.stdout).groups())
    assert 1.0 <= dispatched < round_robin  # cost-balanced dispatch beats round-robin on the same packs


def test_unknown_section_is_named_with_the_valid_ones():
    proc = cli("selftest", "--only", "no-such-section")
    assert proc.returncode == 2
    assert "--only no-such-section: no such section (sections: doctor, megatron-pp2" in proc.stderr


def installed_copy(site: Path) -> Path:
    """The package laid out as a (non-editable) pip install puts it: no checkout around it."""
    ignore = shutil.ignore_patterns("__pycache__")
    package = site / "mindspeed_flow"
    shutil.copytree(Path(mindspeed_flow.__file__).resolve().parent, package, ignore=ignore)
    for folder in ("adapters", "patches", "train"):  # setup.cfg's package_dir
        shutil.copytree(REPO / folder, package / folder, ignore=ignore)
    return package


def test_installed_copy_says_the_selftest_needs_a_source_checkout(tmp_path):
    package = installed_copy(tmp_path / "site-packages")
    assert checkout_root(package) is None
    proc = cli("selftest", "--only", "packing", cwd=tmp_path,
               env={"PYTHONPATH": str(package.parent), "PATH": "/usr/bin:/bin", "PYTHONNOUSERSITE": "1"})
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert "the self-test needs a source checkout" in proc.stderr
    assert str(package) in proc.stderr
    assert "===" not in proc.stdout  # nothing ran
