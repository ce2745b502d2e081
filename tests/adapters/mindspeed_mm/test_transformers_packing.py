"""Packing on ``pretrain_transformers.py`` is refused at start-up when the YAML's text decoder
does not run the varlen attention (packed samples would attend to each other), or when
upstream's own text packer is on, or when the loss is weighted per batch row (a packed row is a
whole pack); the recipe's settings (and upstream's defaults) pass.  The
real job is ``tests/upstream/test_real_job_qwen3vl.py``."""

from __future__ import annotations

import pytest
import yaml

from mindspeed_flow.adapters.mindspeed_mm.transformers_packing import packing_refusals
from mindspeed_flow.adapters.mindspeed_mm.transformers_path import fit_to_entry
from mindspeed_flow.config import FlagError, FlowConfig

RECIPE = {"gpt_args": {"micro_batch_size": 1},
          "model": {"text_decoder": {"attn_implementation": "flash_attention_2", "attn_layout": "TND"}}}


def fitted(tmp_path, config: dict, flags: list[str]) -> FlowConfig:
    path = tmp_path / "c.yaml"
    path.write_text(yaml.safe_dump(config))
    argv = ["/mm/pretrain_transformers.py", str(path), *flags]
    return fit_to_entry(FlowConfig.from_argv(argv[1:], {}), argv, {})


def test_the_recipes_varlen_attention_and_upstreams_defaults_pass(tmp_path):
    assert packing_refusals(RECIPE) == [] and packing_refusals({"model": {"text_decoder": {}}}) == []
    assert fitted(tmp_path, RECIPE, ["--use-flowtrain"]).enabled("packing")


@pytest.mark.parametrize("key, value", [("attn_implementation", "sdpa"), ("attn_implementation", "eager"),
                                        ("attn_layout", "BNSD")])
@pytest.mark.parametrize("flags", [["--use-flowtrain"], ["--flow-packing"]])
def test_a_dense_attention_with_packing_is_refused_naming_key_and_value(tmp_path, key, value, flags):
    config = {**RECIPE, "model": {"text_decoder": {**RECIPE["model"]["text_decoder"], key: value}}}
    with pytest.raises(FlagError) as error:
        fitted(tmp_path, config, flags)
    assert f"model.text_decoder.{key} is {value!r}" in str(error.value) and "--no-flow-packing" in str(error.value)
    assert not fitted(tmp_path, config, [*flags, "--no-flow-packing"] if flags[0] != "--flow-packing"
                      else ["--use-flowtrain", "--no-flow-packing"]).enabled("packing")


def test_upstreams_own_packer_with_packing_is_refused(tmp_path):
    config = {**RECIPE, "gpt_args": {"use_txt_dynamic_batching": True}}
    with pytest.raises(FlagError, match="gpt_args.use_txt_dynamic_batching"):
        fitted(tmp_path, config, ["--use-flowtrain"])


@pytest.mark.parametrize("loss_type", ["per_sample_loss", "square_loss"])
def test_a_per_row_loss_type_with_packing_is_refused_naming_key_and_value(tmp_path, loss_type):
    config = {**RECIPE, "model": {**RECIPE["model"], "loss_cfg": {"compute_mode": "default", "loss_type": loss_type}}}
    with pytest.raises(FlagError) as error:
        fitted(tmp_path, config, ["--use-flowtrain"])
    assert f"model.loss_cfg.loss_type is {loss_type!r}" in str(error.value)
    assert not fitted(tmp_path, config, ["--use-flowtrain", "--no-flow-packing"]).enabled("packing")


@pytest.mark.parametrize("loss_type", ["default", "token_loss"])
def test_a_per_token_loss_type_with_packing_passes(loss_type):
    assert packing_refusals({**RECIPE, "model": {**RECIPE["model"], "loss_cfg": {"loss_type": loss_type}}}) == []
