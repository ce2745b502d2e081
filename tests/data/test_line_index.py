"""The on-disk line index of JSON Lines shards: a rank with a warm index reads only its own
records' bytes; a changed shard gets a new index; concurrent builders leave a whole one."""

from __future__ import annotations

import builtins
import multiprocessing
import os
from pathlib import Path

import numpy as np
import pytest

from mindspeed_flow.data import FlowDataLoader, line_index, source
from mindspeed_flow.data.line_index import INDEX_SUFFIX, build, index_paths
from mindspeed_flow.data.sharding import rank_indices
from mindspeed_flow.data.source import Corpus

from data_corpus import demo_corpus


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    return demo_corpus(tmp_path_factory)


class _RecordingFile:
    """A real file whose reads are logged as (start, end) byte ranges."""

    def __init__(self, file, log: list[tuple[int, int]]):
        self._file, self._log = file, log

    def read(self, size: int = -1) -> bytes:
        start = self._file.tell()
        data = self._file.read(size)
        self._log.append((start, start + len(data)))
        return data

    def __getattr__(self, name):
        return getattr(self._file, name)

    def __iter__(self):
        for line in self._file:
            self._log.append((-1, -1))  # a scan: never expected once the index is warm
            yield line

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self._file.close()


def _record_reads(monkeypatch) -> dict[Path, list[tuple[int, int]]]:
    """Route the data modules' ``open`` through :class:`_RecordingFile`; returns the log per path."""
    reads: dict[Path, list[tuple[int, int]]] = {}

    def recording_open(path, *args, **kwargs):
        return _RecordingFile(builtins.open(path, *args, **kwargs), reads.setdefault(Path(path).absolute(), []))

    monkeypatch.setattr(source, "open", recording_open, raising=False)
    monkeypatch.setattr(line_index, "open", recording_open, raising=False)
    return reads


def test_a_rank_with_a_warm_index_reads_only_its_own_records(corpus, tmp_path, monkeypatch):
    shard = tmp_path / "shard.jsonl"
    shard.write_bytes((corpus / "part-0000.jsonl").read_bytes())
    (tmp_path / "flow_demo_tokenizer.json").write_bytes((corpus / "flow_demo_tokenizer.json").read_bytes())
    Corpus.open(tmp_path)  # the first rank builds the index
    assert index_paths(shard)[0].is_file()
    index = build(shard)
    mine = rank_indices(len(index.starts), 9, 0, 1, 3)
    allowed = {(int(index.starts[i]), int(index.ends[i])) for i in mine}

    reads = _record_reads(monkeypatch)
    loader = FlowDataLoader(tmp_path, None, capacity=1024, dp_rank=1, dp_size=3, num_workers=0, seed=9,
                            image_root=corpus, max_pixels=112 * 112)
    ids = sorted(i for batch in loader for i in batch["sample_ids"])

    assert ids == sorted(f"shard.jsonl:{int(index.lines[i])}" for i in mine)
    shard_reads = reads[shard.absolute()]
    assert set(shard_reads) == allowed  # exactly the own records' lines, nothing else of the shard
    assert sum(end - start for start, end in shard_reads) == sum(end - start for start, end in allowed)
    assert sum(end - start for start, end in shard_reads) < shard.stat().st_size // 2
    index_file = index_paths(shard)[0].absolute()
    assert set(reads) == {shard.absolute(), index_file}  # and the small index, not a scan


def _records(n: int, width: int = 0) -> str:
    return "".join(f'{{"messages": [], "images": [], "n": {i}, "pad": "{"x" * (width or i)}"}}\n' for i in range(n))


