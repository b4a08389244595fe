"""data.preprocess --slurm: shards by bytes, rendering rules, manifest/resume, final check and blend; and the
whole flow on the local Slurm cluster (slurm/localhost/start.sh) with one task SIGKILLed and resubmitted."""
from __future__ import annotations

import glob
import json
import os
import re
import shlex
import signal
import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import pytest

from data import slurm_array
from _data_text import TOKENIZER, real_texts, write_jsonl

ROOT = Path(__file__).resolve().parent.parent
SETTINGS = {"tokenizer": str(TOKENIZER), "append_eod": True, "json_key": "text", "eod_token": None,
            "chunk_mb": 0.05, "backend": "tokenizers", "cache_budget_mb": 256, "workers": 1}


def _corpus(root: Path, n_files: int = 6, repeat: int = 1) -> list:
    """n_files JSONL inputs in two directories, alternately plain and gzip; returns them in sorted order."""
    texts = real_texts(120, repeat=repeat)
    per = len(texts) // n_files
    for i in range(n_files):
        sub = root / ("a" if i < n_files // 2 else "b")
        sub.mkdir(parents=True, exist_ok=True)
        write_jsonl(sub / (f"part{i}.jsonl" + (".gz" if i % 2 else "")), texts[i * per:(i + 1) * per])
    return sorted(glob.glob(str(root / "**" / "*.jsonl*"), recursive=True))


def test_group_by_bytes_keeps_order_and_never_splits_a_file(tmp_path):
    sizes = [5, 5, 5, 30, 1, 1, 12]
    paths = []
    for i, n in enumerate(sizes):
        (tmp_path / f"f{i}").write_bytes(b"x" * n)
        paths.append(str(tmp_path / f"f{i}"))
    groups = slurm_array.group_by_bytes(paths, 10)
    assert [p for g in groups for p in g] == paths
    assert [[os.path.getsize(p) for p in g] for g in groups] == [[5, 5], [5], [30], [1, 1], [12]]
    assert slurm_array._array_spec([0, 1, 2, 5, 7, 8], 4) == "0-2,5,7-8%4"


def test_render_quotes_values_refuses_unsafe_directives_and_checks_mounts(tmp_path):
    files = _corpus(tmp_path / "in dir's", n_files=2)
    hostile = slurm_array.plan(files, str(tmp_path / "out $(touch pwned)" / "c"), SETTINGS, shard_bytes=1 << 30)
    with pytest.raises(SystemExit, match=r"--output-prefix \(its logs directory\)=.*may hold only"):
        slurm_array.render(hostile, {})  # it would reach #SBATCH --output, which is not shell-quoted
    manifest = slurm_array.plan(files, str(tmp_path / "out" / "c"), SETTINGS, shard_bytes=1 << 30)
    python = str(tmp_path / "py $(touch pwned)" / "python")
    texts = slurm_array.render(manifest, {"secret_env": ["HF_TOKEN"], "partition": "gpu", "time": "01:00:00",
                                          "python": python})
    for text in texts.values():
        assert subprocess.run(["bash", "-n"], input=text, text=True).returncode == 0
        assert "$(touch pwned)" not in text.replace(shlex.quote(python), "")  # only inside quotes
        assert "#SBATCH --partition=gpu" in text and "HF_TOKEN" in text
        assert not any(i["path"] in text for s in manifest["shards"] for i in s["inputs"])  # inputs: manifest only
        assert os.environ.get("HF_TOKEN", "\0") not in text  # by name only
    assert "attempts=3" in texts["array"] and "--finalize" in texts["finalize"]
    with pytest.raises(SystemExit, match=r"--partition='gpu\\nrm -rf /'.*may hold only"):
        slurm_array.render(manifest, {"partition": "gpu\nrm -rf /"})
    with pytest.raises(SystemExit, match="--secret-env"):
        slurm_array.render(manifest, {"secret_env": ["X=1"]})
    with pytest.raises(SystemExit, match="does not mount"):
        slurm_array.render(manifest, {"container_image": "img.sqsh", "container_mounts": f"{ROOT}:{ROOT}"})
    mounts = f"{tmp_path}:{tmp_path},{ROOT}"
    text = slurm_array.render(manifest, {"container_image": "img.sqsh", "container_mounts": mounts})
    assert "--container-image=img.sqsh" in text["array"]


def test_zst_without_zstandard_is_one_clear_error(tmp_path, monkeypatch):
    from data import corpus as preprocess  # the engine: expand_inputs reads _zstandard there

    (tmp_path / "a.jsonl.zst").write_bytes(b"\x28\xb5\x2f\xfd")
    monkeypatch.setattr(preprocess, "_zstandard", lambda: None)
    with pytest.raises(SystemExit, match=r"\.zst input needs the 'zstandard' module"):
        preprocess.expand_inputs([str(tmp_path / "*.zst")])


def test_tasks_final_check_and_blend_equal_one_process_run(tmp_path):
    """Without Slurm: each task in turn, a rerun skips, a changed input is refused, the blend pre-flights clean."""
    from launcher.data_preflight import preflight
    from data.preprocess import preprocess

    files = _corpus(tmp_path / "corpus")
    prefix = str(tmp_path / "out" / "c")
    manifest = slurm_array.load_or_create_manifest(slurm_array.plan(files, prefix, SETTINGS, shard_bytes=300_000))
    n = len(manifest["shards"])
    assert n >= 3 and slurm_array.pending(manifest) == list(range(n))
    mpath = str(slurm_array.paths_of(manifest["output_prefix"])["manifest"])
    assert slurm_array.finalize(mpath) == 1  # nothing done yet: refused, no blend
    for i in range(n):
        assert slurm_array.run_task(mpath, i) == 0
    assert slurm_array.pending(manifest) == []
    assert slurm_array.finalize(mpath) == 0
    done = json.loads(Path(mpath).read_text())
    blend = json.loads(Path(prefix + ".blend.json").read_text())
    tokens = [s["tokens"] for s in done["shards"]]
    assert blend[1::2] == [s["prefix"] for s in done["shards"]]
    assert blend[0::2] == pytest.approx([t / sum(tokens) for t in tokens])
    from launcher.config import compose_job  # the file as it stands is a launcher override

    override = "data.blend=" + Path(prefix + ".blend.json").read_text().rstrip("\n")  # as "$(cat FILE)" gives it
    job = compose_job(["recipe=smoke", "data.kind=indexed", override])
    assert list(job.data.blend) == blend
    data = SimpleNamespace(kind="indexed", blend=blend, tokenizer=str(TOKENIZER), split="99,1,0")
    assert [p for p in preflight(data, vocab_size=8192, tokens_needed=1000) if p.severity == "error"] == []
    from launcher.rank.datasets import build_gpt_datasets  # the rank side reads the blend as training would

    train, _, _ = build_gpt_datasets(data=job.data.__class__(kind="indexed", blend=blend, split="100,0,0",
                                                             tokenizer=str(TOKENIZER)),
                                     seq_length=64, seed=1, train_samples=400, valid_samples=0, test_samples=0,
                                     cache_dir=str(tmp_path / "cache"))
    drawn = {int(i) for i in train.dataset_index}
    assert drawn == set(range(n)) and train[0]["tokens"].shape[0] == 64 and int(train[0]["tokens"].max()) < 8192
    preprocess(files, str(TOKENIZER), str(tmp_path / "one"), append_eod=True, quiet=True)
    _assert_concatenation_equals(done, tmp_path / "one")
    os.utime(files[0], ns=(1, 1))  # an input changed since: the manifest is refused, not silently reused
    with pytest.raises(SystemExit, match="describes other inputs"):
        slurm_array.load_or_create_manifest(slurm_array.plan(files, prefix, SETTINGS, shard_bytes=300_000))


def _assert_concatenation_equals(manifest: dict, single: Path) -> None:
    from launcher.core.indexed_files import read_index_header

    joined = b"".join(Path(s["prefix"] + ".bin").read_bytes() for s in manifest["shards"])
    assert joined == Path(str(single) + ".bin").read_bytes()
    docs = sum(read_index_header(s["prefix"] + ".idx").document_count - 1 for s in manifest["shards"])
    assert docs == read_index_header(str(single) + ".idx").document_count - 1 == manifest["documents"]


# --- on the local Slurm cluster ---------------------------------------------------------------------------

from test_slurm_localhost import FINAL, job_info, slurm  # noqa: E402,F401  (the cluster fixture)


def _wait(job_id: str, timeout_s: float) -> dict:
    deadline, info = time.monotonic() + timeout_s, {}
    while time.monotonic() < deadline:
        info = job_info(job_id) or info
        if info.get("JobState") in FINAL:
            return info
        time.sleep(0.5)
    subprocess.run(["scancel", job_id], capture_output=True, timeout=30)
    raise AssertionError(f"job {job_id} not finished after {timeout_s:.0f} s: {info.get('JobState')}")


def _submit(files_glob: str, prefix: str) -> str:
    cmd = [sys.executable, "-m", "data.preprocess", "--input", files_glob, "--tokenizer", str(TOKENIZER),
           "--output-prefix", prefix, "--append-eod", "--slurm", "--shard-size-mb", "0.45", "--retries", "0",
           "--time", "00:05:00", "--workers", "1", "--backend", "tokenizers", "--chunk-mb", "0.05"]
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=120,
                          env=dict(os.environ, PYTHONPATH=str(ROOT)))
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return proc.stdout


