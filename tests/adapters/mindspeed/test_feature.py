"""mindspeed-flow as a ``MindSpeedFeature``, against MindSpeed's own feature classes.

MindSpeed is not pip-installable, and its ``mindspeed.features_manager`` package imports
every feature (and so ``torch_npu``) in its ``__init__``.  With ``MINDSPEED_SRC`` pointing at
a MindSpeed checkout, the test loads the two real modules that matter
(``features_manager/feature.py`` and ``features_manager/features_manager.py``) from that
checkout, with the package's ``__init__`` skipped, then lets the registry apply our
``set_features_list`` patch and drives MindSpeed's manager the way MindSpeed does.  Then
MindSpeed's real ``MindSpeedPatchesManager`` (``mindspeed/patch_utils.py``) replaces a target
we had wrapped, and our wrapper must end up on top again.
"""

from __future__ import annotations

import os

import pytest

from subprocess_utils import last_json, run_python

MINDSPEED_SRC = os.environ.get("MINDSPEED_SRC")

SCRIPT = r'''
import argparse, importlib, json, sys, types
root = sys.argv[1]
# The package without its __init__ (which imports torch_npu through every feature module).
package = types.ModuleType("mindspeed.features_manager")
package.__path__ = [root + "/mindspeed/features_manager"]
sys.modules["mindspeed.features_manager"] = package
sys.path.insert(0, root)
feature_module = importlib.import_module("mindspeed.features_manager.feature")
package.MindSpeedFeature = feature_module.MindSpeedFeature

from mindspeed_flow.activation import current_registry
from mindspeed_flow.patches import activate
COMMAND_LINE = ["--use-flowtrain", "--no-flow-pool"]
registry = activate(COMMAND_LINE)       # the job's command line, which MindSpeed parses again below
manager_module = importlib.import_module("mindspeed.features_manager.features_manager")
Manager = manager_module.MindSpeedFeaturesManager
Manager.set_features_list([])           # what mindspeed.features_manager does at import
Manager.set_features_list(list(Manager.FEATURES_LIST))   # a second call must not duplicate us
parser = argparse.ArgumentParser(allow_abbrev=False)
Manager.register_features_args(parser)
args = parser.parse_args(COMMAND_LINE)
args.optimization_level = 2
Manager.validate_features_args(args)
other = parser.parse_args(["--use-flowtrain"])   # a command line other than the activation's
other.optimization_level = 2
try:
    Manager.validate_features_args(other)
    refused = None
except ValueError as error:
    refused = str(error)
enabled_before = sorted(registry.enabled)
Manager.apply_features_patches(args)    # MindSpeed tells each feature to register its patches
feature = Manager.FEATURES_LIST[0]

# MindSpeed's own patch manager replaces a target we wrapped (fused_attn's attention forward).
from megatron.core.transformer.dot_product_attention import DotProductAttention
from mindspeed.patch_utils import MindSpeedPatchesManager
def mindspeed_forward(self, query, key, value, attention_mask, attn_mask_type=None, attention_bias=None,
                      packed_seq_params=None):
    raise NotImplementedError("stand-in for MindSpeed's NPU flash-attention forward (same signature)")
ours_before = DotProductAttention.forward
MindSpeedPatchesManager.register_patch(
    "megatron.core.transformer.dot_product_attention.DotProductAttention.forward", mindspeed_forward)
MindSpeedPatchesManager.apply_patches()
statuses = {r.target.split(":")[1]: r.status for r in registry.report()}
print(json.dumps({
    "features": [type(f).__name__ for f in Manager.FEATURES_LIST],
    "is_base": isinstance(feature, feature_module.MindSpeedFeature),
    "name": feature.feature_name,
    "need_apply": feature.is_need_apply(args),
    "need_apply_without_flags": feature.is_need_apply(argparse.Namespace(optimization_level=2)),
    "refused": refused,
    "parsed_pool": args.flow_pool,
    "enabled_before": enabled_before,
    "enabled_after": sorted(registry.enabled),
    "declared": registry.features,
    "was_ours": hasattr(ours_before, "__wrapped__"),
    "ours_on_top_of_mindspeed": getattr(DotProductAttention.forward, "__wrapped__", None) is mindspeed_forward,
    "apply_hook": statuses["MindSpeedPatchesManager.apply_patches"],
    "status": statuses["MindSpeedFeaturesManager.set_features_list"],
}))
'''


@pytest.mark.skipif(not MINDSPEED_SRC, reason="set MINDSPEED_SRC to a MindSpeed checkout to load its feature classes")
def test_flowtrain_is_a_real_mindspeed_feature():
    out = last_json(run_python(SCRIPT, [MINDSPEED_SRC]))
    assert out["features"] == ["FlowTrainFeature"]
    assert out["is_base"] is True
    assert out["name"] == "use_flowtrain"
    # the feature reads the tree resolved at activation (a namespace without our flags has
    # nothing to check against it); MindSpeed's args from another command line are refused
    assert out["need_apply"] is True and out["need_apply_without_flags"] is True
    assert out["refused"].startswith("MindSpeed's arguments disagree with the flags the plugin was activated with")
    assert "--flow-pool-backend: 'shm' in MindSpeed's arguments, None at activation" in out["refused"]
    assert out["parsed_pool"] is False
    # what the command line asks for (--use-flowtrain --no-flow-pool), among the features with
    # patches, enabled at activation; MindSpeed's register_patches enables the same set
    # (the allocator stays off without --flow-allocator-plan)
    assert out["enabled_before"] == out["enabled_after"] == [
        f for f in out["declared"] if f not in ("pool", "allocator")]
    assert out["status"] == "applied"
    assert out["apply_hook"] == "applied"
    assert out["was_ours"] and out["ours_on_top_of_mindspeed"]
