"""Device back ends chosen at run time: flash-attn on CUDA, torch_npu on Ascend, and where the allocator's profiler runs."""
