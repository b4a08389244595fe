"""The tools operators reach for (issue 27): profile.kind=torch|nsys over a step range and ranks, a CUDA memory
snapshot on out-of-memory, and deterministic mode. On CPU: the torch profiler for real, nsys and the memory
snapshot as far as they run without CUDA (rendered scripts: tests/test_golden.py; the calls, stood in)."""
from __future__ import annotations

import json
import os
import re
import subprocess
import sys

import pytest
import torch

from conftest import ROOT
from launcher.config import compose_job
from launcher.rank import profiling


def _spans(trace) -> list:
    events = json.loads(trace.read_text())["traceEvents"]
    return sorted({e["name"] for e in events if str(e.get("name", "")).startswith("ProfilerStep#")})


def _torch_profiled(tmp_path, *, start, end, rank, steps, n):
    """A torch StepProfiler over profile.step_start..step_end-1 = start..end-1 on ``rank``, run through ``steps`` of
    an n x n matmul and closed; returns it and the lines it said."""
    notes = []
    prof = profiling.StepProfiler(kind="torch", start=start, end=end, active=True, bundle=tmp_path, rank=rank,
                                  note=notes.append)
    x = torch.randn(n, n)
    for step in steps:
        prof.before(step)
        (x @ x).sum()
        prof.after(step)
    prof.close()
    return prof, notes


def test_the_torch_profiler_covers_exactly_the_configured_steps(tmp_path):
    prof, notes = _torch_profiled(tmp_path, start=2, end=4, rank=3, steps=range(1, 7), n=32)
    traces = list((tmp_path / "profile" / "torch").glob("rank3.*.pt.trace.json"))
    assert len(traces) == 1 and prof.written == traces[0]
    assert _spans(traces[0]) == ["ProfilerStep#2", "ProfilerStep#3"]
    assert notes == [f"profile: torch trace of steps 2..3 on rank 3: {traces[0]}"]


@pytest.mark.parametrize("kind,active", [("none", True), ("torch", False), ("nsys", True)])
def test_nothing_is_written_where_nothing_is_profiled(tmp_path, kind, active):
    """kind=none, a rank outside profile.ranks, or nsys without CUDA (nsys itself records; the rank only marks
    the capture range with CUDA calls) leave no file."""
    prof = profiling.StepProfiler(kind=kind, start=1, end=3, active=active, bundle=tmp_path, rank=0)
    for step in range(1, 4):
        prof.before(step)
        prof.after(step)
    prof.close()
    assert not (tmp_path / "profile").exists()


def test_nsys_capture_range_opens_and_closes_with_cuda_profiler_calls(tmp_path, monkeypatch):
    calls = []

    class Cudart:
        def cudaProfilerStart(self):
            calls.append("start")

        def cudaProfilerStop(self):
            calls.append("stop")

    class Nvtx:  # torch.autograd.profiler.emit_nvtx needs a CUDA build
        def __init__(self, record_shapes=False):
            pass

        def __enter__(self):
            calls.append("nvtx on")

        def __exit__(self, *exc):
            calls.append("nvtx off")

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "cudart", lambda: Cudart())
    monkeypatch.setattr(torch.autograd.profiler, "emit_nvtx", Nvtx)
    prof = profiling.StepProfiler(kind="nsys", start=2, end=4, active=True, bundle=tmp_path, rank=0)
    for step in range(1, 6):
        prof.before(step)
        calls.append(step)
        prof.after(step)
    assert calls == [1, "start", "nvtx on", 2, 3, "nvtx off", "stop", 4, 5]


