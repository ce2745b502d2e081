"""``roles.training_log_wrapper`` (feature ``pool``): on an encoder rank of a decoupled layout,
whose optimizer may be Megatron's stub (a frozen ViT) or hold no decoupled-LR group,
MindSpeed-MM's ``training_log`` gets 0.0 for each learning rate it would refuse as ``None``
(``--decoupled-lr``: the decoupled one too, the encoder rank being its role's first and
last stage); a backbone rank's and a co-located job's arguments pass as they are.  The log function is a recorder
and ``megatron.training`` a stand-in holding ``get_args`` only (the wrapper reads
``args.decoupled_lr`` from it; the real one needs Megatron's whole training stack)."""

from __future__ import annotations

import sys
from types import SimpleNamespace

import pytest

from mindspeed_flow.schedule.regions import BACKBONE_REGION, ENCODER_REGION


def logged(monkeypatch, region, decoupled_lr, learning_rate, decoupled_learning_rate):
    from mindspeed_flow.adapters.mindspeed_mm import roles

    monkeypatch.setattr(roles, "role_region", lambda: region)
    monkeypatch.setitem(sys.modules, "megatron.training",
                        SimpleNamespace(get_args=lambda: SimpleNamespace(decoupled_lr=decoupled_lr)))
    seen = {}

    def training_log(loss_dict, total_loss_dict, learning_rate, decoupled_learning_rate, iteration, *rest):
        seen.update(learning_rate=learning_rate, decoupled_learning_rate=decoupled_learning_rate)

    roles.training_log_wrapper(training_log, None, ({}, {}, learning_rate, decoupled_learning_rate, 3), {})
    return seen


@pytest.mark.parametrize("region, decoupled_lr, given, expected", [
    (ENCODER_REGION, None, (None, None), (0.0, None)),  # frozen ViT: the stub optimizer's missing LR
    (ENCODER_REGION, 1e-4, (None, None), (0.0, 0.0)),  # and, under --decoupled-lr, the decoupled one
    (ENCODER_REGION, 1e-4, (2e-5, None), (2e-5, 0.0)),  # a trainable ViT has no decoupled-LR group
    (ENCODER_REGION, None, (2e-5, None), (2e-5, None)),
    (BACKBONE_REGION, 1e-4, (None, None), (None, None)),  # upstream's own checks, as they are
    (None, None, (None, None), (None, None)),  # no decoupled layout
], ids=["frozen", "frozen-decoupled-lr", "trainable-decoupled-lr", "trainable", "backbone", "co-located"])
def test_the_encoder_rank_s_missing_learning_rates_are_zero(monkeypatch, region, decoupled_lr, given, expected):
    seen = logged(monkeypatch, region, decoupled_lr, *given)
    assert (seen["learning_rate"], seen["decoupled_learning_rate"]) == expected
