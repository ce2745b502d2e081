"""A validation split under ``--flow-packing`` (issue 19, defect 8).

The loader reads a subset of the corpus (``records``: one side of the split); the adapter
turns MindSpeed-MM's ``val_dataset`` / ``max_samples`` / ``val_rate`` settings into a
``(train, valid)`` pair of specs, builds a loader for each, evaluates through the valid one
without counting its microbatches as consumed samples, and saves its state apart from the
train loader's.  (``val_rate``'s split itself runs the ``datasets`` library, which only the
upstream environment has: ``tests/upstream/test_real_job_data.py``.)
"""

from __future__ import annotations

import json
import textwrap
from pathlib import Path

import pytest

from mindspeed_flow.adapters.mindspeed_mm import data as adapter
from mindspeed_flow.data import FlowDataLoader
from mindspeed_flow.data.errors import ResumeMismatch

from data_corpus import SAMPLES, demo_corpus, epoch_ids
from pinned_upstream import upstream_sources
from subprocess_utils import last_json, run_python

SETTINGS = dict(capacity=1024, window=8, seed=3, max_pixels=224 * 224, num_workers=0)


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    return demo_corpus(tmp_path_factory)


def _record_ids(corpus: Path, records) -> set[str]:
    from mindspeed_flow.data.source import Corpus

    c = Corpus.open(corpus)
    return {c.place(i) for i in records}


def test_loader_reads_exactly_its_records_over_dp_ranks_and_epochs(corpus):
    held = list(range(5, SAMPLES, 4))  # 29 records
    expected = _record_ids(corpus, held)
    for epoch in range(2):
        seen: list[str] = []
        for rank in range(2):
            loader = FlowDataLoader(corpus, None, dp_rank=rank, dp_size=2, records=held, **SETTINGS)
            loader.epoch = epoch
            seen += [i for pack in epoch_ids(loader) for i in pack]
        assert len(seen) == len(set(seen)) and set(seen) == expected


def test_resume_with_other_records_is_refused_and_records_are_checked(corpus):
    loader = FlowDataLoader(corpus, None, records=[1, 2, 3, 4], **SETTINGS)
    next(iter(loader))
    other = FlowDataLoader(corpus, None, records=[1, 2, 3, 5], **SETTINGS)
    with pytest.raises(ResumeMismatch, match="records: saved '4:"):
        other.load_state_dict(loader.state_dict())
    with pytest.raises(ValueError, match=r"must lie in \[0, 120\)"):
        FlowDataLoader(corpus, None, records=[0, SAMPLES], **SETTINGS)
    with pytest.raises(ValueError, match="more than once"):
        FlowDataLoader(corpus, None, records=[3, 3], **SETTINGS)


def test_images_outside_dataset_dir_resolve_as_upstream_does(corpus, tmp_path, monkeypatch):
    """MindSpeed-MM joins ``dataset_dir`` and an image path when that file exists, else it
    uses the path as written: a validation file elsewhere with absolute or working-directory
    relative paths."""
    shard = sorted(Path(corpus).glob("*.jsonl"))[0]
    records = [json.loads(line) for line in shard.read_text().splitlines()[:6]]
    for k, record in enumerate(records):
        record["images"] = [str(Path(corpus) / p) if k % 2 else str(Path("data") / p) for p in record["images"]]
    (tmp_path / "data").symlink_to(corpus)
    val = tmp_path / "val.jsonl"
    val.write_text("".join(json.dumps(r) + "\n" for r in records))
    monkeypatch.chdir(tmp_path)
    elsewhere = tmp_path / "dataset_dir"
    elsewhere.mkdir()
    loader = FlowDataLoader(val, Path(corpus) / "flow_demo_tokenizer.json", image_root=elsewhere, **SETTINGS)
    ids = [i for pack in epoch_ids(loader) for i in pack]
    assert sorted(ids) == sorted(f"val.jsonl:{n}" for n in range(1, 7)) and sum(loader.stats.bad.values()) == 0


def _param(corpus: Path, **basic) -> dict:
    return {"dataset_type": "huggingface", "basic_parameters": {"dataset": str(corpus), "dataset_dir": str(corpus),
                                                                **basic},
            "preprocess_parameters": {"model_name_or_path": None}, "attr": {}}


def _no_upstream(*a, **k):
    raise AssertionError("upstream preprocessed the corpus")


def test_build_dataset_returns_the_validation_file_and_first_records(corpus, tmp_path):
    shard = sorted(Path(corpus).glob("*.jsonl"))[0]
    plain = adapter.build_dataset(_no_upstream, None, (_param(corpus),), {})
    assert isinstance(plain, adapter.FlowDatasetSpec) and plain.records is None and plain.split == "train"
    train = adapter.build_dataset(_no_upstream, None, (_param(corpus, max_samples=7),), {})
    assert train.records == tuple(range(7))
    pair = adapter.build_dataset(_no_upstream, None, (_param(corpus, val_dataset=str(shard), val_max_samples=3,
                                                             val_rate=0.5),), {})
    assert isinstance(pair, tuple) and len(pair) == 2
    assert pair[0] == plain  # val_dataset wins over val_rate, as upstream
    assert (pair[1].source, pair[1].records, pair[1].split) == (str(shard), (0, 1, 2), "valid")
    # a streaming dataset ignores max_samples and val_rate, as upstream does
    assert adapter.build_dataset(_no_upstream, None, (_param(corpus, streaming=True, val_rate=0.25,
                                                             max_samples=4),), {}) == plain
    with pytest.raises(ValueError, match="val_rate must be between 0.0 and 1.0, got 1.5"):
        adapter.build_dataset(_no_upstream, None, (_param(corpus, val_rate=1.5),), {})
    with pytest.raises(ValueError, match="max_samples 500 is more than the 120 records"):
        adapter.build_dataset(_no_upstream, None, (_param(corpus, max_samples=500),), {})