def test_a_changed_shard_gets_a_new_index(tmp_path):
    shard = tmp_path / "a.jsonl"
    shard.write_text(_records(5))
    assert len(Corpus.open(shard)) == 5
    sidecar = index_paths(shard)[0]
    first = sidecar.read_bytes()

    shard.write_text(_records(5) + "\n" + _records(2))  # grows: size differs
    corpus = Corpus.open(shard)
    assert len(corpus) == 7 and corpus.place(5) == "a.jsonl:7" and corpus.read(6)["n"] == 1
    assert sidecar.read_bytes() != first

    lines = shard.read_text().splitlines(keepends=True)
    before = shard.stat()
    shard.write_text("".join(reversed(lines)))  # same size, other line boundaries
    assert shard.stat().st_size == before.st_size
    os.utime(shard, ns=(before.st_atime_ns, before.st_mtime_ns + 10**9))  # only the mtime tells
    corpus = Corpus.open(shard)
    assert len(corpus) == 7 and [corpus.read(i)["n"] for i in range(7)] == [1, 0, 4, 3, 2, 1, 0]
    assert corpus.place(2) == "a.jsonl:4"


def test_a_broken_index_file_is_rebuilt(tmp_path):
    shard = tmp_path / "a.jsonl"
    shard.write_text(_records(6))
    Corpus.open(shard)
    sidecar = index_paths(shard)[0]
    sidecar.write_bytes(sidecar.read_bytes()[:-8])  # torn
    corpus = Corpus.open(shard)
    assert [corpus.read(i)["n"] for i in range(6)] == list(range(6))
    assert np.load(sidecar).size == 4 + 3 * 6


def test_a_read_only_corpus_directory_indexes_into_the_cache(tmp_path, monkeypatch):
    """Root ignores directory permissions here, so the read-only directory is simulated by
    refusing temporary files in it."""
    data, cache = tmp_path / "data", tmp_path / "cache"
    data.mkdir()
    shard = data / "a.jsonl"
    shard.write_text(_records(3))
    monkeypatch.setenv("XDG_CACHE_HOME", str(cache))
    real_mkstemp = line_index.tempfile.mkstemp

    def mkstemp(*args, dir=None, **kwargs):
        if Path(dir) == data:
            raise PermissionError(13, "Permission denied", str(dir))
        return real_mkstemp(*args, dir=dir, **kwargs)

    monkeypatch.setattr(line_index.tempfile, "mkstemp", mkstemp)
    assert len(Corpus.open(shard)) == 3
    assert not index_paths(shard)[0].exists()
    cached = index_paths(shard)[1]
    assert cached.parent == cache / "mindspeed-flow" / "index" and cached.is_file()
    assert [p.name for p in data.iterdir()] == ["a.jsonl"]


def _build_repeatedly(shard: str, rounds: int, failures) -> None:
    path = Path(shard)
    expected = build(path)
    sidecar = index_paths(path)[0]
    for _ in range(rounds):
        sidecar.unlink(missing_ok=True)
        got = line_index.load_or_build(path)
        try:
            on_disk = np.load(sidecar)
        except FileNotFoundError:
            continue  # another builder just removed it
        if not (np.array_equal(got.starts, expected.starts) and on_disk.size == 4 + 3 * len(expected.starts)
                and np.array_equal(on_disk[4:4 + len(expected.starts)], expected.starts)):
            failures.put(f"pid {os.getpid()}: a torn or wrong index")


def test_concurrent_builders_leave_a_whole_index(tmp_path):
    shard = tmp_path / "a.jsonl"
    shard.write_text(_records(2000, width=7))
    context = multiprocessing.get_context("fork")
    failures = context.Queue()
    workers = [context.Process(target=_build_repeatedly, args=(str(shard), 25, failures)) for _ in range(4)]
    for worker in workers:
        worker.start()
    for worker in workers:
        worker.join(timeout=120)
    assert all(worker.exitcode == 0 for worker in workers)
    assert failures.empty()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a.jsonl", "a.jsonl" + INDEX_SUFFIX]  # no temp files left
    corpus = Corpus.open(shard)
    assert len(corpus) == 2000 and corpus.read(1999)["n"] == 1999
