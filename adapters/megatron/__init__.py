"""Megatron-LM and megatron-core: the CPU shims, the argument path, the schedule, attention, recipes, checkpoints and the allocator's profile points."""
