"""Registry mechanics on a small module written for the test (the real-upstream run is in
tests/patches/test_megatron.py): ordering, idempotence, undo, aliases, conflicts, bad targets."""

from __future__ import annotations

import importlib
import itertools
import sys
import textwrap

import pytest

from mindspeed_flow.patching import Patch, PatchConflictError, PatchError, PatchRegistry

_counter = itertools.count()

TARGET_SOURCE = '''
def greet(name, punctuation="!"):
    return "hello " + name + punctuation

class Engine:
    def run(self, steps, *, verbose=False):
        return steps * 2

    @classmethod
    def build(cls, size):
        return cls()

class Turbo(Engine):
    pass
'''


@pytest.fixture
def target_module(tmp_path, monkeypatch):
    """A fresh, not yet imported module holding functions and classes to patch."""
    name = f"flow_target_{next(_counter)}"
    (tmp_path / f"{name}.py").write_text(TARGET_SOURCE)
    monkeypatch.syspath_prepend(str(tmp_path))
    yield name
    sys.modules.pop(name, None)


def tag(label, log):
    """A wrapper that logs its label, then calls through."""

    def wrapper(wrapped, instance, args, kwargs):
        log.append(label)
        return wrapped(*args, **kwargs)

    return wrapper


def test_declaring_changes_nothing_and_enable_applies_on_import(target_module):
    log = []
    registry = PatchRegistry([Patch("a", f"{target_module}:greet", wrapper=tag("a", log),
                                    params="name, punctuation")])
    assert [r.status for r in registry.report()] == ["declared"]
    registry.enable({"a"})
    assert [r.status for r in registry.report()] == ["pending"]
    module = importlib.import_module(target_module)
    assert [r.status for r in registry.report()] == ["applied"]
    assert module.greet("x") == "hello x!"
    assert log == ["a"]
    registry.remove()


def test_wrappers_compose_by_order_then_feature_and_undo_restores(target_module):
    module = importlib.import_module(target_module)
    original = module.greet
    log = []
    registry = PatchRegistry([
        Patch("zeta", f"{target_module}:greet", wrapper=tag("zeta", log), order=0),
        Patch("alpha", f"{target_module}:greet", wrapper=tag("alpha", log), order=0),
        Patch("outer", f"{target_module}:greet", wrapper=tag("outer", log), order=5),
    ])
    registry.enable({"zeta", "alpha", "outer"})
    module.greet("x")
    # innermost first: (0, alpha), (0, zeta), (5, outer); calls run outermost first
    assert log == ["outer", "zeta", "alpha"]
    registry.remove()
    assert module.greet is original


def test_enable_is_idempotent_and_later_features_rebuild_one_chain(target_module):
    module = importlib.import_module(target_module)
    original = module.greet
    log = []
    registry = PatchRegistry([
        Patch("a", f"{target_module}:greet", wrapper=tag("a", log)),
        Patch("b", f"{target_module}:greet", wrapper=tag("b", log), order=1),
    ])
    registry.enable({"a"})
    registry.enable({"a"})
    module.greet("x")
    assert log == ["a"]
    registry.enable({"b"})
    log.clear()
    module.greet("x")
    assert log == ["b", "a"]
    assert module.greet.__wrapped__.__wrapped__ is original
    registry.remove()
    assert module.greet is original


def test_aliases_copied_with_from_import_are_rebound_and_restored(target_module, tmp_path):
    module = importlib.import_module(target_module)
    original = module.greet
    user = f"{target_module}_user"
    (tmp_path / f"{user}.py").write_text(f"from {target_module} import greet as say\n")
    user_module = importlib.import_module(user)
    main = sys.modules["__main__"]
    main.flow_test_alias = original
    try:
        log = []
        registry = PatchRegistry([Patch("a", f"{target_module}:greet", wrapper=tag("a", log))])
        registry.enable({"a"})
        assert user_module.say is module.greet and user_module.say is not original
        assert main.flow_test_alias is module.greet
        user_module.say("y")
        assert log == ["a"]
        registry.remove()
        assert user_module.say is original and main.flow_test_alias is original
    finally:
        del main.flow_test_alias
        sys.modules.pop(user, None)


def test_methods_classmethods_and_inherited_attributes(target_module):
    module = importlib.import_module(target_module)
    log = []
    registry = PatchRegistry([
        Patch("a", f"{target_module}:Engine.run", wrapper=tag("run", log), params="self, steps, *, verbose"),
        Patch("a", f"{target_module}:Engine.build", wrapper=tag("build", log), params="cls, size"),
        Patch("a", f"{target_module}:Turbo.run", wrapper=tag("turbo", log), params="self, steps"),
    ])
    registry.enable({"a"})
    assert module.Engine().run(3) == 6
    assert isinstance(module.Engine.build(1), module.Engine)
    assert module.Turbo().run(2) == 4
    assert log == ["run", "build", "turbo", "run"]
    registry.remove()
    assert "run" not in vars(module.Turbo)  # inherited attribute removed again, not shadowed
    log.clear()
    module.Turbo().run(1)
    assert log == []


def test_two_replacements_conflict_naming_both_features(target_module):
    registry = PatchRegistry([
        Patch("packing", f"{target_module}:greet", replacement=lambda name: name),
        Patch("schedule", f"{target_module}:greet", replacement=lambda name: name),
    ])
    with pytest.raises(PatchConflictError, match="'packing' and 'schedule'"):
        registry.enable({"packing", "schedule"})


