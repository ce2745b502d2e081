"""Runtime: executes a composed :class:`~mindspeed_flow.schedule.Plan` on one rank.

The schedule algebra decides (programs are data); the runtime does: forward and backward
through the rank's model chunks, eager point-to-point transfers with per-tensor shape
headers, replicated regions' parameter broadcast and gradient reduce, Megatron's loss
collection, per-action timestamps, and failures that name the rank and the action.
"""

from .errors import ActionFailed
from .executor import Binding, Executor, LossRules, RuntimeOptions, StepResult
from .timeline import Stamp, Timeline, measured_result
from .transport import WaitPolicy

__all__ = [
    "ActionFailed",
    "Binding",
    "Executor",
    "LossRules",
    "RuntimeOptions",
    "Stamp",
    "StepResult",
    "Timeline",
    "WaitPolicy",
    "measured_result",
]
