"""tests/_rank_zygote.py, the test-only rank launcher that forks warm ranks instead of starting torchrun: the same
run gives torchrun's losses to the bit, and torchrun's failure rule holds (one rank dies: the others are stopped,
the run fails)."""
from __future__ import annotations

import re
import signal
import os
import time

import pytest

from _rank_harness import TINY, communicate_on_progress, layout, run_train, steps, write_bundle


def test_a_forked_run_equals_the_torchrun_run(tmp_path):
    overrides = TINY + layout(tp=2) + ["train.train_steps=2"]
    forked = run_train(write_bundle(tmp_path / "forked", overrides, 2), 2)
    real = run_train(write_bundle(tmp_path / "torchrun", overrides, 2), 2, env={"LAUNCHER_TEST_TORCHRUN": "1"})
    assert forked.returncode == 0 and real.returncode == 0, forked.stdout[-2000:] + forked.stderr[-2000:]
    assert steps(forked.stdout) and [(s["loss"], s["grad_norm"]) for s in steps(forked.stdout).values()] == \
        [(s["loss"], s["grad_norm"]) for s in steps(real.stdout).values()]
    for name in ("forked", "torchrun"):
        for rank in range(2):
            assert (tmp_path / name / "logs" / f"rank-{rank}.log").read_text().startswith(f"=== rank {rank} started")
    assert "torch.distributed.elastic" not in forked.stderr  # it was not torchrun after all


@pytest.mark.multirank  # starts the ranks through the server directly (conftest's static reading sees no run_train)
def test_one_rank_dying_stops_the_others_and_fails_the_run(tmp_path):
    import _rank_harness

    bundle = write_bundle(tmp_path / "b", TINY + layout(tp=2) + ["train.train_steps=100000"], 2)
    env = _rank_harness.run_env()
    zygote = _rank_harness._zygote_for(env)
    assert zygote is not None, ("the test environment should be the one the rank server serves; differs in "
                                f"{_rank_harness.import_time_diff(env)}")
    proc = zygote.start(bundle, 2, env)
    try:
        for line in iter(proc.stdout.readline, ""):
            if line.startswith("step     2 |"):
                break
        pids = [int(re.search(r"pid (\d+)\)", (bundle / "logs" / f"rank-{r}.log").read_text())[1]) for r in (0, 1)]
        # CI's race made certain: the leader sees rank 1 (killed) and rank 0 (its gloo read failed: exit 1) dead in
        # the same look. The leader is stopped while rank 1 is killed and until rank 0 has ended too.
        os.kill(proc.pid, signal.SIGSTOP)
        try:
            os.kill(pids[1], signal.SIGKILL)
            deadline = time.monotonic() + 180
            while _state(pids[0]) not in ("Z", None) and time.monotonic() < deadline:
                time.sleep(0.2)
            assert _state(pids[0]) == "Z", "rank 0 did not end after its peer was killed"
        finally:
            os.kill(proc.pid, signal.SIGCONT)
        out, err = communicate_on_progress(proc, 240, "the forked run after a rank was killed")
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    assert proc.returncode == 1
    assert f"zygote: rank 1 exited with code {-signal.SIGKILL}; stopping the other ranks" in err
    assert not (bundle / "DONE").exists()


def _state(pid: int):
    """The process's state letter from /proc (Z: ended, not yet reaped); None once it is gone."""
    try:
        return open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()[0]
    except FileNotFoundError:
        return None


def test_what_libraries_write_into_the_test_process_reaches_no_run_and_keeps_the_server(monkeypatch):
    """CI: an in-process test made TorchInductor store TORCHINDUCTOR_CACHE_DIR, and one that built a GPTModel made
    Megatron-Core set NVTE_*_ATTN, in the worker's os.environ: every later run of that worker went to torchrun, with
    the other model's attention backend in its environment. A variable a test sets itself still counts."""
    from _rank_harness import import_time_diff, run_env
    from megatron.core.models.common.language_module.language_module import LanguageModule
    from megatron.core.transformer.enums import AttnBackend
    from torch._inductor.runtime.cache_dir_utils import cache_dir

    for name in ("TORCHINDUCTOR_CACHE_DIR", "NVTE_FLASH_ATTN", "NVTE_FUSED_ATTN", "NVTE_UNFUSED_ATTN"):
        monkeypatch.delenv(name, raising=False)
    cache_dir()

    class Model:  # just what _set_attention_backend reads
        config = type("Config", (), {"attention_backend": AttnBackend.local, "flash_attention_version": None})

    LanguageModule._set_attention_backend(Model())
    assert {"TORCHINDUCTOR_CACHE_DIR", "NVTE_FLASH_ATTN"} <= set(os.environ)  # the premise: the libraries write them
    env = run_env()
    assert import_time_diff(env) == [] and "NVTE_FLASH_ATTN" not in env
    monkeypatch.setenv("MKL_NUM_THREADS", "7")
    assert import_time_diff(run_env()) == ["MKL_NUM_THREADS"]
