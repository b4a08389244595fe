"""launcher.data_preflight: each broken dataset gives one clear message; the login node never imports torch/megatron."""
from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np

from launcher.schema import DataConfig

ROOT = Path(__file__).resolve().parent.parent
SMOKE = ROOT / "data/assets/smoke_text_document"


def _copy_smoke(tmp_path: Path, name: str = "ds") -> Path:
    prefix = tmp_path / name
    for ext in (".bin", ".idx"):
        shutil.copy(str(SMOKE) + ext, str(prefix) + ext)
    return prefix


def _data(blend) -> DataConfig:
    return DataConfig(kind="indexed", blend=blend, split="98,2,0", tokenizer="data/assets/tokenizer.json")


def _run(blend, vocab_size=8192, tokens_needed=100_000):
    from launcher.data_preflight import preflight

    return preflight(_data(blend), vocab_size=vocab_size, tokens_needed=tokens_needed)


def test_shipped_dataset_is_clean():
    assert _run(["data/assets/smoke_text_document"]) == []


def test_mock_has_no_problems():
    from launcher.data_preflight import preflight

    assert preflight(DataConfig(kind="mock"), vocab_size=8192, tokens_needed=10**12) == []


def test_missing_idx(tmp_path):
    prefix = _copy_smoke(tmp_path)
    os.remove(str(prefix) + ".idx")
    [p] = _run([str(prefix)])
    assert p.severity == "error" and p.field == "data.blend[0]"
    assert "ds.idx" in p.line() and "missing" in p.line() and "data.preprocess" in p.hint


def test_truncated_bin(tmp_path):
    prefix = _copy_smoke(tmp_path)
    with open(str(prefix) + ".bin", "r+b") as f:
        f.truncate(os.path.getsize(str(prefix) + ".bin") - 1000)
    [p] = _run([str(prefix)])
    assert p.severity == "error" and "truncated" in p.rule and ".bin is" in p.rule


def test_corrupt_index_header(tmp_path):
    prefix = _copy_smoke(tmp_path)
    with open(str(prefix) + ".idx", "r+b") as f:
        f.write(b"NOTANIDX")
    [p] = _run([str(prefix)])
    assert "bad magic" in p.rule


def test_token_id_at_or_above_vocab(tmp_path):
    prefix = _copy_smoke(tmp_path)
    data = np.memmap(str(prefix) + ".bin", dtype=np.uint16, mode="r+")
    data[12345] = 9000
    data.flush()
    del data
    [p] = _run([str(prefix)], vocab_size=8192)
    assert p.severity == "error" and "largest token id 9000 >= model.vocab_size 8192" in p.rule
    assert "model.vocab_size=9001" in p.hint


def test_dtype_narrower_than_the_vocab_is_a_warning_when_the_ids_fit():
    """A padded vocabulary over a smaller tokenizer (uint16 data, model.vocab_size above 65535) trains in Megatron:
    said as a likely tokenizer mismatch, not refused; ids at or above the vocabulary are still refused."""
    [p] = _run(["data/assets/smoke_text_document"], vocab_size=100_000)
    assert p.severity == "warning" and "uint16 holds ids up to 65535 only" in p.rule, p
    assert "model.vocab_size=100000" in p.rule and "re-tokenize" in p.hint


def test_zero_weight_is_an_error():
    problems = _run([0.0, "data/assets/smoke_text_document", 1.0, "data/assets/smoke_text_document"])
    assert [p.severity for p in problems] == ["error"]
    assert "must be > 0" in problems[0].rule


def test_unnormalised_weights_are_reported():
    problems = _run([2, "data/assets/smoke_text_document", 6, "data/assets/smoke_text_document"])
    [p] = problems
    assert p.severity == "warning" and "normalised to [0.25, 0.75]" in p.rule


def test_more_than_one_epoch_is_a_warning():
    [p] = _run(["data/assets/smoke_text_document"], tokens_needed=10_000_000)
    assert p.severity == "warning" and "epochs" in p.rule and "training tokens are available" in p.rule


def test_mixed_blend_forms():
    [p] = _run([0.5, "a", "b"])
    assert p.field == "data.blend" and "weight, prefix" in p.rule


def test_sampling_for_huge_files(tmp_path, monkeypatch):
    import launcher.data_preflight as pf

    prefix = _copy_smoke(tmp_path)
    monkeypatch.setattr(pf, "SCAN_LIMIT_BYTES", 1 << 20)
    monkeypatch.setattr(pf, "SAMPLE_BLOCK_BYTES", 1 << 16)
    [p] = _run([str(prefix)])
    assert p.severity == "warning" and "sample" in p.rule


def test_preflight_imports_neither_torch_nor_megatron():
    code = ("import sys; from launcher.data_preflight import preflight; from launcher.schema import DataConfig;"
            "d=DataConfig(blend=['data/assets/smoke_text_document'], tokenizer='data/assets/tokenizer.json');"
            "preflight(d, vocab_size=8192, tokens_needed=1000);"
            "bad=[m for m in ('torch','megatron','tokenizers','gigatoken') if m in sys.modules]; print(bad);"
            "sys.exit(1 if bad else 0)")
    r = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True,
                       env=dict(os.environ, PYTHONPATH=str(ROOT)))
    assert r.returncode == 0, r.stdout + r.stderr
