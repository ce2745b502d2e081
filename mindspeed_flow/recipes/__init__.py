"""Convergence recipes (feature ``recipes``): per-module learning rates and checkpoint
averaging.  Plain torch here; the Megatron side is in :mod:`mindspeed_flow.adapters`.
"""
