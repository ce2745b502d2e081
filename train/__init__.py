"""The ``mindspeed-flow train`` application: a tiny vision-language model trained end to end
on CPU (or CUDA GPUs), once as a MindSpeed-MM-style baseline and once with every FlowTrain
feature on, with a report of what each feature bought.

Installed as ``mindspeed_flow.train``.  It is the application layer on top of the plugin:
it may import the core, ``adapters`` and ``patches``; nothing imports it except the
``mindspeed-flow`` command.  Modules import megatron, torch.distributed helpers and
matplotlib inside functions only, so ``mindspeed-flow --help`` works without megatron-core.
"""
