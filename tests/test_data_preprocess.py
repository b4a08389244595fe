"""data.preprocess: round trip, byte-identical to the plain per-document encoding, atomic output."""
from __future__ import annotations

import glob
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from _data_text import EDGE_CASES, TOKENIZER, real_texts, reference_encode, write_jsonl

ROOT = Path(__file__).resolve().parent.parent


def _files_equal(a: Path, b: Path) -> bool:
    return Path(str(a) + ".bin").read_bytes() == Path(str(b) + ".bin").read_bytes() and \
        Path(str(a) + ".idx").read_bytes() == Path(str(b) + ".idx").read_bytes()


@pytest.fixture(scope="module")
def texts():
    # ~1.2 MB of real text plus edge cases scattered through it, so several blocks are exercised
    docs = real_texts(120)
    for i, edge in enumerate(EDGE_CASES):
        docs.insert(7 * i + 3, edge)
    return docs


def test_round_trip_documents_written_equal_documents_read(tmp_path, texts):
    from megatron.core.datasets.indexed_dataset import IndexedDataset
    from tokenizers import Tokenizer

    from data.preprocess import preprocess

    src = write_jsonl(tmp_path / "c.jsonl", texts)
    stats = preprocess([str(src)], str(TOKENIZER), str(tmp_path / "out"), append_eod=True, chunk_mb=0.25, quiet=True)
    ds = IndexedDataset(str(tmp_path / "out"))
    tok = Tokenizer.from_file(str(TOKENIZER))
    eod = tok.token_to_id("<|endoftext|>")
    assert stats["documents"] == len(texts)
    assert len(ds.document_indices) - 1 == len(texts)  # one document entry per input line, empty ones included
    seq = 0
    for d, text in enumerate(texts):
        n_seq = int(ds.document_indices[d + 1] - ds.document_indices[d])
        if text == "":
            assert n_seq == 0
            continue
        ids = ds[seq].tolist()
        seq += n_seq
        assert ids[-1] == eod
        assert tok.decode(ids[:-1], skip_special_tokens=False) == text
    assert seq == len(ds)


@pytest.mark.parametrize("backend", ["gigatoken", "tokenizers"])
@pytest.mark.parametrize("append_eod", [True, False])
def test_byte_identical_to_reference_encoding(tmp_path, texts, backend, append_eod):
    pytest.importorskip(backend)
    from data.preprocess import preprocess

    src = write_jsonl(tmp_path / "c.jsonl", texts)
    reference_encode(texts, TOKENIZER, tmp_path / "ref", append_eod=append_eod)
    preprocess([str(src)], str(TOKENIZER), str(tmp_path / "ours"), append_eod=append_eod, chunk_mb=0.1,
               backend=backend, quiet=True)
    assert _files_equal(tmp_path / "ours", tmp_path / "ref")


def test_gzip_glob_and_json_key(tmp_path, texts):
    from data.preprocess import preprocess

    half = len(texts) // 2
    write_jsonl(tmp_path / "shard0.jsonl.gz", texts[:half], key="content")
    write_jsonl(tmp_path / "shard1.jsonl.gz", texts[half:], key="content")
    reference_encode(texts, TOKENIZER, tmp_path / "ref", append_eod=True)
    preprocess([str(tmp_path / "shard*.jsonl.gz")], str(TOKENIZER), str(tmp_path / "ours"), append_eod=True,
               json_key="content", quiet=True)
    assert _files_equal(tmp_path / "ours", tmp_path / "ref")


def test_bad_input_is_a_clear_error(tmp_path):
    from data.preprocess import preprocess

    (tmp_path / "bad.jsonl").write_text('{"body": "x"}\n')
    with pytest.raises(SystemExit, match="no 'text' field"):
        preprocess([str(tmp_path / "bad.jsonl")], str(TOKENIZER), str(tmp_path / "o"), quiet=True)
    assert not glob.glob(str(tmp_path / "o*"))  # nothing left behind
    with pytest.raises(SystemExit, match="no such file"):
        preprocess([str(tmp_path / "missing.jsonl")], str(TOKENIZER), str(tmp_path / "o"), quiet=True)


def _start(tmp_path, src, prefix, slow=True):
    # the run to interrupt uses the slower portable backend and tiny blocks, so it is still running when killed
    slow_args = ["--chunk-mb", "0.05", "--backend", "tokenizers", "--workers", "1"] if slow else []
    cmd = [sys.executable, "-m", "data.preprocess", "--input", str(src), "--tokenizer", str(TOKENIZER),
           "--output-prefix", str(prefix), "--append-eod", *slow_args]
    return subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            env=dict(os.environ, PYTHONPATH=str(ROOT)))


def _wait_for_partial(proc, prefix, min_bytes=200_000, timeout=60.0):
    deadline = time.time() + timeout
    while time.time() < deadline:
        parts = glob.glob(str(prefix) + ".bin.partial-*")
        if parts and os.path.getsize(parts[0]) >= min_bytes:
            return parts[0]
        assert proc.poll() is None, proc.stderr.read().decode()[-2000:]
        time.sleep(0.05)
    raise AssertionError("preprocess did not start writing in time")


