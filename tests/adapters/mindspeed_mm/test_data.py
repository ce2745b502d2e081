"""Feature ``packing``: MindSpeed-MM's data path swapped for FlowDataLoader.

The targets are found in the pinned sources (``doctor --src``).  The wrappers then run in
a child process on the pinned Megatron-LM source (its real ``get_args``/``set_args``,
``parallel_state`` over a one-process gloo group, microbatch calculator and
``get_checkpoint_name``), fed MindSpeed-MM's own Qwen2.5-VL data config
(``examples/qwen2.5vl/data_7b.json``) pointed at the demo corpus: the loader is built
without touching upstream's, cycles over epochs, records every microbatch for the
accounting, saves its state with the checkpoint and resumes from it exactly.
"""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from mindspeed_flow.adapters.mindspeed_mm import data as adapter
from mindspeed_flow.patches import packing_loader

from data_corpus import demo_corpus
from pinned_upstream import upstream_sources
from subprocess_utils import last_json, run_python

SAMPLES = 30


@pytest.fixture(scope="module")
def upstream() -> dict[str, str]:
    return upstream_sources().env()


def _data_config(upstream) -> dict:
    path = Path(upstream["MINDSPEED_MM_SRC"]) / "examples" / "qwen2.5vl" / "data_7b.json"
    return json.loads(path.read_text())["dataset_param"]


def test_doctor_src_finds_every_loader_target(upstream):
    proc = subprocess.run([sys.executable, "-m", "mindspeed_flow.cli", "doctor", "--json", "--src",
                           upstream["MINDSPEED_MM_SRC"]], capture_output=True, text=True, timeout=120)
    rows = {r["target"]: r["status"] for r in json.loads(proc.stdout) if r["feature"] == "packing"}
    for patch in packing_loader.PATCHES:
        assert rows[patch.target] == "found", (patch.target, rows)


def test_build_dataset_describes_conversation_data_and_passes_other_types(upstream):
    param = _data_config(upstream)

    def upstream_build(dataset_param):
        raise AssertionError("upstream preprocessed the corpus")

    spec = adapter.build_dataset(upstream_build, None, (param,), {})
    assert spec == adapter.FlowDatasetSpec("./data/mllm_format_llava_instruct_data.json", "./data",
                                           "./ckpt/hf_path/Qwen2.5-VL-7B-Instruct", None, 262144)
    other = {**param, "dataset_type": "t2v"}
    assert adapter.build_dataset(lambda dataset_param: "upstream", None, (other,), {}) == "upstream"
    renamed = {**param, "attr": {**param["attr"], "messages": "conversations"}}
    with pytest.raises(ValueError, match="'messages': 'conversations'"):
        adapter.build_dataset(upstream_build, None, (renamed,), {})


CHILD = textwrap.dedent("""
    import json, sys
    from types import SimpleNamespace
    import torch.distributed as dist

    corpus, save_dir, config = sys.argv[1], sys.argv[2], sys.argv[3]
    dist.init_process_group("gloo", init_method=f"file://{save_dir}/store", rank=0, world_size=1)
    from megatron.core import parallel_state
    from megatron.core.num_microbatches_calculator import init_num_microbatches_calculator
    from megatron.training.global_vars import set_args
    from mindspeed_flow.adapters.mindspeed_mm import data as adapter, loader_state
    from mindspeed_flow.data.accounting import ACCOUNTING

    parallel_state.initialize_model_parallel(1, 1)
    init_num_microbatches_calculator(0, None, 4, 1, 1)

    def upstream(*a, **k):
        raise AssertionError("upstream's loader was built")

    param = json.load(open(config))["dataset_param"]
    param["basic_parameters"].update(dataset=corpus, dataset_dir=corpus)
    param["preprocess_parameters"].update(model_name_or_path=None, image_max_pixels=12544)
    loader_param = {"dataloader_mode": "sampler", "num_workers": 7}  # upstream overrides it with --num-workers
    args = SimpleNamespace(micro_batch_size=1, seq_length=1024, seed=5, save=save_dir, load=None, iteration=0,
                           num_workers=2)
    set_args(args)
    spec = adapter.build_dataset(upstream, None, (param,), {})
    loader = adapter.build_dataloader(upstream, None, (spec, dict(loader_param)), {"process_group": None})
    train, valid, test = adapter.build_iterations(upstream, None, (loader,), {})
    first = [next(train)["sample_ids"] for _ in range(5)]
    assert adapter.save_checkpoint(lambda *a, **k: "saved", None, (7, None, None, None, 0), {}) == "saved"
    rest = [next(train)["sample_ids"] for _ in range(30)]
    pending = ACCOUNTING.pending
    set_args(SimpleNamespace(**{**vars(args), "load": save_dir, "iteration": 7}))
    resumed_loader = adapter.build_dataloader(upstream, None, (spec, dict(loader_param)), {})
    resumed_train = adapter.build_iterations(upstream, None, (resumed_loader,), {})[0]
    resumed = [next(resumed_train)["sample_ids"] for _ in range(30)]
    print(json.dumps({"first": first, "rest": rest, "resumed": resumed, "others": [valid, test],
                      "pending": [pending.samples, pending.microbatches],
                      "loader": [loader.capacity, loader.dp_size, loader.num_workers, loader.seed, loader.step_packs,
                                 loader.window],
                      "path": loader_state.loader_state_path(save_dir, 7, 0), "epochs": loader.stats.epochs}))
""")


def test_swapped_loader_cycles_records_saves_and_resumes_on_megatron(upstream, tmp_path_factory, tmp_path):
    corpus = demo_corpus(tmp_path_factory, samples=SAMPLES)
    config = Path(upstream["MINDSPEED_MM_SRC"]) / "examples" / "qwen2.5vl" / "data_7b.json"
    proc = run_python(CHILD, [str(corpus), str(tmp_path), str(config)],
                      env={"PYTHONPATH": upstream["MEGATRON_LM_SRC"]}, timeout=300)
    out = last_json(proc)
    # --seq-length, DP group, --num-workers, --seed, microbatches, the default window
    assert out["loader"] == [1024, 1, 2, 5, 4, adapter.WINDOW]
    assert out["others"] == [None, None]
    packs = out["first"] + out["rest"]
    assert out["epochs"] >= 1  # 35 packs of 30 samples: the iterator went on into the next epochs
    epoch_one = []
    for pack in packs:
        epoch_one += pack
        if len(epoch_one) >= SAMPLES:
            break
    assert sorted(epoch_one) == sorted(set(epoch_one)) and len(epoch_one) == SAMPLES
    assert out["pending"] == [sum(len(p) for p in packs), len(packs)]  # every microbatch recorded
    assert "iter_0000007" in out["path"] and Path(out["path"]).is_file()
    assert out["resumed"] == out["rest"]  # from the saved state, not from the start
