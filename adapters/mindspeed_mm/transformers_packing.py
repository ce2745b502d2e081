"""Feature ``packing`` on ``pretrain_transformers.py CONFIG.yaml``: what the YAML must say for
the plugin's packs to train right, checked at start-up (the plugin activates before upstream
reads the YAML, so a refusal costs nothing).

A pack holds several samples in one ``[1, S]`` row.  This path's Qwen3-VL keeps them apart only
on its varlen attention: ``attn_implementation: flash_attention_2`` with ``attn_layout: TND``
for the text decoder (upstream's defaults and the recipes' settings), where the pack's
``seqlens`` become the attention's ``cu_seqlens``.  Every other setting (``sdpa``, ``eager``,
``flash_attention_2`` with ``BNSD``) attends over the whole row with a dense or causal mask,
so each token would see the other samples of its pack: refused, naming the key and its value.
Upstream's own text packer (``gpt_args.use_txt_dynamic_batching``) would re-pack the plugin's
packs: refused too.  So are the loss types that weight each batch row
(``model.loss_cfg.loss_type`` ``per_sample_loss``: each row by its own valid tokens;
``square_loss``: each row by one over the square root of its valid tokens, 57069cd
``TransformersModel.compute_loss``): under packing a row is a whole pack, not a sample.
"""

from __future__ import annotations

from typing import Any, Optional

from mindspeed_flow.config import FlagError

VARLEN = {"attn_implementation": "flash_attention_2", "attn_layout": "TND"}  # upstream's defaults too
TEXT_DECODER = ("model", "text_decoder")
LOSS_TYPE = ("model", "loss_cfg", "loss_type")
PER_ROW_LOSS_TYPES = ("per_sample_loss", "square_loss")  # upstream weights these per batch row


def _node(config: dict, path: tuple[str, ...]) -> Any:
    for key in path:
        config = config.get(key) if isinstance(config, dict) else None
    return config


def packing_refusals(config: dict) -> list[str]:
    """Why the plugin's packs cannot train under the YAML ``config`` (its parsed content);
    empty when they can."""
    reasons = []
    decoder = _node(config, TEXT_DECODER) or {}
    for key, varlen in VARLEN.items():
        value = decoder.get(key, varlen) if isinstance(decoder, dict) else varlen
        if value != varlen:
            reasons.append(
                f"{'.'.join(TEXT_DECODER)}.{key} is {value!r}: packed samples would attend to each other (only "
                f"{VARLEN['attn_implementation']!r} with attn_layout {VARLEN['attn_layout']!r} keeps each sample of "
                f"a pack to itself through the pack's seqlens); set {', '.join(f'{k}: {v}' for k, v in VARLEN.items())} "
                "or add --no-flow-packing")
    loss_type = _node(config, LOSS_TYPE)
    if loss_type in PER_ROW_LOSS_TYPES:
        reasons.append(f"{'.'.join(LOSS_TYPE)} is {loss_type!r}: upstream weights that loss per batch row, and a "
                       "packed row is a whole pack, not a sample; use 'default' or 'token_loss', or add "
                       "--no-flow-packing")
    if _node(config, ("gpt_args", "use_txt_dynamic_batching")):
        reasons.append("gpt_args.use_txt_dynamic_batching is on: upstream's packer would re-pack the plugin's packs; "
                       "drop it (the plugin packs) or add --no-flow-packing")
    return reasons


def check_packing_yaml(path: Optional[str]) -> None:
    """Refuse (:class:`~mindspeed_flow.config.FlagError`) packing under the YAML at ``path``
    when :func:`packing_refusals` finds a reason.  A YAML that cannot be read is left to
    upstream's reader, which reports it."""
    import yaml

    try:
        with open(path or "", encoding="utf-8") as f:
            config = yaml.safe_load(f)
    except (OSError, yaml.YAMLError):
        return
    reasons = packing_refusals(config if isinstance(config, dict) else {})
    if reasons:
        raise FlagError(f"packing on pretrain_transformers.py with {path}: " + "; ".join(reasons))