@pytest.mark.parametrize("sig", [signal.SIGKILL, signal.SIGTERM])
def test_interrupted_run_leaves_no_dataset_and_rerun_completes(tmp_path, sig):
    texts = real_texts(120, repeat=3)  # ~3.5 MB: long enough to interrupt
    src = write_jsonl(tmp_path / "c.jsonl", texts)
    prefix = tmp_path / "out" / "corpus"
    proc = _start(tmp_path, src, prefix)
    _wait_for_partial(proc, prefix)
    proc.send_signal(sig)
    proc.wait(timeout=30)
    assert proc.returncode != 0
    assert not os.path.exists(str(prefix) + ".bin") and not os.path.exists(str(prefix) + ".idx")
    if sig == signal.SIGTERM:  # a catchable stop also removes its partial files
        assert not glob.glob(str(prefix) + ".*.partial-*")
    proc = _start(tmp_path, src, prefix, slow=False)
    out, err = proc.communicate(timeout=300)
    assert proc.returncode == 0, err.decode()[-2000:]
    assert not glob.glob(str(prefix) + ".*.partial-*")  # the killed run's leftovers are cleaned too
    from launcher.core.indexed_files import read_index_header

    header = read_index_header(str(prefix) + ".idx")
    assert header.document_count - 1 == len(texts)
    assert os.path.getsize(str(prefix) + ".bin") == header.tokens * header.dtype.itemsize
    assert b"M tok/s" in err and b"ETA" in err  # progress on stderr


def test_interrupting_a_rebuild_keeps_no_mismatched_pair(tmp_path):
    """An old dataset at the prefix stays whole until the new one is complete."""
    from data.preprocess import preprocess

    prefix = tmp_path / "corpus"
    old = real_texts(3)
    preprocess([str(write_jsonl(tmp_path / "old.jsonl", old))], str(TOKENIZER), str(prefix), append_eod=True, quiet=True)
    before = (Path(str(prefix) + ".bin").read_bytes(), Path(str(prefix) + ".idx").read_bytes())
    proc = _start(tmp_path, write_jsonl(tmp_path / "new.jsonl", real_texts(120, repeat=3)), prefix)
    _wait_for_partial(proc, prefix)
    proc.kill()
    proc.wait(timeout=30)
    assert (Path(str(prefix) + ".bin").read_bytes(), Path(str(prefix) + ".idx").read_bytes()) == before


def test_stale_partials_recognised_despite_pid_reuse_and_zombies(tmp_path):
    """A partial is stale when no writer holds its lock and its writer (pid *and* start time) is gone: a pid now
    used by another process, or a SIGKILLed writer not yet reaped (kill(pid, 0) still succeeds), does not keep it."""
    import socket

    from data.preprocess import _lock_partial, _proc_start, _remove_stale_partials

    prefix = str(tmp_path / "corpus")
    host = socket.gethostname()
    me = os.getpid()
    reused = f"{prefix}.bin.partial-{me}-{int(_proc_start(me)) + 1}-{host}"  # our pid, another start time
    Path(reused).write_bytes(b"x")
    zombie = subprocess.Popen(["sleep", "30"])
    zstart = _proc_start(zombie.pid)
    zombie.kill()
    time.sleep(0.2)  # not waited for: a zombie
    os.kill(zombie.pid, 0)  # the old pid-only test would call this writer alive
    dead = [f"{prefix}.{kind}.partial-{zombie.pid}-{zstart}-{host}" for kind in ("bin", "idx")]
    for p in dead:
        Path(p).write_bytes(b"x")
    other_host = f"{prefix}.bin.partial-1-1-not-{host}"  # another node's writer, its lock released
    Path(other_host).write_bytes(b"x")
    mine = f"{prefix}.bin.partial-{me}-{_proc_start(me)}-{host}"  # alive (the instant before it locks)
    Path(mine).write_bytes(b"x")
    held = f"{prefix}.bin.partial-99999999-1-not-{host}"
    holder = subprocess.Popen([sys.executable, "-c", "import fcntl,os,sys,time; fd=os.open(sys.argv[1], os.O_RDWR);"
                               "fcntl.flock(fd, fcntl.LOCK_EX); print('locked', flush=True); time.sleep(30)", held],
                              stdout=subprocess.PIPE, text=True) if Path(held).write_bytes(b"x") else None
    try:
        assert holder.stdout.readline().strip() == "locked"
        removed = _remove_stale_partials(prefix)
        assert sorted(removed) == sorted([reused, *dead, other_host])
        assert os.path.exists(mine) and os.path.exists(held)
        fd = _lock_partial(f"{prefix}.bin.partial-x")  # our own writer's lock is seen as held by another fd
        from data.preprocess import _locked_by_someone

        assert fd is not None and _locked_by_someone(f"{prefix}.bin.partial-x") is True
        os.close(fd)
    finally:
        holder.kill()
        holder.wait()
        zombie.wait()


def test_benchmark_ratios_come_from_medians_and_memory_from_pss():
    sys.path.insert(0, str(ROOT / "benchmarks"))
    import preprocess_bench as bench

    def run(wall, cpu, pss):
        return {"wall_s": wall, "cpu_s": cpu, "peak_pss_mb": pss, "peak_rss_mb": 3 * pss, "tokens": 1000}

    ours = bench.summarise("ours", [run(1.0, 2.0, 100), run(9.0, 9.0, 110), run(2.0, 3.0, 90)])
    ref = bench.summarise("fast", [run(4.0, 6.0, 200), run(1.0, 1.0, 200), run(6.0, 9.0, 220)])
    assert ours["median_wall_s"] == 2.0 and ref["median_wall_s"] == 4.0  # not the fastest run
    assert ours["peak_pss_mb"] == 110
    line = bench.ratio_line(ours, ref)
    assert "2.00x tokens/s wall" in line and "2.00x tokens/cpu-s" in line and "0.50x peak PSS" in line, line
    assert bench._pss_bytes(os.getpid()) > 0
