"""The ``allocator`` patch in a real MindSpeed-MM start-up: MindSpeed's adaptor, MindSpeed-MM's
own ``validate_args`` (which replaces Megatron's and calls the real ``merge_mm_args`` /
``ConfigReader``), launched through ``mindspeed_flow.launch`` with ``--flow-allocator``.
The plan's sizes must be what Megatron derives from, and the model config MindSpeed-MM
builds from must carry the plan's per-module ``pipeline_num_layers`` and the encoder's TP.
Only ``torch_npu`` is a stand-in (``standins/``): there is no NPU here.
"""

from __future__ import annotations

import json
import subprocess
import sys

from harness import TINY_MODEL, upstream_env
from pinned_upstream import upstream_sources

from mindspeed_flow.allocator import AllocationPlan, BackboneConfig, EncoderConfig, Prediction

PROBE = f'''
import json, sys
sys.argv = ["probe.py", "--use-mcore-models", "--hidden-size", "64", "--num-attention-heads", "4",
            "--seq-length", "128", "--max-position-embeddings", "128", "--micro-batch-size", "4",
            "--tokenizer-type", "NullTokenizer", "--vocab-size", "151936", "--lr", "1e-5", "--train-iters", "1",
            "--mm-model", {str(TINY_MODEL)!r}] + sys.argv[1:]
import mindspeed.megatron_adaptor  # noqa: F401
from megatron.training import arguments
from mindspeed_mm.configs.config import mm_extra_args_provider
args = arguments.parse_args(mm_extra_args_provider, False)
arguments.validate_args(args, {{}})
vit, llm = args.mm.model.image_encoder.vision_encoder, args.mm.model.text_decoder
print(json.dumps({{"sizes": [args.tensor_model_parallel_size, args.pipeline_model_parallel_size,
                             args.data_parallel_size, args.micro_batch_size, args.global_batch_size],
                  "vit": [vit.pipeline_num_layers, vit.tensor_model_parallel_size], "llm": llm.pipeline_num_layers}}))
'''


def test_plan_reaches_mindspeed_mm_args_and_model_config(runs, tmp_path):
    """(``runs``: the upstream environment gate, skipping, or failing under
    ``scripts/test_upstream.sh``, when MindSpeed-MM's dependencies are missing.)"""
    backbone = BackboneConfig(dp=1, tp=2, pp=2, micro_batch=1, layer_split=(1, 1))
    prediction = Prediction(1.0, 1.2, 1.0, 0.3, 0.1, 4.0, 4, 1.0, 1.0)
    path = AllocationPlan(EncoderConfig(dp=1, tp=2, layers=2), backbone, global_batch=4, predicted=prediction,
                placement="colocated").save(tmp_path / "plan.yaml")
    (tmp_path / "probe.py").write_text(PROBE)
    env = {**upstream_env(upstream_sources(), tmp_path), "WORLD_SIZE": "4", "RANK": "0"}

    def start(plan_file):
        return subprocess.run([sys.executable, "-m", "mindspeed_flow.launch", "probe.py", "--flow-allocator",
                               "--flow-allocator-plan", str(plan_file)], cwd=tmp_path, env=env, capture_output=True,
                              text=True, timeout=300)

    proc = start(path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    assert out == {"sizes": [2, 2, 1, 1, 4], "vit": [[2, 0], 2], "llm": [1, 1]}
    # (issue 19, defect 4) the encoder on 3 devices of its own: refused at the backbone's world
    # size too, where it used to be applied as if co-located without a word
    decoupled = AllocationPlan(EncoderConfig(dp=3, tp=1, layers=2), backbone, global_batch=4,
                     predicted=prediction).save(tmp_path / "decoupled.yaml")
    refused = start(decoupled)
    assert refused.returncode != 0 and "refusing a decoupled plan: its encoder runs on 3 devices" in refused.stderr
