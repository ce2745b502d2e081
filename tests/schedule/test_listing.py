"""Programs read back from text, plans dumped, hand-edited, reloaded and diffed (issue 13)."""

from __future__ import annotations

import pytest

from mindspeed_flow.schedule import (
    Action,
    Decoupled,
    Interleaved1F1B,
    Kind,
    OneFOneB,
    Region,
    ScheduleError,
    Transpose,
    ZeroBubbleH1,
    ZeroBubbleV,
    compose,
    validate,
)
from mindspeed_flow.schedule.listing import dump, dumps, format_grid, load, loads

COMPOSITIONS = {
    "transpose-trainable": ([Region("vit", 2, Transpose(max_in_flight=2)), Region("llm", 4, OneFOneB(stages=2))], 4),
    "decoupled-pool": ([Region("vit", 2, Decoupled(ranks=2), trainable=False),
                        Region("llm", 4, OneFOneB(stages=2))], 4),
    "megatron-shared": ([Region("vit", 2, OneFOneB(stages=2, layers=(4, 2)), start=0),
                         Region("llm", 4, OneFOneB(stages=2, layers=(4, 2)), start=2)], 2),
    "interleaved": ([Region("llm", 8, Interleaved1F1B(stages=2, chunks_per_rank=2))], 4),
    "zb-v": ([Region("vit", 1, Transpose(), trainable=False), Region("llm", 8, ZeroBubbleV(stages=2))], 3),
}


@pytest.mark.parametrize("name", sorted(COMPOSITIONS))
def test_every_action_reads_back_from_its_text(name):
    regions, microbatches = COMPOSITIONS[name]
    plan = compose(regions, microbatches)
    actions = [a for program in plan.programs.values() for a in program]
    assert all(Action.from_str(str(a)) == a for a in actions)


def test_all_kinds_are_covered_by_the_round_trip():
    kinds = {a.kind for regions, m in COMPOSITIONS.values() for p in compose(regions, m).programs.values() for a in p}
    kinds |= {a.kind for p in compose([Region("llm", 4, ZeroBubbleH1(stages=2))], 2).programs.values() for a in p}
    assert kinds == set(Kind)


@pytest.mark.parametrize("text, message", [
    ("FWD llm.s0 mb0", r"unknown kind 'FWD'"),
    ("SEND_A llm.s0 mb0 <- r1 [llm.s0:act]", r"a SEND_A takes `-> r<peer>`"),
    ("F llm.s0 mb0 -> r1", r"a F takes no peer"),
    ("F llm mb0", r"cannot read action 'F llm mb0': expected `KIND region.sSTAGE"),
])
def test_unreadable_actions_are_named(text, message):
    with pytest.raises(ScheduleError, match=message):
        Action.from_str(text)


@pytest.mark.parametrize("name", sorted(COMPOSITIONS))
def test_plans_dump_and_load_to_an_equal_plan(name, tmp_path):
    regions, microbatches = COMPOSITIONS[name]
    for semantics in ("eager", "rendezvous"):
        plan = compose(regions, microbatches, semantics=semantics)
        loaded = load(dump(plan, tmp_path / f"{name}.txt"))
        assert loaded == plan
        validate(loaded)


def test_a_hand_edit_is_reloaded_validated_and_diffed():
    plan = compose([Region("llm", 4, ZeroBubbleH1(stages=2))], 3)
    lines = dumps(plan).splitlines()
    # defer rank 0's first weight step to the end of its program: still a valid schedule
    moved = next(i for i, line in enumerate(lines) if line.startswith("r0") and "W      llm.s0 mb0" in line)
    last_of_rank0 = max(i for i, line in enumerate(lines) if line.startswith("r0 "))
    lines.insert(last_of_rank0, lines.pop(moved))
    edited = loads("\n".join(lines))
    validate(edited)
    assert edited.programs[0][-1] == Action(Kind.BACKWARD_WEIGHT, "llm", 0, 0)
    diff = format_grid(edited, against=plan).splitlines()
    assert diff[0].split() == ["Rank", "0", "Rank", "1"]
    assert "W0 llm.s0>F2 llm.s0" in diff[5]  # step 4: F2 now runs where W0 ran
    assert diff[-1] == "Step 10: ->W0 llm.s0"  # W0 now runs last, one step later
    # an edit that breaks the schedule is caught by the validator, naming the line's action
    lines = dumps(plan).splitlines()
    del lines[next(i for i, line in enumerate(lines) if "RECV_G llm.s0 mb1" in line)]
    with pytest.raises(ScheduleError, match=r"has no matching receive on rank 0: missing `RECV_G llm.s0 mb1 <- r1"):
        validate(loads("\n".join(lines)))


