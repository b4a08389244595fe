"""The pipeline schedule's sync hooks, set as Megatron-LM's training.py sets them: with virtual pipelines and the
distributed optimizer's overlapped parameter all-gather, DDP aligns the all-gathers (``align_param_gather``) and the
interleaved schedule dispatches each chunk's through ``config.param_sync_func`` (one ``start_param_sync`` per
chunk); the gradient-reduce hooks under overlap_grad_reduce. Overlap needs CUDA streams, so the DDP wrappers are
stand-ins and the DDP config is the one a GPU rank builds (``on_gpu=True``). And Megatron-LM's first step of a run
without the overlapped parameter all-gather (forward pre-hooks and param_sync_func off until a step has updated the
weights): with stand-ins through ``Loop.run``, and with real Megatron DDP on gloo (tests/_param_gather_worker.py)."""
from __future__ import annotations

import types

import pytest

from launcher.config import compose_job
from launcher.rank import optim


class _Chunk:
    def __init__(self, ddp_config, config):
        self.ddp_config, self.config = ddp_config, config

    def no_sync(self):
        pass

    def start_grad_sync(self):
        pass

    def start_param_sync(self, *a, **k):
        pass


def _hooked(overrides):
    job = compose_job(["recipe=smoke", *overrides])
    ddp = optim.ddp_config(parallel=job.parallel, precision=job.precision, on_gpu=True)
    config = types.SimpleNamespace(finalize_model_grads_func=None, grad_scale_func=None, no_sync_func=None,
                                   grad_sync_func=None, param_sync_func=None)
    chunks = [_Chunk(ddp, config) for _ in range(job.parallel.virtual_pipeline or 1)]
    optim.hook_model_config(chunks, types.SimpleNamespace(scale_loss=lambda x: x), parallel=job.parallel)
    return ddp, config, chunks


VPP = ["parallel.pipeline=2", "parallel.virtual_pipeline=2", "schedule.kind=interleaved"]


def test_virtual_pipelines_align_the_param_gather_per_chunk():
    ddp, config, chunks = _hooked(VPP + ["parallel.distributed_optimizer=true", "parallel.overlap_param_gather=true",
                                        "parallel.overlap_grad_reduce=true"])
    assert ddp.align_param_gather is True
    assert config.param_sync_func == [c.start_param_sync for c in chunks]
    assert config.grad_sync_func == [c.start_grad_sync for c in chunks]
    assert config.no_sync_func == [c.no_sync for c in chunks]


@pytest.mark.parametrize("overrides", [
    ["parallel.pipeline=2", "parallel.distributed_optimizer=true", "parallel.overlap_param_gather=true"],  # no VPP
    VPP + ["parallel.distributed_optimizer=true", "parallel.overlap_param_gather=false"],
    VPP + ["parallel.distributed_optimizer=false", "parallel.overlap_param_gather=true"],
])
def test_no_param_sync_func_without_aligned_overlapped_gather(overrides):
    ddp, config, _ = _hooked(overrides)
    assert ddp.align_param_gather is ("parallel.virtual_pipeline=2" in overrides)
    assert config.param_sync_func is None


def test_one_chunk_gets_functions_not_lists():
    _, config, chunks = _hooked(["parallel.overlap_grad_reduce=true"])
    assert config.no_sync_func == chunks[0].no_sync and config.grad_sync_func == chunks[0].start_grad_sync


def test_cpu_rank_overlaps_nothing():
    job = compose_job(["recipe=smoke", *VPP, "parallel.distributed_optimizer=true"])
    ddp = optim.ddp_config(parallel=job.parallel, precision=job.precision, on_gpu=False)
    config = types.SimpleNamespace(param_sync_func=None, no_sync_func=None, grad_sync_func=None)
    optim.hook_model_config([_Chunk(ddp, config), _Chunk(ddp, config)], types.SimpleNamespace(scale_loss=None),
                            parallel=job.parallel)
    assert (config.param_sync_func, config.no_sync_func, config.grad_sync_func) == (None, None, None)


# ------------------------------------------------- the first step of a run without the overlapped all-gather
# Megatron-LM training.py train(): should_disable_forward_pre_hook -> disable_forward_pre_hook(model,
# param_sync=False) and config.param_sync_func = None before the first iteration; enable_forward_pre_hook and the
# function restored after the first iteration that was not skipped.
class _HookedChunk(_Chunk):
    """Megatron DDP's pre-hook interface, recording calls; registered as DDP registers them at construction."""

    def __init__(self, ddp_config, config, log):
        super().__init__(ddp_config, config)
        self.log, self.remove_forward_pre_hook_handles = log, {"module": "handle"}

    def disable_forward_pre_hook(self, param_sync=True):
        assert self.remove_forward_pre_hook_handles, "disabled twice (DDP asserts)"
        self.log.append(("disable", param_sync))
        self.remove_forward_pre_hook_handles = {}

    def enable_forward_pre_hook(self):
        assert not self.remove_forward_pre_hook_handles, "enabled twice (DDP asserts)"
        self.log.append(("enable",))
        self.remove_forward_pre_hook_handles = {"module": "handle"}