def _kill_when_writing(shard_prefix: str, array_job: str, timeout_s: float = 120) -> int:
    """SIGKILL the task writing shard_prefix once it has written tokens (pid from its partial file's name)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        for part in glob.glob(shard_prefix + ".bin.partial-*"):
            try:
                if os.path.getsize(part) > 0:
                    pid = int(part.rsplit(".partial-", 1)[1].split("-")[0])
                    os.kill(pid, signal.SIGKILL)
                    return pid
            except (FileNotFoundError, ProcessLookupError):
                pass
        assert not os.path.exists(shard_prefix + ".idx"), "the task finished before it could be killed"
        time.sleep(0.02)
    subprocess.run(["scancel", array_job], capture_output=True, timeout=30)
    raise AssertionError(f"no partial output of {shard_prefix} within {timeout_s} s")


@pytest.mark.multirank  # it also trains the embedded default (python -m launcher) on the prepared blend
def test_array_on_local_slurm_killed_task_resubmitted_equals_one_process_run(slurm, tmp_path):
    from data.preprocess import preprocess

    files = _corpus(tmp_path / "corpus", n_files=6, repeat=2)  # ~2.4 MB: 3 shards of ~0.8 MB
    prefix = str(tmp_path / "out" / "corpus")
    out = _submit(str(tmp_path / "corpus" / "**" / "*.jsonl*"), prefix)
    array_job = re.search(r"submitted: array job (\d+) \((\d+) tasks\)", out)
    final_job = re.search(r"submitted: final check job (\d+)", out).group(1)
    manifest = json.loads(Path(prefix + ".manifest.json").read_text())
    n = len(manifest["shards"])
    assert n >= 3 and int(array_job.group(2)) == n, out
    victim = manifest["shards"][1]["prefix"]
    _kill_when_writing(victim, array_job.group(1))
    info = _wait(final_job, 180)  # afterany: the final step runs and reports the missing shard
    logs = slurm_array.paths_of(prefix)["logs"]
    final_log = (logs / f"final-{final_job}.out").read_text()
    assert info["JobState"] == "FAILED", f"{info}\n{final_log}"
    assert "shard 1: not complete" in final_log and "resubmits only the 1 incomplete shard" in final_log, final_log
    assert not os.path.exists(victim + ".bin") and not os.path.exists(prefix + ".blend.json")
    assert glob.glob(victim + ".*.partial-*"), "SIGKILL leaves the partial behind (no handler runs)"

    out = _submit(str(tmp_path / "corpus" / "**" / "*.jsonl*"), prefix)  # the same command again
    assert f"{n} shards, {n - 1} already complete" in out and "(1 tasks)" in out, out
    final_job = re.search(r"submitted: final check job (\d+)", out).group(1)
    info = _wait(final_job, 180)
    final_log = (logs / f"final-{final_job}.out").read_text()
    assert info["JobState"] == "COMPLETED", f"{info}\n{final_log}"
    assert f"all {n} shards checked" in final_log, final_log
    assert not glob.glob(prefix + "*.partial-*")  # the stale partial of the killed task is gone
    preprocess(files, str(TOKENIZER), str(tmp_path / "one"), append_eod=True, quiet=True)
    manifest = json.loads(Path(prefix + ".manifest.json").read_text())
    _assert_concatenation_equals(manifest, tmp_path / "one")
    from test_data_blend_training import train_on_blend  # then a short training run on the resulting blend

    train_on_blend(tmp_path, manifest, Path(prefix + ".blend.json"))


def test_zst_input_streams_and_equals_plain(tmp_path):
    """zstandard is a dev dependency (pyproject's `dev` extra), so this runs rather than skips. The .zst file is
    two frames, the first written by a streaming compressor (no content size in its header), as `zstd` and
    concatenated dumps produce; read in 0.05 MB blocks, it must give the plain file's tokens and documents."""
    import zstandard

    from launcher.core.indexed_files import read_index_header
    from data.preprocess import preprocess

    texts = real_texts(30)
    plain = write_jsonl(tmp_path / "c.jsonl", texts)
    raw = plain.read_bytes()
    cut = raw.index(b"\n", len(raw) // 2) + 1
    with open(tmp_path / "c.jsonl.zst", "wb") as f:
        with zstandard.ZstdCompressor().stream_writer(f, closefd=False) as w:
            w.write(raw[:cut])
        f.write(zstandard.ZstdCompressor().compress(raw[cut:]))
    preprocess([str(plain)], str(TOKENIZER), str(tmp_path / "a"), append_eod=True, quiet=True, chunk_mb=0.05)
    preprocess([str(tmp_path / "c.jsonl.zst")], str(TOKENIZER), str(tmp_path / "b"), append_eod=True, quiet=True,
               chunk_mb=0.05)
    a, b = (Path(str(tmp_path / x) + ".bin").read_bytes() for x in "ab")
    assert len(a) > 10_000 and a == b
    assert read_index_header(str(tmp_path / "b") + ".idx").document_count - 1 == len(texts)


def test_array_task_retries_a_failed_attempt_a_bounded_number_of_times(tmp_path):
    """The rendered task script, run by bash with a stand-in srun that fails its first FAILS calls."""
    files = _corpus(tmp_path / "corpus", n_files=2)
    manifest = slurm_array.plan(files, str(tmp_path / "out" / "c"), SETTINGS, shard_bytes=1 << 30)
    script = tmp_path / "array.sbatch"
    script.write_text(slurm_array.render(manifest, {"retries": 2})["array"])
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "srun").write_text('#!/bin/bash\nn=$(cat "$COUNT" 2>/dev/null || echo 0); echo $((n + 1)) >"$COUNT"\n'
                                  '(( n < FAILS )) && exit 7\necho "ran: $*"\n')
    (bin_dir / "srun").chmod(0o755)

    def run(fails: int):
        count = tmp_path / f"count{fails}"
        env = dict(os.environ, PATH=f"{bin_dir}:{os.environ['PATH']}", COUNT=str(count), FAILS=str(fails),
                   SLURM_ARRAY_TASK_ID="0", SLURM_ARRAY_JOB_ID="42")
        proc = subprocess.run(["bash", str(script)], capture_output=True, text=True, env=env, timeout=30)
        return proc, int(count.read_text())

    proc, calls = run(2)
    assert proc.returncode == 0 and calls == 3, proc.stdout + proc.stderr
    assert "attempt 3 of 3" in proc.stdout and "--task-index 0" in proc.stdout
    proc, calls = run(5)
    assert proc.returncode == 7 and calls == 3, proc.stdout + proc.stderr  # bounded: 1 + retries attempts
    assert "shard 0 failed 3 time(s)" in proc.stdout


def test_resubmission_is_refused_while_the_previous_one_is_active(tmp_path, monkeypatch):
    log = tmp_path / "submissions.jsonl"
    log.write_text(json.dumps({"array_job": "123", "final_job": "124", "pending": [0]}) + "\n")
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "squeue").write_text('#!/bin/bash\n[[ -n "${ACTIVE:-}" ]] && echo "123_1 RUNNING"; exit 0\n')
    (bin_dir / "squeue").chmod(0o755)
    monkeypatch.setenv("PATH", f"{bin_dir}:{os.environ['PATH']}")
    monkeypatch.setenv("ACTIVE", "1")
    with pytest.raises(SystemExit, match=r"still queued or running \(123_1 RUNNING\).*scancel 123 124"):
        slurm_array._refuse_while_active(log)
    monkeypatch.delenv("ACTIVE")
    slurm_array._refuse_while_active(log)  # finished: resubmitting is fine