def test_replacement_with_wrapper_around_it(target_module):
    module = importlib.import_module(target_module)
    log = []
    registry = PatchRegistry([
        Patch("a", f"{target_module}:greet", replacement=lambda name, punctuation="?": "hi " + name),
        Patch("b", f"{target_module}:greet", wrapper=tag("b", log)),
    ])
    registry.enable({"a", "b"})
    assert module.greet("z") == "hi z" and log == ["b"]
    registry.remove()
    assert module.greet("z") == "hello z!"


def test_changed_signature_fails_loudly_at_enable(target_module):
    importlib.import_module(target_module)
    registry = PatchRegistry([Patch("a", f"{target_module}:greet", wrapper=tag("a", []),
                                    params="name, greeting", checked=("demo 1.0",))])
    with pytest.raises(PatchError) as err:
        registry.enable({"a"})
    message = str(err.value)
    assert f"{target_module}:greet" in message
    assert "expected (name, greeting)" in message and "found (name, punctuation)" in message
    assert "demo 1.0" in message


def test_missing_target_fails_before_import_from_source(target_module):
    """The module is not imported yet: its source on sys.path is read at enable time."""
    registry = PatchRegistry([Patch("a", f"{target_module}:vanished", wrapper=tag("a", []))])
    with pytest.raises(PatchError, match="vanished is not defined"):
        registry.enable({"a"})
    assert target_module not in sys.modules


def test_optional_patch_on_missing_target_is_skipped_and_reported(target_module):
    module = importlib.import_module(target_module)
    registry = PatchRegistry([
        Patch("a", f"{target_module}:Engine.stop", wrapper=tag("a", []), optional=True),
        Patch("a", f"{target_module}:greet", wrapper=tag("a", []), params="who", optional=True),
    ])
    registry.enable({"a"})
    statuses = [(r.status, r.detail) for r in registry.report()]
    assert statuses[0][0] == "skipped" and "missing" in statuses[0][1] and "stop" in statuses[0][1]
    assert statuses[1][0] == "skipped" and "signature changed" in statuses[1][1]
    assert not hasattr(module.greet, "__wrapped__")


def test_unknown_feature_is_an_error_listing_the_known_ones(target_module):
    registry = PatchRegistry([Patch("a", f"{target_module}:greet", wrapper=tag("a", []))])
    with pytest.raises(ValueError, match=r"unknown feature\(s\) \['b'\].*\['a'\]"):
        registry.enable({"b"})


def test_malformed_declarations_are_rejected():
    with pytest.raises(ValueError, match="package.module:Qualified.name"):
        Patch("a", "no_colon_here", wrapper=tag("a", []))
    with pytest.raises(ValueError, match="exactly one of"):
        Patch("a", "m:f")
    with pytest.raises(PatchConflictError, match="declared twice"):
        PatchRegistry([Patch("a", "m:f", wrapper=tag("a", [])), Patch("a", "m:f", wrapper=tag("b", []))])


def test_source_reader_follows_reexports_and_reads_parameters(tmp_path):
    from mindspeed_flow.patching.source import SourceMissing, find_in_source

    pkg = tmp_path / "pkg"
    (pkg / "sub").mkdir(parents=True)
    (pkg / "__init__.py").write_text("from .sub.impl import run as start\n")
    (pkg / "sub" / "__init__.py").write_text("")
    (pkg / "sub" / "impl.py").write_text(textwrap.dedent('''
        try:
            import fast
        except ImportError:
            def run(a, /, b, *rest, c, **kw):
                pass
        class Box:
            def __init__(self, size):
                pass
    '''))
    hit = find_in_source("pkg", "start", [tmp_path])
    assert hit.file.name == "impl.py"
    assert hit.params == [("a", "positional"), ("b", "positional"), ("rest", "var_positional"),
                          ("c", "keyword"), ("kw", "var_keyword")]
    assert find_in_source("pkg.sub.impl", "Box", [tmp_path]).params == [("self", "positional"), ("size", "positional")]
    assert find_in_source("pkg.nothing", "x", [tmp_path]) is None
    with pytest.raises(SourceMissing, match="Box.close is not defined"):
        find_in_source("pkg.sub.impl", "Box.close", [tmp_path])


def test_refresh_reapplies_over_a_foreign_replacement_and_keeps_a_foreign_wrapper(target_module):
    """What MindSpeed's patch manager does to a target we patched first."""
    import functools

    module = importlib.import_module(target_module)
    log = []
    registry = PatchRegistry([Patch("a", f"{target_module}:greet", wrapper=tag("ours", log))])
    registry.enable({"a"})
    ours = module.greet

    @functools.wraps(ours)
    def foreign_wrapper(*args, **kwargs):
        log.append("foreign wrapper")
        return ours(*args, **kwargs)

    module.greet = foreign_wrapper
    assert registry.refresh() == []  # ours is still inside: no second layer
    module.greet("x")
    assert log == ["foreign wrapper", "ours"]

    def foreign_replacement(name, punctuation="."):
        log.append("foreign replacement")
        return "bye " + name

    module.greet = foreign_replacement
    log.clear()
    assert registry.refresh() == [f"{target_module}:greet"]
    assert module.greet("x") == "bye x"
    assert log == ["ours", "foreign replacement"]
    registry.remove()
    assert module.greet is foreign_replacement
