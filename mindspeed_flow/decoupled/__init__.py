"""The decoupled step in one place: where a decoupled layout puts its ranks
(:mod:`.layout`), its process groups (:mod:`.groups`), its plan (:mod:`.plan`), its gradient
averaging (:mod:`.grads`) and how an allocator plan becomes one (:mod:`.from_allocator`).
``mindspeed-flow train`` and the real job's patches call these; the pool (``pool/``) only
stores what the step moves."""

from .errors import LayoutError
from .from_allocator import describe_plan, layout_from_plan, unrealisable
from .grads import average_coalesced
from .layout import MEGATRON_ORDER, DecoupledLayout, Role

__all__ = ["MEGATRON_ORDER", "DecoupledLayout", "LayoutError", "Role", "average_coalesced", "describe_plan",
           "layout_from_plan", "unrealisable"]
