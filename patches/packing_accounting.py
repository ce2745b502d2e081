"""Feature ``packing`` (``--flow-packing``): consumed samples, tokens and the LR schedule
count the samples packed microbatches really held (see
:mod:`mindspeed_flow.adapters.mindspeed_mm.training`).  The loader swap itself is declared
with the loader's patches."""

from mindspeed_flow.adapters.mindspeed_mm import training as mindspeed_mm_training
from mindspeed_flow.patching import Patch
from mindspeed_flow.patching.versions import MINDSPEED_MM, source

FEATURE = "packing"
CHECKED_MM = (source(MINDSPEED_MM),)

PATCHES = [
    Patch(
        feature=FEATURE,
        target="mindspeed_mm.training:train_step",
        wrapper=mindspeed_mm_training.train_step_real_samples,
        params="forward_step_func, data_iterator, model, optimizer, opt_param_scheduler, config, call_backs",
        checked=CHECKED_MM,
        description="consumed samples / LR increment from the loader's real samples per step, not dp*mbs*microbatches",
    ),
]
