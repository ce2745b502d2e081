"""Exact resume: a loader restored from ``state_dict`` continues with no sample repeated or
skipped, with decoding workers, in process and after a SIGKILL of the process."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import time

import pytest
import torch

from mindspeed_flow.data import FlowDataLoader
from mindspeed_flow.data.errors import ResumeMismatch

from data_corpus import SAMPLES, demo_corpus

SETTINGS = dict(capacity=1024, window=8, seed=11, max_pixels=224 * 224)  # small images: fast tests


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    return demo_corpus(tmp_path_factory)


@pytest.fixture(scope="module")
def reference(corpus):
    """Two uninterrupted epochs: (epoch 0 packs, epoch 1 packs), each a list of id lists."""
    loader = FlowDataLoader(corpus, None, num_workers=0, **SETTINGS)
    return [b["sample_ids"] for b in loader], [b["sample_ids"] for b in loader]


def _resume_after(corpus, stop: int, workers: int, epochs_before: int = 0):
    """Run to pack ``stop`` of epoch ``epochs_before``, checkpoint, abandon; resume in a new loader."""
    first = FlowDataLoader(corpus, None, num_workers=workers, **SETTINGS)
    for _ in range(epochs_before):
        for _ in first:
            pass
    before = []
    iterator = iter(first)
    for _ in range(stop):
        before.append(next(iterator)["sample_ids"])
    state = first.state_dict()
    del iterator, first
    second = FlowDataLoader(corpus, None, num_workers=workers, **SETTINGS)
    second.load_state_dict(state)
    return before, [b["sample_ids"] for b in second], second


@pytest.mark.parametrize("stop", [3, 9])  # 9: after the stream ended, packs still to come
def test_resume_in_process_with_workers_gives_the_uninterrupted_packs(corpus, reference, stop):
    before, after, loader = _resume_after(corpus, stop, workers=2)
    assert before + after == reference[0]
    assert loader.stats.samples_seen == SAMPLES and loader.stats.packs == len(reference[0])


def test_resume_in_the_second_epoch_without_workers(corpus, reference):
    before, after, loader = _resume_after(corpus, 5, workers=0, epochs_before=1)
    assert before + after == reference[1]
    assert reference[0] != reference[1]  # the epoch shuffle changed the order
    assert loader.epoch == 2


def test_state_dict_round_trips_through_torch_save(corpus, reference, tmp_path):
    loader = FlowDataLoader(corpus, None, num_workers=0, **SETTINGS)
    iterator = iter(loader)
    before = [next(iterator)["sample_ids"] for _ in range(4)]
    torch.save(loader.state_dict(), tmp_path / "loader.pt")
    resumed = FlowDataLoader(corpus, None, num_workers=0, **SETTINGS)
    resumed.load_state_dict(torch.load(tmp_path / "loader.pt", weights_only=False))
    assert before + [b["sample_ids"] for b in resumed] == reference[0]


@pytest.mark.parametrize("change", [{"dp_size": 2}, {"num_workers": 1}, {"capacity": 2048}, {"seed": 12},
                                    {"overlong": "drop"}, {"max_pixels": 112 * 112}])
def test_resume_with_other_settings_is_refused_naming_them(corpus, change):
    saved = FlowDataLoader(corpus, None, num_workers=0, **SETTINGS).state_dict()
    settings = {**SETTINGS, "num_workers": 0, **change}
    other = FlowDataLoader(corpus, None, **settings)
    key = next(iter(change))
    with pytest.raises(ResumeMismatch, match=f"cannot resume .*{key}: saved .* now {change[key]!r}"):
        other.load_state_dict(saved)


def test_a_state_of_another_format_is_a_resume_mismatch(corpus):
    loader = FlowDataLoader(corpus, None, num_workers=0, **SETTINGS)
    state = {**loader.state_dict(), "format": 0}
    with pytest.raises(ResumeMismatch, match="loader state format 0 is not 1"):
        loader.load_state_dict(state)


CHILD = textwrap.dedent("""
    import json, os, sys, time, torch
    from mindspeed_flow.data import FlowDataLoader
    corpus, checkpoint, log_path, at = sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4])
    settings = json.loads(sys.argv[5])
    if __name__ == "__main__":
        loader = FlowDataLoader(corpus, None, num_workers=2, **settings)
        with open(log_path, "a") as log:
            for n, batch in enumerate(loader, start=1):
                log.write(json.dumps(batch["sample_ids"]) + "\\n")
                if n == at:
                    torch.save(loader.state_dict(), checkpoint + ".tmp")
                    os.replace(checkpoint + ".tmp", checkpoint)
                    log.write("CHECKPOINT\\n")
                log.flush()
                os.fsync(log.fileno())
                time.sleep(0.3)  # be mid-epoch when the parent kills us
        print("finished the epoch", flush=True)
""")


def test_sigkill_mid_epoch_then_resume_sees_each_sample_exactly_once(corpus, reference, tmp_path):
    at = 4
    checkpoint, log_path = str(tmp_path / "loader.pt"), tmp_path / "ids.log"
    script = tmp_path / "child.py"
    script.write_text(CHILD)
    child = subprocess.Popen([sys.executable, str(script), str(corpus), checkpoint, str(log_path), str(at),
                              json.dumps(SETTINGS)], start_new_session=True,
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    try:
        deadline = time.time() + 120
        while time.time() < deadline:
            lines = log_path.read_text().splitlines() if log_path.exists() else []
            if "CHECKPOINT" in lines and len(lines) >= at + 3:
                break
            assert child.poll() is None, child.communicate()
            time.sleep(0.05)
        else:
            pytest.fail("the child did not get past its checkpoint in time")
        os.killpg(child.pid, signal.SIGKILL)  # the loader process and its decoding workers
        child.wait(timeout=30)
    finally:
        if child.poll() is None:
            os.killpg(child.pid, signal.SIGKILL)
            child.wait(timeout=30)
        child.stdout.close()
        child.stderr.close()
    assert child.returncode == -signal.SIGKILL
    lines = log_path.read_text().splitlines()
    marker = lines.index("CHECKPOINT")
    before = [json.loads(line) for line in lines[:marker]]
    seen_after_checkpoint = [json.loads(line) for line in lines[marker + 1:]]
    assert len(before) == at and seen_after_checkpoint  # it was killed past the checkpoint, mid-epoch
    assert len(before) + len(seen_after_checkpoint) < len(reference[0])

    resumed = FlowDataLoader(corpus, None, num_workers=2, **SETTINGS)
    resumed.load_state_dict(torch.load(checkpoint, weights_only=False))
    after = [b["sample_ids"] for b in resumed]
    assert before + after == reference[0]
    ids = [i for pack in before + after for i in pack]
    assert len(ids) == len(set(ids)) == SAMPLES
