"""A corpus prepared with `data.preprocess --slurm` trains: plain, gzip and zstd inputs are cut into shards, each
shard written by its array task's code, the final step writes the blend, and `python -m launcher` (the real
command, one CPU process) trains the embedded default model on exactly that blend for a few steps."""
from __future__ import annotations

import glob
import json
import math
import os
import subprocess
import sys
from pathlib import Path

import numpy as np

from data import slurm_array
from data.preprocess import expand_inputs
from _data_text import TOKENIZER, real_texts, write_jsonl

ROOT = Path(__file__).resolve().parent.parent
SETTINGS = {"tokenizer": str(TOKENIZER), "append_eod": True, "json_key": "text", "eod_token": None,
            "chunk_mb": 0.05, "backend": "tokenizers", "cache_budget_mb": 256, "workers": 1}
STEPS = 3


def _corpus(root: Path) -> list:
    """Three inputs (plain, .gz, .zst) of real text; the .zst one is written by a streaming compressor."""
    import zstandard

    texts = real_texts(36)
    root.mkdir(parents=True)
    write_jsonl(root / "part0.jsonl", texts[:12])
    write_jsonl(root / "part1.jsonl.gz", texts[12:24])
    plain = write_jsonl(root / "part2.jsonl", texts[24:])
    with open(root / "part2.jsonl.zst", "wb") as f, zstandard.ZstdCompressor().stream_writer(f) as w:
        w.write(plain.read_bytes())
    plain.unlink()
    return expand_inputs([str(root / "*.jsonl*")])


def _prepare(tmp_path: Path) -> tuple:
    """What `--slurm` and its tasks do, in this process: plan + render (no sbatch), each task, the final step."""
    files = _corpus(tmp_path / "corpus")
    prefix = str(tmp_path / "out" / "c")
    out = slurm_array.submit(files, prefix, SETTINGS, {}, shard_bytes=1, render_only=True)  # a shard per file
    assert out["pending"] == [0, 1, 2], out
    for index in out["pending"]:
        assert slurm_array.run_task(out["manifest"], index) == 0
    assert slurm_array.finalize(out["manifest"]) == 0
    # Called in this process, the tasks must import Megatron-Core normally: the command's light import (a bare
    # namespace package) would make later users of megatron in the test process fail or skip.
    assert getattr(sys.modules["megatron.core"], "__file__", None), "run_task left megatron.core a bare namespace"
    manifest = json.loads(Path(out["manifest"]).read_text())
    return manifest, Path(prefix + ".blend.json")


def test_training_reads_the_blend_written_by_the_slurm_array_path(tmp_path):
    manifest, blend_file = _prepare(tmp_path)
    train_on_blend(tmp_path, manifest, blend_file)


def train_on_blend(tmp_path: Path, manifest: dict, blend_file: Path) -> None:
    """`python -m launcher` trains the smoke model for STEPS steps on ``blend_file`` (the final step's output)
    and read samples from every shard of ``manifest`` (also the local-Slurm array test's last step)."""
    shards = [s["prefix"] for s in manifest["shards"]]
    blend = json.loads(blend_file.read_text())
    assert blend[1::2] == shards and all(s["tokens"] > 5000 for s in manifest["shards"])
    cache = tmp_path / "cache"
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore", PYTHONUNBUFFERED="1")
    cmd = [sys.executable, "-m", "launcher", "recipe=smoke", "parallel.tensor=1", "parallel.pipeline=1",
           "cluster.gpus_per_node=1", "data.kind=indexed", "data.blend=" + blend_file.read_text().rstrip("\n"),
           f"data.tokenizer={TOKENIZER}", f"data.cache_dir={cache}", "data.split='100,0,0'",
           f"train.train_steps={STEPS}", "train.eval_interval=0", "train.warmup_steps=1", "train.global_batch_size=4",
           "checkpoint.save_at_end=false", "logging.tensorboard=false", f"output_dir={tmp_path / 'runs'}",
           "action=run"]
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-4000:]
    assert f"finished at step {STEPS} of {STEPS}" in proc.stdout, proc.stdout[-2000:]
    (bundle,) = [p for p in (tmp_path / "runs").iterdir() if (p / "config.yaml").is_file()]
    report = json.loads((bundle / "report" / "metrics.json").read_text())
    losses = [h["loss"] for h in report["steps"]]
    assert len(losses) == STEPS and all(math.isfinite(x) and 0 < x < 20 for x in losses), losses

    # The rank built Megatron's blended dataset over exactly these shards, and drew samples from every one.
    descriptions = [json.loads(Path(p).read_text())
                    for p in glob.glob(str(cache / "*" / "*-BlendedDataset-train-description.txt"))]
    assert len(descriptions) == 1, os.listdir(cache)
    assert [d["dataset_path"] for d in descriptions[0]["datasets"]] == shards, descriptions[0]
    assert descriptions[0]["weights"] == blend[0::2]
    (index_file,) = glob.glob(str(cache / "*" / "*-BlendedDataset-train-dataset_index.npy"))
    assert set(np.load(index_file).tolist()) == set(range(len(shards)))
    per_shard = glob.glob(str(cache / "*" / "*-GPTDataset-train-description.txt"))
    assert sorted(json.loads(Path(p).read_text())["dataset_path"] for p in per_shard) == sorted(shards)
