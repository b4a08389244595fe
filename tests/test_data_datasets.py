"""launcher.rank.datasets and launcher.rank.tokenizer: blends, mock data, per-node caches, and no network anywhere."""
from __future__ import annotations

import os
import socket
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from launcher.schema import DataConfig

ROOT = Path(__file__).resolve().parent.parent


def _write_random_dataset(prefix: Path, n_docs: int, seed: int, vocab: int = 8192) -> None:
    from megatron.core.datasets.indexed_dataset import IndexedDatasetBuilder

    rng = np.random.default_rng(seed)
    builder = IndexedDatasetBuilder(str(prefix) + ".bin", dtype=np.uint16)
    for _ in range(n_docs):
        ids = rng.integers(0, vocab - 1, size=int(rng.integers(20, 400)), dtype=np.uint16)
        ids[-1] = 0  # eod
        builder.add_document(ids, [ids.size])
    builder.finalize(str(prefix) + ".idx")


def _data(**kw) -> DataConfig:
    base = dict(kind="indexed", blend=[str(ROOT / "data/assets/smoke_text_document")], split="98,2,0",
                tokenizer=str(ROOT / "data/assets/tokenizer.json"))  # absolute, as the bundle's config.yaml holds them
    base.update(kw)
    return DataConfig(**base)


def test_shipped_dataset_builds_whatever_the_working_directory(tmp_path, monkeypatch):
    from launcher.rank.datasets import build_gpt_datasets

    monkeypatch.chdir(tmp_path)  # the ranks' working directory plays no part (tests/test_relative_paths.py)
    train, valid, test = build_gpt_datasets(data=_data(), seq_length=128, seed=1, train_samples=64,
                                            valid_samples=8, test_samples=0, cache_dir=str(tmp_path / "cache"))
    assert len(train) >= 64 and len(valid) >= 8 and test is None
    sample = train[0]
    assert sample["tokens"].shape == (128,) and int(sample["tokens"].max()) < 8192
    assert (sample["tokens"][1:] == sample["labels"][:-1]).all()
    assert os.listdir(tmp_path / "cache" / socket.gethostname())  # caches written under the node's folder


def test_blended_dataset_draws_within_one_percent_of_weights(tmp_path):
    from launcher.rank.datasets import build_gpt_datasets

    _write_random_dataset(tmp_path / "a", 3000, seed=1)
    _write_random_dataset(tmp_path / "b", 3000, seed=2)
    blend = [0.3, str(tmp_path / "a"), 0.7, str(tmp_path / "b")]
    train, _, _ = build_gpt_datasets(data=_data(blend=blend, split="100,0,0"), seq_length=64, seed=3,
                                     train_samples=20000, valid_samples=0, test_samples=0,
                                     cache_dir=str(tmp_path / "cache"))
    counts = np.bincount(np.asarray(train.dataset_index), minlength=2)
    frac = counts / counts.sum()
    assert counts.sum() >= 20000
    assert abs(frac[0] - 0.3) < 0.01 and abs(frac[1] - 0.7) < 0.01, frac


def test_mock_kind_needs_no_files(tmp_path):
    from launcher.rank.datasets import build_gpt_datasets

    train, valid, test = build_gpt_datasets(data=DataConfig(kind="mock", blend=[], tokenizer=None), seq_length=32,
                                            seed=1, train_samples=16, valid_samples=4, test_samples=4,
                                            cache_dir=str(tmp_path / "cache"), vocab_size=512)
    assert type(train).__name__ == "MockGPTDataset"
    assert int(train[0]["tokens"].max()) < 512


def test_tokenizer_for_megatron():
    from launcher.rank.tokenizer import load_tokenizer

    tok = load_tokenizer(ROOT / "data/assets/tokenizer.json")
    assert tok.vocab_size == 8192 and tok.eod == 0
    text = "def f(x):\n    return x ** 2  # é漢字"
    assert tok.detokenize(tok.tokenize(text)) == text
    with pytest.raises(FileNotFoundError, match="nothing is downloaded"):
        load_tokenizer("some-org/some-model")  # looks like a hub id: must not be fetched