def test_a_memory_snapshot_is_dumped_into_the_bundle_on_out_of_memory(tmp_path, monkeypatch):
    from launcher.rank import entry

    recorded, lines = [], []
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda.memory, "_record_memory_history", lambda **kw: recorded.append(kw))
    monkeypatch.setattr(torch.cuda.memory, "_dump_snapshot", lambda path: open(path, "wb").write(b"snapshot"))
    snap = profiling.MemorySnapshot(enabled=True, entries=1234, bundle=tmp_path, rank=5)
    snap.start()
    assert recorded == [{"max_entries": 1234}]
    monkeypatch.setattr(profiling, "SNAPSHOT", snap)

    class Console:
        def line(self, text, all_ranks=False):
            lines.append(text)

    entry._snapshot_on_oom(RuntimeError("an unrelated failure"), Console(), 5)
    assert lines == [] and not snap.path().exists()
    entry._snapshot_on_oom(torch.cuda.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB"), Console(), 5)
    assert (tmp_path / "profile" / "memory-rank5.pickle").read_bytes() == b"snapshot"
    assert lines == [f"rank 5: CUDA memory snapshot at the out-of-memory: {snap.path()} (drag it into "
                     "https://pytorch.org/memory_viz)"]


def test_deterministic_mode_environment_and_refusals(cli):
    from launcher.core.cuda_env import job_env

    env = job_env(compose_job(["recipe=llama3_8b", "cluster=h100", "train.deterministic=true"]))
    assert (env["NCCL_ALGO"], env["NVTE_ALLOW_NONDETERMINISTIC_ALGO"], env["CUBLAS_WORKSPACE_CONFIG"]) == \
        ("Ring", "0", ":4096:8")
    kept = job_env(compose_job(["recipe=llama3_8b", "cluster=h100", "train.deterministic=true",
                                "+cluster.env.NCCL_ALGO=CollnetDirect", "+cluster.env.CUBLAS_WORKSPACE_CONFIG=:16:8"]))
    assert (kept["NCCL_ALGO"], kept["CUBLAS_WORKSPACE_CONFIG"]) == ("CollnetDirect", ":16:8")
    assert "NCCL_ALGO" not in job_env(compose_job(["recipe=llama3_8b", "cluster=h100"]))
    code, out, err = cli("recipe=llama3_8b", "cluster=h100", "train.deterministic=true", "+cluster.env.NCCL_ALGO=Tree",
                         "model.cross_entropy_loss_fusion=true", "action=validate")
    assert code == 2
    refused = [x for x in err.splitlines() if x.startswith("error:")]
    # both alternatives checked (a trailing comma once made the first one unparseable, so it was dropped)
    assert refused[0] == ("error: model.cross_entropy_loss_fusion=True: train.deterministic=true refuses it: the fused "
                          "cross-entropy kernel is not deterministic; try model.cross_entropy_loss_fusion=false or "
                          "train.deterministic=false")
    assert refused[1] == ("error: cluster.env.NCCL_ALGO='Tree': train.deterministic=true: each algorithm must be one of "
                          "Ring, CollnetDirect, CollnetChain, ^NVLS (Tree's reduction order is not fixed); try "
                          "cluster.env.NCCL_ALGO=Ring")


@pytest.mark.parametrize("var", ["MAMBA_DETERMINISTIC", "CAUSAL_CONV1D_DETERMINISTIC"])
def test_deterministic_mode_refuses_what_megatron_refuses_in_the_environment(cli, var):
    """megatron/training/determinism.py apply_determinism_env: MAMBA_DETERMINISTIC and CAUSAL_CONV1D_DETERMINISTIC,
    if set, must start with '1' (unset follows torch.are_deterministic_algorithms_enabled)."""
    code, out, err = cli("recipe=llama3_8b", "cluster=h100", "train.deterministic=true", f"+cluster.env.{var}=0",
                         "action=validate")
    assert code == 2
    assert [x for x in err.splitlines() if x.startswith("error:")] == [
        f"error: cluster.env.{var}='0': train.deterministic=true: must be unset or 1; try cluster.env.{var}=1"]


def test_the_ranks_check_and_fill_the_deterministic_environment_as_megatron_does():
    """The rank's own environment (env.sh's exports, plus whatever the launching shell passed on) is checked and
    completed before any NCCL/cuBLAS/TE use, as Megatron-LM's apply_determinism_env does on os.environ."""
    from launcher.core.determinism import apply_env

    env = {"NCCL_ALGO": "CollnetDirect,Ring"}
    assert apply_env(env) == []
    assert env == {"NCCL_ALGO": "CollnetDirect,Ring", "NVTE_ALLOW_NONDETERMINISTIC_ALGO": "0",
                   "CUBLAS_WORKSPACE_CONFIG": ":4096:8"}
    shell = {"CAUSAL_CONV1D_DETERMINISTIC": "0", "CUBLAS_WORKSPACE_CONFIG": ":0:0"}
    assert [(var, value) for var, value, _ in apply_env(shell)] == [("CUBLAS_WORKSPACE_CONFIG", ":0:0"),
                                                                     ("CAUSAL_CONV1D_DETERMINISTIC", "0")]
    assert "NCCL_ALGO" not in shell  # nothing is filled in once something is refused


def test_a_rank_refuses_a_nondeterministic_environment_before_anything_starts(tmp_path, monkeypatch):
    from launcher.config import job_to_yaml
    from launcher.rank import elastic, entry

    (tmp_path / "config.yaml").write_text(job_to_yaml(compose_job(["recipe=smoke", "train.deterministic=true"])))
    monkeypatch.setenv("MAMBA_DETERMINISTIC", "0")

    def started(*args, **kwargs):
        raise AssertionError("the process group was started with a nondeterministic environment")

    monkeypatch.setattr(elastic, "init_process_group_for_restart", started)
    with pytest.raises(entry.RunRefused) as refused:
        entry.train(tmp_path, console=None)
    assert str(refused.value) == ("train.deterministic=true: MAMBA_DETERMINISTIC='0' in the ranks' environment (the "
                                  "shell that launched them, or env.sh): must be unset or 1; unset it or export "
                                  "MAMBA_DETERMINISTIC=1")


def test_profile_settings_are_validated(cli):
    code, out, err = cli("profile.kind=nsys", "action=validate")
    assert code == 2 and "error: profile.kind='nsys': Nsight Systems captures CUDA work; this job runs on CPU; try " \
                          "profile.kind=torch" in err
    code, out, err = cli("profile.kind=torch", "profile.step_start=5", "profile.step_end=5", "action=validate")
    assert code == 2 and "error: profile.step_end=5: must be after profile.step_start=5" in err
    code, out, err = cli("profile.kind=torch", "profile.ranks=[9]", "action=validate")
    # the alternative is checked like any other (a list of ints once parsed as strings, and was never offered)
    assert code == 2 and "error: profile.ranks=[9]: must name global ranks of this job (0..3); try profile.ranks=[0]" \
        in err.splitlines()
    code, out, err = cli("profile.memory_snapshot=true", "action=validate")
    assert code == 0 and "warning: profile.memory_snapshot=True: records the CUDA caching allocator" in err


def test_profile_and_determinism_do_not_change_the_run_identity():
    from launcher.core.run_identity import run_hash, run_identity

    base = run_hash(run_identity(compose_job(["recipe=smoke"])))
    tools = run_hash(run_identity(compose_job(["recipe=smoke", "profile.kind=torch", "train.deterministic=true"])))
    assert base == tools  # a resumed run may be profiled, or made deterministic, without becoming another run


def test_profile_kind_torch_on_the_embedded_default_leaves_a_trace_in_the_bundle(tmp_path):
    """`python -m launcher profile.kind=torch` (the embedded default: the smoke model, TP2 x PP2 on 4 CPU ranks),
    with train.deterministic=true on the way: rank 0's Chrome trace of steps 2..3 lands in the bundle."""
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1", PYTHONWARNINGS="ignore")
    proc = subprocess.run([sys.executable, "-m", "launcher", "profile.kind=torch", "profile.step_start=2",
                           "profile.step_end=4", "train.train_steps=4", "train.eval_interval=0",
                           "train.deterministic=true", f"output_dir={tmp_path}", "action=run"],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, (proc.stdout[-3000:], proc.stderr[-3000:])
    bundle = next(p for p in tmp_path.iterdir() if (p / "DONE").exists())
    traces = list((bundle / "profile" / "torch").glob("rank0.*.pt.trace.json"))
    assert len(traces) == 1, list((bundle / "profile").rglob("*"))
    assert re.search(rf"^profile: torch trace of steps 2..3 on rank 0: {re.escape(str(traces[0]))}$", proc.stdout,
                     re.MULTILINE), proc.stdout[-2000:]
    trace = json.loads(traces[0].read_text())
    assert {"traceEvents", "distributedInfo"} <= set(trace)
    assert trace["distributedInfo"]["rank"] == 0 and trace["distributedInfo"]["world_size"] == 4
    assert _spans(traces[0]) == ["ProfilerStep#2", "ProfilerStep#3"]
    ops = {e["name"] for e in trace["traceEvents"] if e.get("ph") == "X"}
    assert "aten::mm" in ops or "aten::addmm" in ops, sorted(ops)[:20]
    assert "export NCCL_ALGO=Ring" in (bundle / "env.sh").read_text()


def test_a_run_that_ends_inside_the_profiled_range_names_the_steps_it_traced(tmp_path):
    """profile.step_end past the run's last step (validate allows it: the range is clipped by the run): the trace is
    written when the run ends, and its line names the steps it holds, not the range asked for."""
    prof, notes = _torch_profiled(tmp_path, start=2, end=50, rank=0, steps=range(1, 5), n=8)
    assert notes == [f"profile: torch trace of steps 2..4 on rank 0: {prof.written}"]
    assert prof.written is not None and prof.written.is_file()


def test_a_run_resumed_inside_the_profiled_range_profiles_the_rest_of_it(tmp_path):
    """A requeue that resumes at step 4 of a 2..5 range: the profiler waited for step 2, which never came, and wrote
    nothing; it now records the steps of the range this attempt runs, numbered as the run counts them."""
    prof, notes = _torch_profiled(tmp_path, start=2, end=6, rank=0, steps=range(4, 8), n=8)
    assert prof.written is not None and _spans(prof.written) == ["ProfilerStep#4", "ProfilerStep#5"]
    assert notes == [f"profile: torch trace of steps 4..5 on rank 0: {prof.written}"]
