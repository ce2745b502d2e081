"""Megatron ``--ckpt-format torch`` checkpoints across the decoupled and the co-located layout.

A decoupled job's ranks save the files of their own role's Megatron config (the encoder ranks
``mp_rank_TT``: ``image_encoder.*``; the backbone's stages ``mp_rank_TT_PPP``:
``text_decoder.*``); a co-located job at the same pipeline size saves ``mp_rank_TT_PPP`` with
the ViT in stage 0's file.  Model entries are named alike in both (the LLM's layer numbers are
per stage, and the stages are the same), but the non-distributed optimizer's state is indexed
by position in its parameter groups, and the positions differ.  So every save of a job with
the ``pool`` feature also writes, per file, the names of its optimizer's parameters in that
order (:data:`PARAM_NAMES`), and the iteration's form (:data:`FORM`: decoupled, co-located or
transposed, the backbone's pipeline size).

On load (:func:`load_base_checkpoint_wrapper`, around Megatron's ``_load_base_checkpoint``)
a checkpoint of the other form is assembled for this rank from the files that hold its
parameters, by name: the model entries, each parameter's optimizer state and fp32 main copy,
the group hyper-parameters; the rest (iteration, arguments, scheduler, RNG) from the file of
the same pipeline stage.  Megatron's own ``load_checkpoint`` then loads it (strict model load,
``optimizer.load_state_dict``, the argument checks with this job's TP / PP).  A checkpoint of
the same form, or one without the form file (saved without the plugin), loads as Megatron
loads it.  A transposed checkpoint (stages > 0 hold a ViT replica each) and the other forms
do not cross: refused naming both forms (:func:`check_forms`).
"""

from __future__ import annotations

import json
import os
from typing import Any, Callable

from mindspeed_flow.adapters.errors import CheckpointFormError
from mindspeed_flow.schedule.regions import ENCODER_REGION

FORM = "flow_checkpoint_form.json"
PARAM_NAMES = "flow_param_names.json"
DECOUPLED, COLOCATED, TRANSPOSED = "decoupled", "colocated", "transposed"
ENCODER_PREFIX, BACKBONE_PREFIX = "image_encoder.", "text_decoder."

# the model and optimizer of the load in progress (``load_checkpoint``'s arguments)
_LOADING: dict[str, Any] = {}


def _model_name(name: str) -> str:
    while name.startswith("module."):
        name = name[len("module."):]
    return name


def single_optimizer(optimizer: Any) -> Any:
    """The one non-distributed optimizer whose state dict a file holds (a ``ChainedOptimizer``
    of one saves its member's), or ``None`` (several chained, or a distributed optimizer)."""
    chained = getattr(optimizer, "chained_optimizers", None)
    if chained is not None:
        optimizer = chained[0] if len(chained) == 1 else None
    return None if optimizer is None or hasattr(optimizer, "gbuf_ranges") else optimizer


def optimizer_param_names(optimizer: Any, model: list) -> dict[str, list[list[str]]]:
    """The names of ``optimizer``'s parameters, per inner parameter group in the order its
    ``state_dict`` indexes them (``"groups"``), and of those with an fp32 main copy
    (``"main_copies"``: the ``fp32_from_fp16_params`` lists), as the model's state dict names
    them.  Megatron's non-distributed optimizers only (a stub one, on a rank that trains
    nothing such as a frozen ViT's encoder rank, has none)."""
    optimizer = single_optimizer(optimizer)
    if optimizer is None:
        raise CheckpointFormError("only the state of Megatron's non-distributed optimizer (one, or one chained) "
                                  "is mapped across the decoupled and co-located layouts")
    names = {id(p): _model_name(n) for chunk in model for n, p in chunk.named_parameters()}
    model_param = {}
    for group16, group32 in zip(getattr(optimizer, "float16_groups", []),
                                getattr(optimizer, "fp32_from_float16_groups", [])):
        model_param.update({id(main): half for half, main in zip(group16, group32)})
    groups = [[names[id(model_param.get(id(p), p))] for p in group["params"]]
              for group in optimizer.param_groups]  # the inner optimizer's; [] for a stub
    copies = [[names[id(p)] for p in group] for group in getattr(optimizer, "float16_groups", [])]
    return {"groups": groups, "main_copies": copies}