def test_nothing_reaches_for_the_network(tmp_path, monkeypatch):
    """Load tokenizers (both backends), preprocess and build datasets with every socket connect refused."""
    attempts = []

    def refuse(self, address, *a, **k):
        attempts.append(address)
        raise OSError(f"network disabled in this test: connect to {address!r}")

    for var in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE"):
        monkeypatch.delenv(var, raising=False)  # prove it does not depend on the offline flags
    monkeypatch.setattr(socket.socket, "connect", refuse)
    monkeypatch.setattr(socket.socket, "connect_ex", refuse)
    monkeypatch.setattr(socket, "create_connection", lambda address, *a, **k: refuse(None, address))
    monkeypatch.setattr(socket, "getaddrinfo", lambda host, *a, **k: refuse(None, host))

    from launcher.rank.datasets import build_gpt_datasets
    from data.preprocess import preprocess
    from _data_text import TOKENIZER, real_texts, write_jsonl
    from data.encoders import batch_encoder
    from launcher.rank.tokenizer import load_tokenizer

    tok = load_tokenizer(TOKENIZER)
    for backend in ("gigatoken", "tokenizers"):
        flat, lengths = batch_encoder(tok.json, backend=backend).encode(["hello world"])
        assert lengths.tolist() == [len(tok.tokenize("hello world"))]
    src = write_jsonl(tmp_path / "c.jsonl", real_texts(20))
    preprocess([str(src)], str(TOKENIZER), str(tmp_path / "c"), append_eod=True, quiet=True)
    build_gpt_datasets(data=_data(blend=[str(tmp_path / "c")], split="90,10,0"), seq_length=64, seed=1,
                       train_samples=10, valid_samples=2, test_samples=0, cache_dir=str(tmp_path / "cache"))
    assert attempts == []


_NODE_SCRIPT = r"""
import os, sys, torch.distributed as dist
sys.path.insert(0, sys.argv[1])
sys.path.insert(0, sys.argv[1] + "/tests")
from _rendezvous import join
from launcher.schema import DataConfig
from launcher.rank.datasets import build_gpt_datasets
join(int(sys.argv[2]), int(sys.argv[3]), 2)
data = DataConfig(kind="indexed", blend=[sys.argv[1] + "/data/assets/smoke_text_document"], split="98,2,0",
                  tokenizer=sys.argv[1] + "/data/assets/tokenizer.json")
train, valid, _ = build_gpt_datasets(data=data, seq_length=64, seed=7, train_samples=100, valid_samples=10,
                                     test_samples=0, cache_dir=sys.argv[4])
print("SAMPLE", train[5]["tokens"][:16].tolist(), len(train), flush=True)
dist.barrier()
dist.destroy_process_group()
"""


def test_two_nodes_without_a_shared_filesystem(tmp_path):
    """Two ranks as two nodes (LOCAL_RANK 0 each), each with its own cache dir: each builds its own indices."""
    from _rendezvous import host

    store = host(2)  # served by this process while the two "nodes" run
    port = str(store.port)
    procs = []
    for rank in range(2):
        env = dict(os.environ, LOCAL_RANK="0", PYTHONPATH=str(ROOT))
        cache = str(tmp_path / f"node{rank}")
        procs.append(subprocess.Popen([sys.executable, "-c", _NODE_SCRIPT, str(ROOT), port, str(rank), cache],
                                      env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, cwd=tmp_path))
    outs = [p.communicate(timeout=240) for p in procs]
    for p, (out, err) in zip(procs, outs):
        assert p.returncode == 0, err.decode()[-3000:]
    samples = [next(line for line in out.decode().splitlines() if line.startswith("SAMPLE")) for out, _ in outs]
    assert samples[0] == samples[1]
    for rank in range(2):
        assert any(Path(tmp_path / f"node{rank}").rglob("*.npy"))


def test_a_cache_build_holds_the_nodes_build_lock(tmp_path, monkeypatch):
    """Two jobs on one node share its cache folder and Megatron-Core writes the .npy files in place: a builder
    must hold the folder's lock while it checks and writes (the health-probe test's two "nodes" on one machine
    failed at load 40-60, once). Checked from a second open file description, as another process would."""
    import fcntl

    from megatron.core.datasets.blended_megatron_dataset_builder import BlendedMegatronDatasetBuilder

    from launcher.rank.datasets import build_gpt_datasets, node_cache_dir

    held = []
    real_build = BlendedMegatronDatasetBuilder.build

    def build(self):
        with open(os.path.join(node_cache_dir(str(tmp_path)), ".build.lock"), "a") as other:
            try:
                fcntl.flock(other, fcntl.LOCK_EX | fcntl.LOCK_NB)
                held.append(False)
            except BlockingIOError:
                held.append(True)
        return real_build(self)

    monkeypatch.setattr(BlendedMegatronDatasetBuilder, "build", build)
    train, _, _ = build_gpt_datasets(data=_data(), seq_length=64, seed=1, train_samples=32, valid_samples=4,
                                     test_samples=0, cache_dir=str(tmp_path))
    # the first build is the one that checks and writes; a second one (a process group left initialised by an
    # earlier test in this worker: every rank's load-only pass after the barrier) reads hits and needs no lock
    assert len(train) >= 32 and held[0] is True and len(held) <= 2, held
