"""Our registry and MindSpeed's real patch manager on the same method (issue 8, defect 1).

MindSpeed's ``Patch.apply_patch`` wraps ``getattr(cls, name)``; for our wrapt wrapper that is
a fresh ``BoundFunctionWrapper``, not the object we installed.  The registry must see that
MindSpeed's wrapper already holds ours (``refresh()`` must not wrap again) and ``remove()``
must leave MindSpeed's wrapper around the very original function.  ``patch_utils.py`` is
loaded from the pinned MindSpeed source (it imports only the standard library); the patched
class lives in a throwaway module so that MindSpeed's ``importlib`` lookups find it.
"""

from __future__ import annotations

import importlib.util
import sys
import textwrap

import pytest

from mindspeed_flow.patching import Patch, PatchRegistry
from pinned_upstream import upstream_sources

MODULE = "msf_ms_manager_target"
CALLS: list[str] = []


def ours(wrapped, instance, args, kwargs):
    CALLS.append("ours")
    return wrapped(*args, **kwargs)


def mindspeed_style_wrapper(fn):
    """Shaped like MindSpeed's feature wrappers (name ends in 'wrapper', functools.wraps)."""
    import functools

    @functools.wraps(fn)
    def wrapper(self, *args, **kwargs):
        CALLS.append("mindspeed")
        return fn(self, *args, **kwargs)

    return wrapper


@pytest.fixture
def patch_utils():
    path = upstream_sources().mindspeed / "mindspeed" / "patch_utils.py"
    spec = importlib.util.spec_from_file_location("mindspeed_patch_utils_real", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    yield module
    module.MindSpeedPatchesManager.patches_info.clear()


@pytest.fixture
def target(tmp_path, monkeypatch):
    (tmp_path / f"{MODULE}.py").write_text(textwrap.dedent("""
        class Attention:
            def forward(self, x):
                return x + 1
    """))
    monkeypatch.syspath_prepend(str(tmp_path))
    module = importlib.import_module(MODULE)
    yield module
    sys.modules.pop(MODULE, None)


def chain(obj) -> list:
    layers = []
    while obj is not None and len(layers) < 16:
        layers.append(obj)
        obj = getattr(obj, "__wrapped__", None)
    return layers


def count_ours(obj) -> int:
    return sum(getattr(layer, "_self_wrapper", None) is ours for layer in chain(obj))


def test_mindspeed_wrapping_ours_is_not_wrapped_again_and_remove_unlinks_ours(patch_utils, target):
    original = vars(target.Attention)["forward"]
    registry = PatchRegistry([Patch(feature="f", target=f"{MODULE}:Attention.forward", wrapper=ours)])
    registry.enable({"f"})
    manager = patch_utils.MindSpeedPatchesManager
    manager.register_patch(f"{MODULE}.Attention.forward", mindspeed_style_wrapper)
    manager.apply_patches()

    assert registry.refresh() == []  # MindSpeed's wrapper already reaches ours
    current = vars(target.Attention)["forward"]
    assert count_ours(current) == 1
    assert chain(current)[-1] is original
    CALLS.clear()
    assert target.Attention().forward(1) == 2
    assert CALLS == ["mindspeed", "ours"]

    registry.remove()
    after = vars(target.Attention)["forward"]
    assert after is current  # MindSpeed's wrapper stays ...
    assert count_ours(after) == 0 and chain(after) == [after, original]  # ... around the very original
    CALLS.clear()
    assert target.Attention().forward(1) == 2
    assert CALLS == ["mindspeed"]


def test_a_foreign_replacement_is_wrapped_and_restored(patch_utils, target):
    """A MindSpeed replacement (not a wrapper) drops ours: refresh wraps it, remove puts it back."""
    def replacement(self, x):
        return x + 10

    registry = PatchRegistry([Patch(feature="f", target=f"{MODULE}:Attention.forward", wrapper=ours)])
    registry.enable({"f"})
    manager = patch_utils.MindSpeedPatchesManager
    manager.register_patch(f"{MODULE}.Attention.forward", replacement)
    manager.apply_patches()
    assert registry.refresh() == [f"{MODULE}:Attention.forward"]
    assert count_ours(vars(target.Attention)["forward"]) == 1
    registry.remove()
    assert vars(target.Attention)["forward"] is replacement
