"""``mindspeed-flow plan CONFIG``: what it prints is the plan ``solve`` returns, the plan
file it writes reads back, the chart is drawn, an infeasible budget is diagnosed."""

from __future__ import annotations

import shlex
from pathlib import Path

from mindspeed_flow import cli
from mindspeed_flow.allocator import AllocationPlan, Profile, ProxyModel, load_config, solve
from mindspeed_flow.allocator.upstream import megatron_args

CONFIG = Path(__file__).resolve().parents[2] / "configs" / "allocator" / "tiny_cpu.yaml"


def test_plan_prints_the_solved_plan_and_writes_it(tmp_path, capsys):
    out, png = tmp_path / "plan.yaml", tmp_path / "rates.png"
    assert cli.main(["plan", str(CONFIG), "--out", str(out), "--png", str(png)]) == 0
    text = capsys.readouterr().out
    config = load_config(CONFIG)
    expected = solve(config.model, config.cluster, ProxyModel(Profile.load(config.profile), config.cluster),
                     config.workload)
    written = AllocationPlan.load(out)
    assert written == expected
    assert [a.backbone for a in written.alternatives] == [a.backbone for a in expected.alternatives]
    p = expected.predicted
    assert f"predicted {p.throughput:.2f} samples/s, MFU {p.mfu:.1%}" in text
    assert f"produces {p.production:10.2f} samples/s" in text and f"consumes {p.consumption:10.2f}" in text
    assert shlex.join(megatron_args(expected)) in text
    assert '"pipeline_num_layers": [' in text and "alternatives (next best backbone shapes)" in text
    assert png.stat().st_size > 10_000 and png.read_bytes()[:4] == b"\x89PNG"


def test_infeasible_config_exits_2_with_the_diagnosis(tmp_path, capsys):
    small = tmp_path / "small.yaml"
    small.write_text(CONFIG.read_text().replace("memory_gib: 4", "memory_gib: 0.001")
                     .replace("profile: profiles/", f"profile: {CONFIG.parent}/profiles/"))
    assert cli.main(["plan", str(small)]) == 2
    err = capsys.readouterr().err
    assert "no feasible plan" in err and "break memory; closest:" in err and "over by" in err


def test_bad_config_names_file_and_key(tmp_path, capsys):
    bad = tmp_path / "bad.yaml"
    bad.write_text(CONFIG.read_text().replace("heads: 4,", "headz: 4,"))
    assert cli.main(["plan", str(bad)]) == 1
    assert "bad.yaml: unknown key model.encoder.headz (known in model.encoder: " in capsys.readouterr().err
    broken = tmp_path / "broken.yaml"
    broken.write_text("model: {encoder: [1, 2\ncluster: x\n")
    assert cli.main(["plan", str(broken)]) == 1  # an error line, not a traceback
    err = capsys.readouterr().err
    assert "broken.yaml: not valid YAML" in err and "line 1, column 18" in err
    typo = tmp_path / "typo.yaml"
    typo.write_text(CONFIG.read_text().replace("devices: 8", "devices: eight"))
    assert cli.main(["plan", str(typo)]) == 1
    assert "typo.yaml: cluster.devices: expected int, got str 'eight'" in capsys.readouterr().err


def test_schedule_plan_actions_keep_their_route():
    assert cli._route_plan(["plan", "dump", "x.yaml", "s"]) == ["plan", "dump", "x.yaml", "s"]
    assert cli._route_plan(["plan", "check", "p.txt"]) == ["plan", "check", "p.txt"]
    assert cli._route_plan(["plan", "c.yaml", "--png", "a.png"]) == ["allocate", "c.yaml", "--png", "a.png"]


def test_decoupled_plan_says_what_upstream_alone_realises():
    from dataclasses import replace

    from mindspeed_flow.allocator.report import describe

    config = load_config(CONFIG)
    config = replace(config, workload=replace(config.workload, placements=("decoupled",)))
    plan = solve(config.model, config.cluster, ProxyModel(Profile.load(config.profile), config.cluster),
                 config.workload)
    text = describe(plan, config, "title")
    assert plan.placement == "decoupled"
    assert (f"realise the backbone's {plan.backbone.devices} devices and the splits; the encoder's own "
            f"{plan.encoder.devices} devices need the decoupled runtime") in text


def test_highs_prints_nothing_unless_asked(capfd):
    """HiGHS writes its banner and log to file descriptor 1 from C, so ``capfd`` (not
    ``capsys``) is what sees them.  In fresh processes (the banner comes once per process,
    at the first ``Highs()``): ``solve`` and ``mindspeed-flow plan`` print none of it,
    ``verbose=True`` prints the banner.  In this process: a verbose solve's log (and
    ``plan --verbose``'s) reaches fd 1, a default solve writes nothing there."""
    from subprocess_utils import run_python

    script = f"""
        import sys
        from mindspeed_flow.allocator import Profile, ProxyModel, load_config, solve
        config = load_config({str(CONFIG)!r})
        proxy = ProxyModel(Profile.load(config.profile), config.cluster)
        solve(config.model, config.cluster, proxy, config.workload, verbose=sys.argv[1] == "verbose")
        """
    quiet, verbose = (run_python(script, [mode]) for mode in ("quiet", "verbose"))
    assert quiet.returncode == 0 and verbose.returncode == 0, quiet.stderr + verbose.stderr
    assert quiet.stdout == "" and "HiGHS" not in quiet.stderr
    assert verbose.stdout.startswith("Running HiGHS")
    plain = run_python("import sys; from mindspeed_flow import cli; sys.exit(cli.main(sys.argv[1:]))",
                       ["plan", str(CONFIG)])
    assert plain.stdout.startswith("plan for tiny VLM (CPU)") and "HiGHS" not in plain.stdout + plain.stderr

    config = load_config(CONFIG)
    proxy = ProxyModel(Profile.load(config.profile), config.cluster)
    capfd.readouterr()
    loud_plan = solve(config.model, config.cluster, proxy, config.workload, verbose=True)
    assert "Presolving model" in capfd.readouterr().out
    assert solve(config.model, config.cluster, proxy, config.workload) == loud_plan
    assert capfd.readouterr() == ("", "")
    assert cli.main(["plan", str(CONFIG), "--verbose"]) == 0
    assert "Presolving model" in capfd.readouterr().out
