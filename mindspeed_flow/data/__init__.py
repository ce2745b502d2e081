"""Distributed online-packing multimodal loader (feature ``packing``), see ``docs/data.md``.

``FlowDataLoader`` reads MindSpeed-MM conversation records (JSON / JSONL, with images),
only this DP rank's shard, decodes them in worker processes, packs them online into
fixed token budgets and yields packed microbatches that MindSpeed-MM's Qwen2.5-VL forward
takes through the ``fused_attn`` packed path; ``state_dict``/``load_state_dict`` resume
exactly.
"""

from .batch import collate_pack
from .loader import FlowDataLoader
from .mixture import MixtureLoader
from .stats import LoaderStats

__all__ = ["FlowDataLoader", "LoaderStats", "MixtureLoader", "collate_pack"]