def _job_form() -> dict[str, Any]:
    from megatron.core import mpu

    from mindspeed_flow.adapters.megatron.roles import ROLES

    from mindspeed_flow.adapters.mindspeed_mm.transpose import transposed

    layout = ROLES.layout
    if layout is not None:
        return {"form": DECOUPLED, "backbone_pp": layout.backbone_pp}
    return {"form": TRANSPOSED if transposed() else COLOCATED,
            "backbone_pp": mpu.get_pipeline_model_parallel_world_size()}


def check_forms(base: str, saved: dict[str, Any], mine: dict[str, Any]) -> None:
    """Refuse a checkpoint of form ``saved`` that this job's form ``mine`` cannot be assembled
    from, naming both: another backbone pipeline size (the LLM's stages must be the same), or
    a transposed checkpoint into another form or back (mapping the ViT replicas of stages > 0
    is not supported in this version)."""
    if TRANSPOSED in (saved["form"], mine["form"]) and saved["form"] != mine["form"]:
        raise CheckpointFormError(
            f"{base}: a {saved['form']} checkpoint does not load into this {mine['form']} job: checkpoints "
            f"cross between the decoupled and the co-located layout only (a transposed job's stages > 0 hold "
            f"ViT replicas, which are not mapped in this version)")
    if saved["backbone_pp"] != mine["backbone_pp"]:
        raise CheckpointFormError(
            f"{base}: a {saved['form']} checkpoint of backbone pipeline size {saved['backbone_pp']} does not load "
            f"into this {mine['form']} job of pipeline size {mine['backbone_pp']} (the LLM's stages must be the same)")


def save_checkpoint_wrapper(wrapped: Callable, instance: Any, args: tuple, kwargs: dict) -> Any:
    """``save_checkpoint``, then this file's parameter names and (global rank 0) the form."""
    result = wrapped(*args, **kwargs)
    from megatron.core import mpu
    from megatron.training import get_args
    from megatron.training.checkpointing import get_checkpoint_name

    margs = get_args()
    iteration, model, optimizer = args[0], args[1], args[2]
    if margs.ckpt_format != "torch" or not margs.save or optimizer is None or kwargs.get("non_persistent_ckpt"):
        return result
    import torch.distributed as dist

    if mpu.get_data_parallel_rank() == 0 and single_optimizer(optimizer) is not None:
        path = os.path.join(os.path.dirname(get_checkpoint_name(margs.save, iteration)), PARAM_NAMES)
        _write_json(path, optimizer_param_names(optimizer, model))
    if dist.get_rank() == 0:
        _write_json(os.path.join(get_checkpoint_name(margs.save, iteration, return_base_dir=True), FORM), _job_form())
    dist.barrier()
    return result


def _write_json(path: str, value: Any) -> None:
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path + ".tmp", "w") as out:
        json.dump(value, out)
    os.replace(path + ".tmp", path)


def load_checkpoint_wrapper(wrapped: Callable, instance: Any, args: tuple, kwargs: dict) -> Any:
    """``load_checkpoint(ddp_model, optimizer, ...)`` with its model and optimizer known to
    :func:`load_base_checkpoint_wrapper` while it runs."""
    _LOADING.update(model=args[0] if args else kwargs.get("ddp_model"),
                    optimizer=args[1] if len(args) > 1 else kwargs.get("optimizer"))
    try:
        return wrapped(*args, **kwargs)
    finally:
        _LOADING.clear()