def test_pack_length_from_megatron_arguments():
    from types import SimpleNamespace

    args = SimpleNamespace(seq_length=1025, sequence_parallel=True)
    assert adapter.pack_length(args, 2, 1) == (2, 1024)
    assert adapter.pack_length(SimpleNamespace(seq_length=1025, sequence_parallel=False), 2, 1) == (1, 1025)
    assert adapter.pack_length(SimpleNamespace(seq_length=1024), 4, 1) == (1, 1024)


CHILD = textwrap.dedent("""
    import json, sys
    from types import SimpleNamespace
    import torch.distributed as dist

    corpus, save_dir = sys.argv[1], sys.argv[2]
    dist.init_process_group("gloo", init_method=f"file://{save_dir}/store", rank=0, world_size=1)
    from megatron.core import parallel_state
    from megatron.core.num_microbatches_calculator import init_num_microbatches_calculator
    from megatron.training.global_vars import set_args
    from mindspeed_flow.adapters.mindspeed_mm import data as adapter, loader_state
    from mindspeed_flow.data.accounting import ACCOUNTING

    parallel_state.initialize_model_parallel(1, 1)
    init_num_microbatches_calculator(0, None, 2, 1, 1)

    def upstream(*a, **k):
        raise AssertionError("upstream's loader was built")

    held = list(range(0, 120, 5))
    train_spec = adapter.FlowDatasetSpec(corpus, corpus, None, None, 12544,
                                         tuple(i for i in range(120) if i % 5), "train")
    valid_spec = adapter.FlowDatasetSpec(corpus, corpus, None, None, 12544, tuple(held), "valid")
    loader_param = {"dataloader_mode": "sampler", "num_workers": 0}
    args = SimpleNamespace(micro_batch_size=1, seq_length=1024, seed=5, save=save_dir, load=None, iteration=0,
                           num_workers=0)
    set_args(args)

    def build():
        train_dl = adapter.build_dataloader(upstream, None, (train_spec, dict(loader_param)), {"process_group": None})
        valid_dl = adapter.build_dataloader(upstream, None, (valid_spec, dict(loader_param)), {"process_group": None})
        return adapter.build_iterations(upstream, None, (train_dl, valid_dl), {})

    train, valid, test = build()
    trained = [next(train)["sample_ids"] for _ in range(4)]
    evaluated = [next(valid)["sample_ids"] for _ in range(3)]
    pending = ACCOUNTING.pending
    adapter.save_checkpoint(lambda *a, **k: None, None, (3, None, None, None, 0), {})
    after = {"train": [next(train)["sample_ids"] for _ in range(3)], "valid": [next(valid)["sample_ids"] for _ in range(3)]}
    set_args(SimpleNamespace(**{**vars(args), "load": save_dir, "iteration": 3}))
    train2, valid2, _ = build()
    resumed = {"train": [next(train2)["sample_ids"] for _ in range(3)],
               "valid": [next(valid2)["sample_ids"] for _ in range(3)]}
    from mindspeed_flow.data.source import Corpus
    c = Corpus.open(corpus)
    print(json.dumps({"trained": trained, "evaluated": evaluated, "test": test, "held": [c.place(i) for i in held],
                      "pending": [pending.samples, pending.microbatches], "after": after, "resumed": resumed,
                      "paths": [loader_state.loader_state_path(save_dir, 3, 0, s) for s in ("train", "valid")],
                      "splits": [train.split, valid.split]}))
""")


def test_validation_loader_is_evaluated_not_counted_and_resumes_apart(corpus, tmp_path):
    upstream = upstream_sources().env()
    proc = run_python(CHILD, [str(corpus), str(tmp_path)], env={"PYTHONPATH": upstream["MEGATRON_LM_SRC"]},
                      timeout=300)
    out = last_json(proc)
    held = set(out["held"])
    assert out["splits"] == ["train", "valid"] and out["test"] is None
    trained = {i for pack in out["trained"] + out["after"]["train"] for i in pack}
    evaluated = {i for pack in out["evaluated"] + out["after"]["valid"] for i in pack}
    assert not trained & held and evaluated <= held and evaluated
    # only the train microbatches count as consumed samples
    assert out["pending"] == [sum(len(p) for p in out["trained"]), len(out["trained"])]
    assert all(Path(p).is_file() for p in out["paths"]) and out["paths"][0] != out["paths"][1]
    assert out["resumed"] == out["after"]  # each loader from its own saved state


def test_fewer_records_than_dp_ranks_is_refused_at_start(corpus):
    with pytest.raises(ValueError, match=r"1 record\(s\) selected for 2 DP ranks: DP rank 1 would have no sample"):
        FlowDataLoader(corpus, None, dp_rank=1, dp_size=2, records=[7], **SETTINGS)
