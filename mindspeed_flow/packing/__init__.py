"""Dynamic packing scheduler: best-fit packing, compute-cost model, zig-zag dispatch.

The rules (closing of online packs, overlong policies, zero-length items, the dispatch
order) are written down in ``docs/packing.md``.
"""

from .cost_model import CostModel, r_squared
from .dispatch import dispatch
from .offline import Packs, pack
from .online import BestFitPacker
from .stats import PackStats

__all__ = ["BestFitPacker", "CostModel", "PackStats", "Packs", "dispatch", "pack", "r_squared"]