def load_base_checkpoint_wrapper(wrapped: Callable, instance: Any, args: tuple, kwargs: dict) -> Any:
    """``_load_base_checkpoint(load_dir, args, rank0=False, ...)``: a checkpoint of the other
    layout's form assembled for this rank (see the module docstring); Megatron's own
    otherwise."""
    load_dir = args[0] if args else kwargs.get("load_dir")
    margs = args[1] if len(args) > 1 else kwargs.get("args")
    rank0 = args[2] if len(args) > 2 else kwargs.get("rank0", False)
    if rank0 or not load_dir or margs is None or margs.ckpt_format != "torch" or not _LOADING:
        return wrapped(*args, **kwargs)
    from megatron.training.checkpointing import get_checkpoint_name, get_checkpoint_tracker_filename, read_metadata

    tracker = get_checkpoint_tracker_filename(load_dir)
    if not os.path.isfile(tracker):
        return wrapped(*args, **kwargs)
    iteration, release = read_metadata(tracker)
    if getattr(margs, "ckpt_step", None):  # --ckpt-step picks the iteration, as in Megatron's own load
        iteration = margs.ckpt_step
    base = get_checkpoint_name(load_dir, iteration, release, return_base_dir=True)
    form_file = os.path.join(base, FORM)
    if not os.path.isfile(form_file):
        return wrapped(*args, **kwargs)
    with open(form_file) as f:
        saved = json.load(f)
    mine = _job_form()
    if saved["form"] == mine["form"]:
        return wrapped(*args, **kwargs)
    check_forms(base, saved, mine)
    if margs.use_distributed_optimizer:
        raise CheckpointFormError(f"{base}: a {saved['form']} checkpoint loads into a {mine['form']} job only with "
                                  "Megatron's non-distributed optimizer (drop --use-distributed-optimizer)")
    sources = _sources(base, saved, mine)
    state = assemble(sources, optimizer_param_names(_LOADING["optimizer"], _LOADING["model"]) if
                     _LOADING.get("optimizer") is not None and not margs.no_load_optim else None)
    state["args"] = _with_parallel_sizes(state.get("args"), margs)
    from megatron.training.checkpointing import CheckpointType

    return state, sources[0]["path"], release, CheckpointType.LEGACY


def _file(base: str, pipeline: bool, stage: int) -> str:
    from megatron.core import mpu

    tp = mpu.get_tensor_model_parallel_rank()
    folder = f"mp_rank_{tp:02d}_{stage:03d}" if pipeline else f"mp_rank_{tp:02d}"
    return os.path.join(base, folder, "model_optim_rng.pt")


def _sources(base: str, saved: dict, mine: dict) -> list[dict[str, Any]]:
    """The files (path, the name prefix taken from it) this rank's parameters are in; the
    first also gives the iteration, arguments, scheduler and RNG state."""
    from megatron.core import mpu

    from mindspeed_flow.adapters.mindspeed_mm.roles import role_region

    pp = saved["backbone_pp"]
    if mine["form"] == DECOUPLED:  # from a co-located checkpoint
        if role_region() == ENCODER_REGION:
            return [{"path": _file(base, pp > 1, 0), "prefix": ENCODER_PREFIX}]
        stage = mpu.get_pipeline_model_parallel_rank()
        return [{"path": _file(base, pp > 1, stage), "prefix": BACKBONE_PREFIX}]
    if pp < 2:
        raise CheckpointFormError(f"{base}: a decoupled checkpoint of an unpipelined backbone (its encoder's and "
                                  "backbone's files share a name) is not supported")
    stage = mpu.get_pipeline_model_parallel_rank()
    own = [{"path": _file(base, True, stage), "prefix": BACKBONE_PREFIX}]
    return own + ([{"path": _file(base, False, 0), "prefix": ENCODER_PREFIX}] if stage == 0 else [])