def _run_loop(overrides, steps=3, skipped=()):
    """Loop.run over stand-in chunks (the DDP config a GPU rank builds); per step: (pre-hooks registered,
    param_sync_func set) when the step started. Returns (that list, the hook calls, chunks, config)."""
    from _rank_harness import single_process_group
    from launcher.rank.loop import Loop

    single_process_group()
    job = compose_job(["recipe=smoke", *overrides])
    ddp = optim.ddp_config(parallel=job.parallel, precision=job.precision, on_gpu=True)
    config = types.SimpleNamespace(finalize_model_grads_func=None, grad_scale_func=None, no_sync_func=None,
                                   grad_sync_func=None, param_sync_func=None)
    log = []
    chunks = [_HookedChunk(ddp, config, log) for _ in range(job.parallel.virtual_pipeline or 1)]
    optim.hook_model_config(chunks, types.SimpleNamespace(scale_loss=lambda x: x), parallel=job.parallel)
    lp = Loop(model=chunks, optimizer=None, scheduler=None, train=job.train, seq_length=8, num_microbatches=1,
              kind=job.schedule.kind, dp_size=1, steps=steps, flops_per_token=1.0, tokens_per_step=8)
    seen = []

    def train_step(iterators):
        seen.append((bool(chunks[0].remove_forward_pre_hook_handles), config.param_sync_func is not None))
        lp.step += 1
        return {"local_loss": 1.0, "lr": 0.1, "grad_norm": 1.0, "skipped": lp.step in skipped,
                "nonfinite": lp.step in skipped}

    lp.train_step = train_step
    lp.run([None] * len(chunks), lambda: None)
    return seen, log, chunks, config


OVERLAPPED = ["parallel.distributed_optimizer=true", "parallel.overlap_param_gather=true",
              "parallel.overlap_grad_reduce=true"]


def test_first_step_runs_without_the_pre_hooks_and_param_sync_func():
    seen, log, chunks, config = _run_loop(VPP + OVERLAPPED)
    assert seen == [(False, False), (True, True), (True, True)]
    assert log == [("disable", False)] * 2 + [("enable",)] * 2  # no parameter sync when disabling
    assert config.param_sync_func == [c.start_param_sync for c in chunks]  # the same functions back


def test_a_skipped_first_step_keeps_them_off_until_a_step_updates():
    seen, log, _, _ = _run_loop(VPP + OVERLAPPED, steps=4, skipped=(1, 2))
    assert seen == [(False, False), (False, False), (False, False), (True, True)]
    assert log == [("disable", False)] * 2 + [("enable",)] * 2


def test_a_run_ending_before_an_update_leaves_the_hooks_as_it_found_them():
    seen, log, chunks, config = _run_loop(VPP + OVERLAPPED, steps=1, skipped=(1,))
    assert seen == [(False, False)]
    assert all(c.remove_forward_pre_hook_handles for c in chunks) and config.param_sync_func is not None


@pytest.mark.parametrize("overrides", [
    ["parallel.distributed_optimizer=false", "parallel.overlap_param_gather=true"],  # no pre-hooks to disable
    ["parallel.distributed_optimizer=true", "parallel.overlap_param_gather=false"],
    ["parallel.distributed_optimizer=true", "parallel.overlap_param_gather=true", "parallel.megatron_fsdp=true"],
], ids=["no_distopt", "no_overlap", "fsdp"])
def test_only_the_distributed_optimizers_overlapped_gather_is_held_back(overrides):
    seen, log, _, _ = _run_loop(["parallel.overlap_grad_reduce=true", *overrides])
    assert log == [] and seen == [(True, False)] * 3


def test_pp2_vpp2_dp2_first_step_gathers_nothing_and_losses_are_unchanged(tmp_path):
    """Real Megatron DDP, distributed optimizer, overlapped (aligned) parameter all-gather on gloo, through
    Loop.run: step 1 runs with no forward pre-hook and no param_sync_func, so no bucket all-gather is waited on;
    from step 2 both are back and every forward waits on its buckets' all-gathers; the losses equal those of the
    same job without the overlapped gather (all-gather inside optimizer.step(), the CPU default), bitwise."""
    import json

    from _rank_harness import ROOT, TINY, layout, run_worker

    out = tmp_path / "out"
    overrides = [*TINY, *layout(pp=2, vpp=2), *OVERLAPPED, "train.train_steps=3", "cluster.gpus_per_node=4"]
    proc = run_worker(ROOT / "tests" / "_param_gather_worker.py", [out, *overrides], 4, "the param gather worker")
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-5000:]
    for r in range(4):
        rep = json.loads((out / f"rank-{r}.json").read_text())
        run, ref = rep["overlapped"], rep["reference"]
        assert run["overlap_param_gather"] and not ref["overlap_param_gather"]
        first, *later = run["steps"]
        assert (first["hooks"], first["param_sync_func"], first["gathers_waited"]) == (False, False, 0), (r, first)
        assert all(s["hooks"] and s["param_sync_func"] and s["gathers_waited"] > 0 for s in later), (r, later)
        assert run["hooks_after_run"] and run["param_sync_func_after_run"]
        assert run["losses"] == ref["losses"] and len(run["losses"]) == 3, (r, run["losses"], ref["losses"])
        assert run["why"] == ref["why"] == "done"