GOLDEN = ROOT / "tests" / "golden"


@pytest.mark.parametrize("name", ["array", "finalize"])
def test_rendered_scripts_match_golden(name):
    """Regenerate after an intended template change with: UPDATE_GOLDEN=1 pytest tests/test_data_slurm_array.py"""
    shards = [{"index": i, "prefix": f"/lustre/c4-{i:05d}-of-00002",
               "inputs": [{"path": f"/lustre/corpus/{i}.jsonl.zst", "bytes": 1, "mtime_ns": 1}]} for i in range(2)]
    manifest = {"output_prefix": "/lustre/c4", "shards": shards,
                "settings": dict(SETTINGS, tokenizer="/lustre/tokenizer.json", workers=16)}
    texts = slurm_array.render(manifest, {"partition": "cpu", "account": "llm", "time": "04:00:00", "mem": "32G",
                                          "workdir": "/opt/launcher", "container_image": "/lustre/img.sqsh",
                                          "container_mounts": "/lustre:/lustre,/opt/launcher",
                                          "secret_env": ["HF_TOKEN"], "retries": 2})
    golden = GOLDEN / f"preprocess.{name}.sbatch"
    if os.environ.get("UPDATE_GOLDEN"):
        golden.write_text(texts[name])
    assert texts[name] == golden.read_text()


def test_submitting_side_imports_no_torch(tmp_path):
    """`--slurm` runs on the login node: planning and rendering must not import torch or megatron."""
    _corpus(tmp_path / "corpus", n_files=2)
    code = ("import sys; from data.preprocess import main; "
            f"main(['--input', {str(tmp_path / 'corpus' / '**' / '*.jsonl*')!r}, '--tokenizer', {str(TOKENIZER)!r}, "
            f"'--output-prefix', {str(tmp_path / 'out' / 'c')!r}, '--slurm', '--render-only']); "
            "bad = [m for m in sys.modules if m.split('.')[0] in ('torch', 'megatron')]; assert not bad, bad")
    proc = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "would run: sbatch --array=0" in proc.stdout
