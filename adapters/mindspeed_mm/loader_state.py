"""The packing loader's state beside Megatron's checkpoints (feature ``packing``): where it
lies, which file a rank resumes from, reading it back and writing it.

Upstream does not save its loader's position.  With ``--flow-packing``:

- after ``save_checkpoint``, each decoding rank's loader state is written as
  ``flow_loader_dprank{DP:03d}.pt`` in the checkpoint's directory (Megatron's
  ``get_checkpoint_name`` layout; :func:`loader_state_path`).  Under a decoupled layout an
  encoder rank decodes its slice's packs too, but only the slice's first backbone stage
  writes them: its position is the trained step's, while a frozen ViT's encoder rank under
  the flow has read the next step's microbatches already (it runs ahead);
- after a checkpoint load (``args.iteration > 0``) ``build_mm_dataloader``'s loader resumes
  from the state saved beside that checkpoint (:func:`resume_loader`); an encoder rank
  loads its slice's first backbone stage's file (:func:`loader_state_to_load`), so what it
  had encoded ahead is read and encoded again.

The wrappers that call these (``build_dataloader``, ``save_checkpoint``) and the live
iterators whose states are saved are in :mod:`.data`.  Nothing upstream is imported at
module level.
"""

from __future__ import annotations

import logging
import os
from typing import Any, Iterable

import torch

from mindspeed_flow.data import FlowDataLoader
from mindspeed_flow.schedule.regions import ENCODER_REGION

from .roles import role_region

log = logging.getLogger(__name__)


def loader_state_path(checkpoints: str, iteration: int, dp_rank: int, split: str = "train",
                      ckpt_format: str = "torch") -> str:
    """Where a decoding rank's loader state lies beside a checkpoint (the validation
    loader's under its own name): in the ``mp_rank_XX`` folder of Megatron's
    ``get_checkpoint_name`` layout, or, for ``torch_dcp`` (FSDP2), in the iteration's folder
    itself: Megatron reads a folder holding ``mp_rank_0*`` as a ``torch`` checkpoint
    (``checkpointing._get_checkpoint_format``), so a loader state there made the resume look
    for ``model_optim_rng.pt``."""
    from megatron.training.checkpointing import get_checkpoint_name

    kind = "" if split == "train" else f"{split}_"
    basename = f"flow_loader_{kind}dprank{dp_rank:03d}.pt"
    if ckpt_format == "torch_dcp":
        return os.path.join(get_checkpoint_name(checkpoints, iteration, return_base_dir=True), basename)
    return get_checkpoint_name(checkpoints, iteration, basename=basename)


def loader_state_to_load(path: str) -> str:
    """The loader state file a decoding rank resumes from, given its own name ``path``: its
    own, or the other layout's name for the same packs
    (:func:`~mindspeed_flow.adapters.megatron.role_checkpoint.loader_state_fallback`: the
    encoder's ``mp_rank_TT`` and the first stage's ``mp_rank_TT_000``).  An encoder rank of a
    decoupled layout takes its slice's first backbone stage's first (encoder ranks write none,
    :func:`save_loader_states`; with one backbone stage the two names are one file)."""
    from mindspeed_flow.adapters.megatron.role_checkpoint import loader_state_fallback

    other = loader_state_fallback(path)
    first, second = (other, path) if role_region() == ENCODER_REGION else (path, other)
    return first if os.path.isfile(first) or not os.path.isfile(second) else second


def resume_loader(loader: FlowDataLoader, split: str, margs: Any) -> None:
    """After a checkpoint load (``margs.load`` set, ``margs.iteration > 0``), a decoding
    rank's ``loader`` takes the state saved beside that checkpoint for its ``split``; a
    missing file is said in a warning and the data starts from the first epoch again."""
    if not (getattr(margs, "load", None) and getattr(margs, "iteration", 0) > 0 and loader.decoding):
        return
    path = loader_state_to_load(loader_state_path(margs.load, margs.iteration, loader.dp_rank, split,
                                                  getattr(margs, "ckpt_format", "torch")))
    if os.path.isfile(path):
        loader.load_state_dict(torch.load(path, weights_only=False)["flow_loader"])
    else:
        log.warning("--flow-packing: no loader state %s for iteration %d: the data starts from the first "
                    "epoch again (samples seen before the checkpoint may repeat)", path, margs.iteration)


def save_loader_states(iterators: Iterable[Any], iteration: int) -> None:
    """Write the loader state of each of ``iterators`` (the train loop's
    :class:`~.data.FlowTrainIterator`: its ``loader``, ``split``, ``records`` and
    ``save_state()``) that records its samples (a decoding rank, not an encoder rank of a
    decoupled layout: see the module), beside checkpoint ``iteration`` under ``--save``.
    Each file is written whole, then renamed."""
    from megatron.training import get_args

    save_dir, ckpt_format = get_args().save, getattr(get_args(), "ckpt_format", "torch")
    for iterator in iterators:
        loader = iterator.loader
        if iterator.records and save_dir:  # the slice's own decoding rank: not an encoder rank's copy
            path = loader_state_path(save_dir, iteration, loader.dp_rank, iterator.split, ckpt_format)
            os.makedirs(os.path.dirname(path), exist_ok=True)
            torch.save({"flow_loader": iterator.save_state()}, path + ".tmp")
            os.replace(path + ".tmp", path)
