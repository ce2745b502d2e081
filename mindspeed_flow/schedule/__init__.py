"""Schedule algebra (Mpipe) for VLM training: regions, skeletons, seams, composed programs.

A model is cut into :class:`Region` s; each gets a skeleton (:class:`OneFOneB`,
:class:`GPipe`, :class:`Interleaved1F1B` shard by layer; :class:`Transpose` and
:class:`Decoupled` replicate by microbatch; :class:`ZeroBubbleH1`, :class:`ZeroBubbleV` split
each backward into input and weight gradients) and a trainable bit.  :func:`compose` derives a
:class:`Plan` of per-rank programs (lists of :class:`Action`), :func:`validate` proves they
match and cannot deadlock, :func:`simulate` replays them with a cost model and draws them.
"""

from .actions import Action, Kind, format_program
from .compose import compose
from .costs import CostTable, Jitter, Link, RegionCost
from .errors import ScheduleError
from .plan import Plan
from .regions import Region
from .simulate import SimResult, simulate
from .skeletons import Decoupled, GPipe, Interleaved1F1B, OneFOneB, Transpose
from .validate import validate
from .zero_bubble import ZeroBubbleH1, ZeroBubbleV

__all__ = [
    "Action",
    "CostTable",
    "Decoupled",
    "GPipe",
    "Interleaved1F1B",
    "Jitter",
    "Kind",
    "Link",
    "OneFOneB",
    "Plan",
    "Region",
    "RegionCost",
    "ScheduleError",
    "SimResult",
    "Transpose",
    "ZeroBubbleH1",
    "ZeroBubbleV",
    "compose",
    "format_program",
    "simulate",
    "validate",
]
