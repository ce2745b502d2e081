"""The by-name assembly of a checkpoint across the decoupled and co-located layouts
(``adapters/megatron/role_checkpoint.py``) on state dicts shaped like Megatron's
``Float16OptimizerWithFloat16Params`` ones; the real job's round trip is
``tests/upstream/test_real_job_decoupled.py``."""

from __future__ import annotations

import pytest
import torch

from mindspeed_flow.adapters.errors import CheckpointFormError
from mindspeed_flow.adapters.megatron import role_checkpoint as rc


def saved(names_per_group: list[list[str]], halves: list[list[str]], lr: float) -> tuple[dict, dict]:
    """An optimizer state dict whose parameter ``n`` has ``exp_avg`` = its index + 1 and its
    main copy filled with ``100 + index``, with the names file beside it."""
    state, groups, index, copies = {}, [], 0, []
    for g, names in enumerate(names_per_group):
        groups.append({"lr": lr, "weight_decay": 0.1 * g, "params": list(range(index, index + len(names)))})
        for name in names:
            state[index] = {"exp_avg": torch.full((2,), float(index + 1)), "step": 4}
            index += 1
        copies.append([torch.full((2,), 100.0 + names.index(n)) for n in halves[g]])
    return ({"optimizer": {"state": state, "param_groups": groups}, "fp32_from_fp16_params": copies},
            {"groups": names_per_group, "main_copies": halves})


def test_a_colocated_stage_0_is_assembled_from_the_encoders_and_the_first_stages_files_by_name():
    encoder = saved([["image_encoder.w", "image_encoder.b"]], [["image_encoder.w"]], lr=1e-3)
    stage0 = saved([["text_decoder.w"], ["text_decoder.norm"]], [["text_decoder.w"], []], lr=1e-3)
    # the co-located optimizer groups by weight decay: ViT and LLM weights in one group
    target = {"groups": [["image_encoder.w", "text_decoder.w"], ["image_encoder.b", "text_decoder.norm"]],
              "main_copies": [["image_encoder.w", "text_decoder.w"], []]}
    out = rc._optimizer_state([stage0, encoder], target)
    inner = out["optimizer"]
    assert [g["params"] for g in inner["param_groups"]] == [[0, 1], [2, 3]]
    # each parameter's moments come from the file and position that held it
    assert [float(inner["state"][i]["exp_avg"][0]) for i in range(4)] == [1.0, 1.0, 2.0, 2.0]
    assert inner["param_groups"][0]["weight_decay"] == 0.0  # the hyper-parameters of its saved group
    assert [float(t[0]) for t in out["fp32_from_fp16_params"][0]] == [100.0, 100.0]


def test_a_parameter_without_saved_state_is_refused_naming_it():
    encoder = saved([["image_encoder.w"]], [[]], lr=1e-3)
    with pytest.raises(CheckpointFormError, match=r"no optimizer state for 1 of this rank's parameters.*text_decoder.w"):
        rc._optimizer_state([encoder], {"groups": [["image_encoder.w", "text_decoder.w"]], "main_copies": []})


def test_the_loader_state_falls_back_to_the_other_layouts_first_stage_folder():
    assert rc.loader_state_fallback("/c/iter_0000004/mp_rank_00/flow_loader_dprank000.pt") == \
        "/c/iter_0000004/mp_rank_00_000/flow_loader_dprank000.pt"
    assert rc.loader_state_fallback("/c/iter_0000004/mp_rank_00_000/flow_loader_dprank000.pt") == \
        "/c/iter_0000004/mp_rank_00/flow_loader_dprank000.pt"
    # torch_dcp: the state lies in the iteration's folder, under one name for every layout
    assert rc.loader_state_fallback("/c/iter_0000004/flow_loader_dprank000.pt") == \
        "/c/iter_0000004/flow_loader_dprank000.pt"


@pytest.mark.parametrize("saved_form, my_form", [("transposed", "colocated"), ("colocated", "transposed"),
                                                 ("transposed", "decoupled"), ("decoupled", "transposed")])
def test_a_transposed_checkpoint_and_the_other_forms_do_not_cross(saved_form, my_form):
    with pytest.raises(CheckpointFormError, match=f"/ckpt/iter_0000004: a {saved_form} checkpoint does not load "
                                                  f"into this {my_form} job"):
        rc.check_forms("/ckpt/iter_0000004", {"form": saved_form, "backbone_pp": 2}, {"form": my_form, "backbone_pp": 2})


def test_another_backbone_pipeline_size_is_refused_naming_both():
    with pytest.raises(CheckpointFormError, match="pipeline size 2 does not load into this colocated job of "
                                                  "pipeline size 4"):
        rc.check_forms("/ckpt", {"form": "decoupled", "backbone_pp": 2}, {"form": "colocated", "backbone_pp": 4})
    rc.check_forms("/ckpt", {"form": "decoupled", "backbone_pp": 2}, {"form": "colocated", "backbone_pp": 2})