def _load(path: str) -> tuple[dict, dict]:
    import torch

    names_file = os.path.join(os.path.dirname(path), PARAM_NAMES)
    if not os.path.isfile(path):
        raise CheckpointFormError(f"{path}: missing (needed to assemble this rank's checkpoint)")
    if not os.path.isfile(names_file):
        raise CheckpointFormError(f"{names_file}: missing; the checkpoint was saved without the plugin's pool "
                                  "feature, so its optimizer state cannot be mapped by name")
    with open(names_file) as f:
        return torch.load(path, map_location="cpu", weights_only=False), json.load(f)


def assemble(sources: list[dict[str, Any]], target: dict | None) -> dict:
    """This rank's state dict from ``sources`` (each ``path`` and name ``prefix``): the model
    entries under the prefixes, and, for ``target`` (:func:`optimizer_param_names` of this
    job's optimizer; ``None``: no optimizer state), each parameter's optimizer state and main
    copy found by name."""
    loaded = [(_load(s["path"]), s["prefix"]) for s in sources]
    (first, _), _ = loaded[0]
    state = dict(first)
    state["model"] = {k: v for (sd, _), prefix in loaded for k, v in sd["model"].items() if k.startswith(prefix)}
    if target is not None:
        state["optimizer"] = _optimizer_state([(sd["optimizer"], names) for (sd, names), _ in loaded], target)
    return state


def _optimizer_state(saved: list[tuple[dict, dict]], target: dict) -> dict:
    """An optimizer state dict in ``target``'s parameter order, from the ``saved`` ones (each
    with its names) by parameter name."""
    entries: dict[str, tuple[dict, Any, Any]] = {}  # name -> (group hyper-parameters, state, main copy)
    for optimizer, names in saved:
        inner = optimizer.get("optimizer", optimizer)
        copies = optimizer.get("fp32_from_fp16_params", [])
        for g, (group, group_names) in enumerate(zip(inner["param_groups"], names["groups"])):
            main = dict(zip(names["main_copies"][g], copies[g])) if copies else {}
            for index, name in zip(group["params"], group_names):
                entries[name] = (group, inner["state"].get(index), main.get(name))
    missing = sorted({n for group in target["groups"] for n in group} - set(entries))
    if missing:
        raise CheckpointFormError(f"the checkpoint has no optimizer state for {len(missing)} of this rank's "
                                  f"parameters, e.g. {missing[:3]}")
    state, groups, index = {}, [], 0
    for group_names in target["groups"]:
        hyper = {k: v for k, v in entries[group_names[0]][0].items() if k != "params"} if group_names else {}
        params = []
        for name in group_names:
            if entries[name][1] is not None:
                state[index] = entries[name][1]
            params.append(index)
            index += 1
        groups.append({**hyper, "params": params})
    inner = {"state": state, "param_groups": groups}
    if not target["main_copies"]:
        return inner
    first = saved[0][0]
    out = {k: v for k, v in first.items() if k not in ("optimizer", "fp32_from_fp16_params")}
    out.update(optimizer=inner, fp32_from_fp16_params=[[entries[n][2] for n in group]
                                                        for group in target["main_copies"]])
    return out


def _with_parallel_sizes(saved_args: Any, margs: Any) -> Any:
    """The saved arguments with this job's TP / PP (Megatron checks them against its own)."""
    if saved_args is None:
        return None
    import copy

    out = copy.copy(saved_args)
    out.tensor_model_parallel_size = margs.tensor_model_parallel_size
    out.pipeline_model_parallel_size = margs.pipeline_model_parallel_size
    return out


def loader_state_fallback(path: str) -> str:
    """A decoding rank's loader state under the other layout's file names: the encoder's
    ``mp_rank_TT`` and the first stage's ``mp_rank_TT_000`` decode the same packs.  A path
    outside an ``mp_rank`` folder (``torch_dcp``: the iteration's folder, one name for every
    layout) is its own other name."""
    folder, name = os.path.split(path)
    parent, leaf = os.path.split(folder)
    if not leaf.startswith("mp_rank_"):
        return path
    other = leaf[: len("mp_rank_00")] if leaf.count("_") == 3 else f"{leaf}_000"
    return os.path.join(parent, other, name)