def test_grid_is_steps_by_ranks_with_bubbles():
    plan = compose([Region("llm", 2, OneFOneB(stages=2))], 2)
    assert format_grid(plan).splitlines() == [
        "        Rank 0    Rank 1",
        "Step 0: F0 llm.s0",
        "Step 1: F1 llm.s0 F0 llm.s1",
        "Step 2:           B0 llm.s1",
        "Step 3: B0 llm.s0 F1 llm.s1",
        "Step 4:           B1 llm.s1",
        "Step 5: B1 llm.s0",
    ]


@pytest.mark.parametrize("edit, message", [
    (lambda t: t.replace("F      llm.s0 mb0", "FWD    llm.s0 mb0", 1), r"plan.txt:6: action 'FWD +llm.s0 mb0': unknown kind 'FWD'"),
    (lambda t: t.replace("OneFOneB(", "ThreeFThreeB(", 1), r"plan.txt:4: unknown skeleton 'ThreeFThreeB'"),
    (lambda t: t.replace("OneFOneB(stages=2", "OneFOneB(stages=two", 1), r"plan.txt:4: .* is not `Skeleton\(name=literal"),
    (lambda t: t.replace("# microbatches 2\n", ""), r"plan.txt: no `# microbatches N` line"),
    (lambda t: t + "r7 #0   F      llm.s0 mb0\n", r"plan.txt: rank 7 has a program but the regions place 2 ranks"),
    (lambda t: t + "rank0 F llm.s0 mb0\n", r"plan.txt:\d+: expected `r<rank> \[#<n>\] <action>`"),
])
def test_bad_plan_files_name_file_and_line(tmp_path, edit, message):
    path = tmp_path / "plan.txt"
    path.write_text(edit(dumps(compose([Region("llm", 2, OneFOneB(stages=2))], 2))))
    with pytest.raises(ScheduleError, match=message):
        load(path)
    with pytest.raises(ScheduleError, match="cannot read"):
        load(tmp_path / "missing.txt")


def test_plan_command_dumps_checks_and_diffs(tmp_path, capsys):
    import yaml

    from mindspeed_flow.cli import main

    config = tmp_path / "tiny.yaml"
    config.write_text(yaml.safe_dump({
        "devices_per_rank": 1, "num_microbatches": 4, "packing_cv": {"unbalanced": 0.0},
        "regions": {"vit": {"layers": 2, "forward_ms": 100}, "llm": {"layers": 8, "forward_ms": 400}},
        "schedules": [{"name": "zb", "layout": "transpose", "backbone": "zb-h1", "stages": 2}],
    }))
    original = tmp_path / "zb.txt"
    assert main(["plan", "dump", str(config), "zb", "-o", str(original), "--semantics", "rendezvous"]) == 0
    assert "# semantics rendezvous" in original.read_text()
    assert main(["plan", "check", str(original)]) == 0
    out = capsys.readouterr().out
    assert "valid under rendezvous semantics" in out and "Rank 1" in out
    lines = original.read_text().splitlines()
    edited = tmp_path / "edited.txt"
    edited.write_text("\n".join(line for line in lines if "W      llm.s1 mb3" not in line))
    assert main(["plan", "check", str(edited), "--against", str(original)]) == 1
    assert "W llm.s1 mb3 runs 0 times on rank 1, expected once" in capsys.readouterr().err
    assert main(["plan", "dump", str(config), "zb-h2"]) == 1
    assert "no schedule 'zb-h2', expected one of ['zb']" in capsys.readouterr().err
