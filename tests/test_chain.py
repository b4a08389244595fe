"""Job chains (issue 44): ``post.export_hf`` and ``post.eval`` run after training for every kept checkpoint, locally
(``action=run``: post.sh after DONE) and through the real one-node Slurm (job.sbatch submits post.sbatch at DONE with
``--dependency=afterok`` on its own id); each checkpoint gets ``hf/`` and ``eval.json``; ``runs`` shows the score (PPL)
and ``status`` the chain. Bad post.* values get one line naming field, value, rule and an alternative.

The jobs are the embedded default (recipe smoke: its model, the shipped corpus and tokenizer) on one rank for two
steps with a checkpoint after each, so there are two checkpoints to walk. Every wait is a hang detector on progress
(tests/test_nothing_lost.py ``wait_for``), never a duration."""
from __future__ import annotations

import json
import math
import re
import subprocess
import sys
from pathlib import Path

from _rank_harness import ROOT, kill_tree
from test_nothing_lost import finish, wait_for
from test_runs_cli import ENV
from test_runs_cli import cli as login

CHAIN = ["recipe=smoke", "cluster.gpus_per_node=1", "parallel.tensor=1", "parallel.pipeline=1",
         "train.train_steps=2", "train.warmup_steps=1", "train.global_batch_size=2", "train.eval_interval=0", "logging.tensorboard=false",
         "checkpoint.save_interval=1", "post.export_hf=true", "post.eval=true", "post.eval_samples=2"]
EVAL_KEYS = {"iteration", "tokens", "loss", "perplexity", "blend"}


def assert_chain_results(bundle: Path) -> list[dict]:
    """Both kept checkpoints hold an HF export and an eval.json of the held-out split; their results, oldest first."""
    ckpts = sorted((bundle / "checkpoints").glob("iter_*"))
    assert [c.name for c in ckpts] == ["iter_0000001", "iter_0000002"], ckpts
    results = []
    for step, ckpt in enumerate(ckpts, 1):
        assert (ckpt / "hf" / "config.json").is_file() and list((ckpt / "hf").glob("*.safetensors")), ckpt
        result = json.loads((ckpt / "eval.json").read_text())
        assert set(result) == EVAL_KEYS and result["iteration"] == step, result
        assert result["tokens"] == 2 * 256 and math.isclose(result["perplexity"], math.exp(result["loss"]),
                                                             rel_tol=1e-4), result
        assert 0 < result["loss"] < math.log(8192) + 1, result  # a trained-for-two-steps model, not garbage
        assert result["blend"].startswith("validation split (98,2,0) of ") and \
            result["blend"].endswith("data/assets/smoke_text_document"), result
        results.append(result)
    return results


def assert_runs_shows_the_score(tmp_path: Path, bundle: Path, newest: dict, scheduler: str) -> dict:
    table = login(tmp_path, "runs").stdout.splitlines()
    assert table[0].split()[-2:] == ["CHECKPOINT", "PPL"], table
    row = next(line.split() for line in table[1:] if line.startswith(bundle.name))
    assert row[-2:] == ["iter_0000002", f"{newest['perplexity']:.2f}"] and scheduler in row, table
    status = login(tmp_path, "status", str(bundle))
    assert re.search(rf"^  iter_0000002: perplexity {newest['perplexity']:.2f} \(loss {newest['loss']:.4f}, 512 "
                     rf"tokens\), hf {re.escape(str(bundle))}/checkpoints/iter_0000002/hf$", status.stdout, re.M), \
        status.stdout
    info = json.loads(login(tmp_path, "status", str(bundle), "--json").stdout)
    assert (info["state"], info["post"], info["score"]) == ("done", "done", newest["perplexity"]), info
    return info


def run_local(tmp_path: Path, name: str) -> tuple[int, str, Path]:
    """`python -m launcher <CHAIN> action=run` to its end, as a user's terminal starts it."""
    proc = subprocess.Popen([sys.executable, "-m", "launcher", *CHAIN, f"output_dir={tmp_path / 'runs'}", f"name={name}",
                             "action=run"], cwd=ROOT, env=ENV, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True, start_new_session=True)
    try:
        wait_for(lambda: proc.poll() is not None, 300, f"run {name} and its post steps to end", tmp_path)
        code, out = finish(proc, 60)
    finally:
        if proc.poll() is None:
            kill_tree(proc.pid)
    bundles = list((tmp_path / "runs").glob(f"{name}-*"))
    assert len(bundles) == 1, out[-3000:]
    return code, out, bundles[0]


def test_a_local_chain_trains_exports_and_evaluates_each_kept_checkpoint(tmp_path):
    code, out, bundle = run_local(tmp_path, "chain")
    assert code == 0, out[-4000:]
    assert "post steps finished with exit code 0" in out and "post: done (2 checkpoint(s))" in out, out[-3000:]
    results = assert_chain_results(bundle)
    assert_runs_shows_the_score(tmp_path, bundle, results[-1], "local")
    state = json.loads((bundle / "post.json").read_text())
    assert (state["state"], state["steps"], [c["iteration"] for c in state["checkpoints"]]) == \
        ("done", ["export_hf", "eval"], [1, 2]), state


