"""The registry against the real megatron-core, in a fresh interpreter: patches wait for the
import, apply on it, reach the package re-export and ``__main__`` aliases, check real
signatures, and undo to the very same objects."""

from __future__ import annotations

from subprocess_utils import last_json, run_python

SCRIPT = r'''
import json, sys
from mindspeed_flow.patching import Patch, PatchError, PatchRegistry

calls = []
def record(label):
    def wrapper(wrapped, instance, args, kwargs):
        calls.append(label)
        return wrapped(*args, **kwargs)
    return wrapper

SCHED = "megatron.core.pipeline_parallel.schedules"
registry = PatchRegistry([
    Patch("schedule", SCHED + ":get_forward_backward_func", wrapper=record("gfbf"), params=""),
    Patch("schedule", "megatron.core.parallel_state:model_parallel_is_initialized",
          wrapper=record("mp_initialized"), params=""),
    Patch("schedule", "megatron.core.transformer.transformer_config:TransformerConfig.__post_init__",
          wrapper=record("post_init"), params="self"),
    Patch("alias", SCHED + ":forward_backward_no_pipelining", wrapper=record("no_pp"),
          params="*, forward_step_func, data_iterator, model, num_microbatches, seq_length, micro_batch_size"),
])
out = {"imported_before": "megatron.core" in sys.modules}
registry.enable({"schedule"})
out["before_import"] = [r.status for r in registry.report()]

import megatron.core.pipeline_parallel as pp
from megatron.core.pipeline_parallel import schedules
from megatron.core.pipeline_parallel.schedules import forward_backward_no_pipelining  # a __main__ alias
from megatron.core.transformer.transformer_config import TransformerConfig
keep = {"no_pp": forward_backward_no_pipelining}  # a dict, not a module global: never rebound
out["after_import"] = [r.status for r in registry.report()]
out["version"] = registry.report()[0].version
out["reexport_patched"] = pp.get_forward_backward_func is schedules.get_forward_backward_func
out["gfbf_wrapped"] = hasattr(schedules.get_forward_backward_func, "__wrapped__")
from megatron.core import parallel_state
out["initialized"] = parallel_state.model_parallel_is_initialized()
TransformerConfig(num_layers=2, hidden_size=8, num_attention_heads=2)
out["calls"] = list(calls)

registry.enable({"alias"})
out["main_alias_rebound"] = forward_backward_no_pipelining is schedules.forward_backward_no_pipelining
out["main_alias_wrapped"] = forward_backward_no_pipelining is not keep["no_pp"]

from mindspeed_flow.patching.patch import format_params, params_of
out["real_params"] = format_params(params_of(schedules.get_forward_backward_func))  # () in 0.12, (pp_size, vp_size) in 0.16
bad = PatchRegistry([Patch("x", SCHED + ":get_forward_backward_func", wrapper=record("x"),
                           params="pipeline_parallel_size", checked=("megatron-core 0.11",))])
try:
    bad.enable({"x"})
    out["bad_error"] = None
except PatchError as err:
    out["bad_error"] = str(err)

registry.remove()
post_init = vars(TransformerConfig)["__post_init__"]
out["restored"] = {
    "reexport": pp.get_forward_backward_func is schedules.get_forward_backward_func,
    "unwrapped": type(schedules.get_forward_backward_func).__name__ == "function",
    "main_alias": forward_backward_no_pipelining is keep["no_pp"],
    "module_attr": schedules.forward_backward_no_pipelining is keep["no_pp"],
    "method": type(post_init).__name__ == "function",
}
calls.clear()
parallel_state.model_parallel_is_initialized()
TransformerConfig(num_layers=2, hidden_size=8, num_attention_heads=2)
out["calls_after_remove"] = calls
print(json.dumps(out))
'''


def test_patches_apply_on_import_of_megatron_core_and_undo_exactly():
    out = last_json(run_python(SCRIPT))
    assert out["imported_before"] is False
    assert out["before_import"] == ["pending", "pending", "pending", "declared"]
    assert out["after_import"] == ["applied", "applied", "applied", "declared"]
    assert out["version"].startswith("megatron-core 0.")
    assert out["reexport_patched"] is True
    assert out["gfbf_wrapped"] is True and out["initialized"] is False
    assert out["calls"] == ["mp_initialized", "post_init"]
    assert out["main_alias_rebound"] and out["main_alias_wrapped"]
    error = out["bad_error"]
    assert error is not None
    for needle in ("get_forward_backward_func", "expected (pipeline_parallel_size)", f"found {out['real_params']}",
                   "megatron-core 0.", "megatron-core 0.11"):
        assert needle in error, (needle, error)
    assert out["restored"] == dict.fromkeys(out["restored"], True)
    assert out["calls_after_remove"] == []
