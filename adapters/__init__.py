"""Translations between upstream (Megatron, MindSpeed, MindSpeed-MM, torch_npu) objects and core objects."""