def test_bad_post_values_get_one_line_each(cli):
    for args, fragments in (
        (["post.eval=true", "checkpoint.save_at_end=false"],
         ("post.eval=True: runs on the checkpoints training keeps", "try checkpoint.save_at_end=true")),
        (["post.eval=true", "data=mock"], ("post.eval=True: needs held-out tokens", "try ")),
        (["post.eval=true", "post.eval_blend=[/nowhere/heldout]"],
         ("post.eval_blend='/nowhere/heldout': must name a Megatron .bin/.idx prefix", "try post.eval_blend=[]")),
        (["post.eval_samples=0"], ("post.eval_samples=0: must be an integer in [1, 1000000]", "try ")),
    ):
        code, out, err = cli(*args, "action=validate")
        lines = [line for line in err.splitlines() if line.startswith("error: ")]
        assert code == 2 and len(lines) == 1 and all(f in lines[0] for f in fragments), (args, err)


# --- through the local Slurm cluster (tests/test_slurm_localhost.py's fixture starts it, as for every Slurm test) ----

from test_slurm_localhost import FINAL, PROFILE, job_info, slurm  # noqa: E402,F401  (the cluster fixture)


def test_a_slurm_chain_trains_exports_and_evaluates_and_runs_shows_the_score(slurm, tmp_path):
    """``action=submit`` submits training; at DONE its job.sbatch submits post.sbatch with afterok on itself (so the
    post job follows whichever job id reaches DONE: a requeue keeps it, a hang resubmission has a new one);
    the post job exports and evaluates both checkpoints, and ``runs`` shows the newest one's perplexity."""
    submitted = login(tmp_path, *CHAIN, *PROFILE, "slurm.time=00:30:00", "output_dir=runs", "name=sc", "action=submit")
    assert submitted.returncode == 0, submitted.stderr
    train_id = re.search(r"submitted: job (\d+)", submitted.stdout)[1]
    assert f"post steps: job {train_id} submits " in submitted.stdout, submitted.stdout
    (bundle,) = (tmp_path / "runs").glob("sc-*")
    ids = [train_id]
    try:
        def chained():
            info = json.loads(login(tmp_path, "status", "sc", "--json").stdout)
            assert info["state"] in ("pending", "running", "done"), info
            assert info["post"] in ("waiting", "pending", "running", "done"), info
            if info["post_job_id"] and info["post_job_id"] not in ids:
                ids.append(info["post_job_id"])
            if info["state"] == "done" and info["post"] == "waiting" and job_info(train_id).get("JobState") in FINAL:
                raise AssertionError(f"training job {train_id} ended without submitting the post job: {info}")
            return info if info["post"] == "done" else None

        info = wait_for(chained, 300, f"the post job after Slurm job {train_id}", tmp_path)
        post_id = info["post_job_id"]
        assert post_id and post_id != train_id, info
        log = (bundle / "logs" / f"slurm-{train_id}.out").read_text()
        assert f"launcher: submitted the post steps as job {post_id} (--dependency=afterok:{train_id})" in log, log
        assert json.loads((bundle / "post_submission.json").read_text()) == {"job_id": post_id, "after": train_id}
        for job in (train_id, post_id):
            wait_for(lambda: job_info(job).get("JobState") in FINAL | {None}, 120, f"job {job} to end", tmp_path)
            assert job_info(job).get("JobState", "COMPLETED") == "COMPLETED", job_info(job)
        assert json.loads((bundle / "post.json").read_text())["job_id"] == post_id
    finally:
        for job in ids:
            if job_info(job).get("JobState") not in FINAL:
                subprocess.run(["scancel", job], capture_output=True, timeout=30)
    results = assert_chain_results(bundle)
    info = assert_runs_shows_the_score(tmp_path, bundle, results[-1], "slurm")
    assert (info["scheduler"], info["job_id"], info["post_job_id"]) == ("slurm", train_id, post_id), info




def test_the_held_out_tokens_are_the_validation_splits_documents():
    """post.eval reads the documents Megatron-Core's builder gives the validation split (data.split), in order, and
    a post.eval_blend whole from its first document: sequences of seq_length + 1 tokens, each next one seq_length on."""
    import numpy as np
    from megatron.core.datasets.indexed_dataset import IndexedDataset

    from launcher.hf.post import held_out_samples

    prefix = str(ROOT / "data" / "assets" / "smoke_text_document")
    ds = IndexedDataset(prefix)
    n_docs = len(ds.document_indices) - 1
    first_valid = int(round(0.98 * n_docs))
    for whole, doc in ((False, first_valid), (True, 0)):
        stream = np.concatenate([ds[s] for s in range(int(ds.document_indices[doc]), int(ds.document_indices[doc]) + 8)])
        got = held_out_samples([(1.0, prefix)], whole=whole, split="98,2,0", seq_length=16, samples=3).numpy()
        assert got.shape == (3, 17) and (got[1, 0] == got[0, 16]), got
        assert np.array_equal(got.reshape(-1)[:17], stream[:17]) and np.array_equal(got[2], stream[32:49]), whole
