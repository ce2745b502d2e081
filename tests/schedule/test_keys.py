"""Boundary keys and collective channels (:mod:`mindspeed_flow.schedule.keys`): one parse,
one format, typed parts, and the text programs carry."""

from __future__ import annotations

import pickle

import pytest

from mindspeed_flow.schedule import Action, Kind, OneFOneB, Region, ScheduleError, compose
from mindspeed_flow.schedule.keys import BoundaryKey, BoundaryKind, CollectiveKey


def test_a_key_formats_parses_and_keeps_its_parts():
    key = BoundaryKey("vit", 0, BoundaryKind.ACT)
    assert key == "vit.s0:act" and str(key) == "vit.s0:act" and repr(key) == "'vit.s0:act'"
    assert (key.region, key.stage, key.kind, key.tag) == ("vit", 0, BoundaryKind.ACT, "vit.s0")
    assert BoundaryKey.parse("llm.s12:grad") == BoundaryKey("llm", 12, "grad")
    assert BoundaryKey.parse("a.b.s3:input").region == "a.b"
    assert key.of(BoundaryKind.GRAD) == "vit.s0:grad"
    assert hash(key) == hash("vit.s0:act") and {key: 1}["vit.s0:act"] == 1
    for copy in (pickle.loads(pickle.dumps(key)), pickle.loads(pickle.dumps(CollectiveKey(Kind.GRAD_REDUCE, "vit")))):
        assert type(copy).__name__ in ("BoundaryKey", "CollectiveKey")
    assert pickle.loads(pickle.dumps(key)).kind is BoundaryKind.ACT
    assert CollectiveKey(Kind.PARAM_BROADCAST, "vit") == "BCAST:vit"


@pytest.mark.parametrize("text", ["vit.s0", "vit:act", "vit.sx:act", "vit.s0:fwd", ""])
def test_a_malformed_key_is_refused(text):
    with pytest.raises(ScheduleError, match="boundary key"):
        BoundaryKey.parse(text)


def test_actions_carry_typed_keys():
    action = Action(Kind.SEND_ACT, "llm", 0, 1, peer=1, key="llm.s0:act")
    assert isinstance(action.key, BoundaryKey) and action.carries is BoundaryKind.ACT
    assert Action.from_str(str(action)) == action and isinstance(Action.from_str(str(action)).key, BoundaryKey)
    assert Action(Kind.FORWARD, "llm").carries is None
    with pytest.raises(ScheduleError, match=r"action .*boundary key 'llm\.s0:oops'"):
        Action.from_str("SEND_A llm.s0 mb1 -> r1 [llm.s0:oops]")
    plan = compose([Region("llm", 2, OneFOneB(stages=2))], 2)
    assert all(isinstance(a.key, BoundaryKey) for p in plan.programs.values() for a in p if a.key)
