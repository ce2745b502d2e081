"""mindspeed-flow: decoupled encoder/backbone VLM training as a patch layer for MindSpeed-MM
and Megatron.

The core package imports only torch, numpy, highspy, wrapt and the standard library; the
upstream-facing code lives in :mod:`mindspeed_flow.adapters` and the monkey patches in
:mod:`mindspeed_flow.patches`.
"""

__version__ = "0.1.0"
