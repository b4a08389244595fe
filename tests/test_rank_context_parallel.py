"""Context parallelism on real gloo process groups: batch slicing and the CP-correct masked token loss.

Each test starts WORLD processes running this file as a script (one rank each, OMP_NUM_THREADS=1). Every
rank applies the CPU bridges, initialises gloo and Megatron's parallel state, and checks
``launcher.rank.batch`` against references computed here without Megatron's helpers:

- slicing: the sequence in 2*CP chunks, CP rank r keeps chunks r and 2*CP-1-r, in that order, every key;
- loss: a fake differentiable "model" (per-token losses from a parameter ``w``); the loss goes through
  Megatron-Core's own ``forward_step_calc_loss`` (the schedule's scaling of a loss_func result), gradients
  are averaged over the DP x CP group as DDP does, and must equal the single-process full-sequence
  gradient; the reported "lm loss" must equal the full-sequence masked mean. The mask gives the CP ranks
  different token counts, and a naive per-rank mean is shown to give a different gradient.
"""
from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
B, S, VOCAB = 2, 16, 11


# ----------------------------------------------------------------------------------------------- worker
def _full_batch():
    import torch

    g = torch.Generator().manual_seed(1234)
    tokens = torch.randint(0, VOCAB, (B, S), generator=g)
    labels = torch.randint(0, VOCAB, (B, S), generator=g)
    pos = torch.arange(S).unsqueeze(0).expand(B, S).contiguous()
    loss_mask = (torch.rand(B, S, generator=g) > 0.25).float()
    loss_mask[:, 11:] = 0.0  # the tail chunks (held by low CP ranks) are padding: uneven token counts
    return {"tokens": tokens, "labels": labels, "loss_mask": loss_mask, "position_ids": pos}


def _model(w, batch):
    """Per-token 'losses' [b, s_local]: differentiable in w, depending on tokens, labels and positions."""
    return w[batch["tokens"]] * (1.0 + batch["position_ids"].float() / 8.0) + 0.5 * w[batch["labels"]] ** 2


def _reference_slice(x, cp_size, cp_rank):
    chunks = x.chunk(2 * cp_size, dim=1)
    return __import__("torch").cat([chunks[cp_rank], chunks[2 * cp_size - 1 - cp_rank]], dim=1)


def _dp_cp_average(grad):
    """What DDP does with a gradient: scale by 1/|DP x CP| and sum over the DP x CP group."""
    import torch
    from megatron.core import parallel_state

    group = parallel_state.get_data_parallel_group(with_context_parallel=True)
    out = grad.clone() / torch.distributed.get_world_size(group)
    torch.distributed.all_reduce(out, group=group)
    return out


def _schedule_loss(loss_func, output, cp_size):
    """The loss Megatron's schedule back-propagates for one micro-batch (its own scaling code)."""
    from types import SimpleNamespace

    from megatron.core.pipeline_parallel.schedules import forward_step_calc_loss

    store = []
    config = SimpleNamespace(calculate_per_token_loss=False, timers=None)
    scaled, _ = forward_step_calc_loss(None, output, loss_func, config, None, False, 1, store,
                                       cp_group_size=cp_size, is_last_stage=True)
    return scaled, store[0]


def _check_cp(cp_size: int) -> None:
    import torch
    from megatron.core import parallel_state

    from launcher.rank.batch import masked_token_loss, slice_batch_for_context_parallel

    parallel_state.destroy_model_parallel()
    parallel_state.initialize_model_parallel(context_parallel_size=cp_size)
    assert parallel_state.get_context_parallel_world_size() == cp_size
    cp_rank = parallel_state.get_context_parallel_rank()

    full = _full_batch()
    original = {k: v.clone() for k, v in full.items()}
    local = slice_batch_for_context_parallel(full)
    for key in full:
        assert torch.equal(full[key], original[key]), f"input batch[{key!r}] was modified"
        want = _reference_slice(original[key], cp_size, cp_rank)
        assert local[key].shape == (B, S // cp_size), (key, tuple(local[key].shape))
        assert torch.equal(local[key], want), f"CP{cp_size} rank {cp_rank}: batch[{key!r}] sliced wrongly"

    # The training loop's forward_step hands the model exactly this rank's slice (the wiring, not only the
    # helper): a model that records what it is given.
    from launcher.rank.loop import forward_step

    seen = {}

    def recording_model(tokens, position_ids, attention_mask, labels=None, loss_mask=None):
        seen.update(tokens=tokens, position_ids=position_ids, labels=labels)
        return torch.zeros(tokens.shape)

    _, loss_func = forward_step(iter([{k: v.clone() for k, v in original.items()}]), recording_model)
    for key in ("tokens", "position_ids", "labels"):
        assert torch.equal(seen[key], _reference_slice(original[key], cp_size, cp_rank)), f"forward_step {key}"
    assert torch.equal(loss_func.args[0], _reference_slice(original["loss_mask"], cp_size, cp_rank))

    # Single-process reference on the whole sequence.
    w_ref = torch.linspace(-1.0, 1.5, VOCAB).requires_grad_()
    mask = original["loss_mask"].float()
    full_loss = torch.sum(_model(w_ref, original) * mask) / mask.sum()
    full_loss.backward()

    # This CP rank: its slice, our loss through the schedule's scaling, DDP's gradient average.
    w = w_ref.detach().clone().requires_grad_()
    loss, report = _schedule_loss(lambda out: masked_token_loss(local["loss_mask"], out), _model(w, local),
                                  cp_size)
    loss.backward()
    grad = _dp_cp_average(w.grad)
    reported = float(report["lm loss"])
    assert abs(reported - float(full_loss)) < 1e-5, (cp_size, cp_rank, reported, float(full_loss))
    assert torch.allclose(grad, w_ref.grad, rtol=1e-5, atol=1e-6), (cp_size, cp_rank, grad, w_ref.grad)

    # What each rank back-propagates is cp_size * local_sum / global_count.
    local_mask = local["loss_mask"].float()
    local_sum = torch.sum(_model(w_ref.detach(), local) * local_mask)
    assert abs(float(loss) - cp_size * float(local_sum) / float(mask.sum())) < 1e-5

    # The test bites: token counts differ across CP ranks, and a naive per-rank mean is wrong.
    counts = torch.tensor([float(local_mask.sum())])
    all_counts = [torch.zeros(1) for _ in range(cp_size)]
    torch.distributed.all_gather(all_counts, counts, group=parallel_state.get_context_parallel_group())
    assert len({float(c) for c in all_counts}) > 1, all_counts
    w_naive = w_ref.detach().clone().requires_grad_()

    def naive(out):
        m = local["loss_mask"].view(-1).float()
        return torch.sum(out.view(-1) * m) / m.sum().clamp(min=1), {}

    naive_loss, _ = _schedule_loss(naive, _model(w_naive, local), cp_size)
    naive_loss.backward()
    assert not torch.allclose(_dp_cp_average(w_naive.grad), w_ref.grad, rtol=1e-3, atol=1e-4)


def _check_cp1() -> None:
    """CP = 1: the batch comes back as is, the loss is exactly loop.py's former formula, no collectives."""
    import torch
    from megatron.core import parallel_state

    from launcher.rank.batch import masked_token_loss, slice_batch_for_context_parallel

    parallel_state.destroy_model_parallel()
    parallel_state.initialize_model_parallel()
    assert parallel_state.get_context_parallel_world_size() == 1
    full = _full_batch()
    assert slice_batch_for_context_parallel(full) is full

    w = torch.linspace(-1.0, 1.5, VOCAB).requires_grad_()
    output = _model(w, full)
    mask = full["loss_mask"].view(-1).float()
    expected = torch.sum(output.view(-1).float() * mask) / mask.sum().clamp(min=1)

    def refuse(*args, **kwargs):
        raise AssertionError("masked_token_loss called a collective with CP = 1")

    real = torch.distributed.all_reduce
    torch.distributed.all_reduce = refuse
    try:
        loss, report = masked_token_loss(full["loss_mask"], output)
        zero_loss, _ = masked_token_loss(torch.zeros_like(full["loss_mask"]), output)
    finally:
        torch.distributed.all_reduce = real
    assert torch.equal(loss, expected) and torch.equal(report["lm loss"], expected)
    assert float(zero_loss) == 0.0  # clamp(min=1): an all-masked micro-batch gives 0, not NaN
    loss.mul_(3.0)  # the schedule scales the loss in place; the report must not follow
    assert torch.equal(report["lm loss"], expected) and not report["lm loss"].requires_grad


def _worker(world: int, rank: int, port: int, cp_sizes: list) -> None:
    sys.path.insert(0, str(ROOT))
    import datetime

    import torch

    from models import cpu_compat

    cpu_compat.apply()
    from _rendezvous import join

    join(port, rank, world, timeout=datetime.timedelta(seconds=60))
    try:
        for cp in cp_sizes:
            _check_cp1() if cp == 1 else _check_cp(cp)
            torch.distributed.barrier()
    finally:
        torch.distributed.destroy_process_group()


# ------------------------------------------------------------------------------------------------ tests
def _run_ranks(world: int, cp_sizes: list, timeout: float = 600.0) -> None:
    # ``timeout``: a hang detector (the ranks print only at their end, so there is no progress to watch), 10x the
    # 20-60 s these take on a busy 2-core machine; 120 s ran out at load average 67 (issue 25)
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1", PYTHONWARNINGS="ignore")
    from _rendezvous import host

    store = host(world)  # served by this process while the ranks run
    port = str(store.port)
    procs = [subprocess.Popen([sys.executable, __file__, str(world), str(rank), port, ",".join(map(str, cp_sizes))],
                              cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
             for rank in range(world)]
    deadline, outs = time.time() + timeout, []
    try:
        for proc in procs:
            outs.append(proc.communicate(timeout=max(1.0, deadline - time.time()))[0])
    finally:
        for proc in procs:  # only the processes started here
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    failed = [(rank, proc.returncode, out[-4000:]) for rank, (proc, out) in enumerate(zip(procs, outs))
              if proc.returncode != 0]
    assert not failed, "\n".join(f"rank {r} rc={rc}:\n{out}" for r, rc, out in failed)


def test_context_parallel_2_slices_batch_and_gives_full_sequence_loss_and_gradient():
    _run_ranks(2, [2, 1])


def test_context_parallel_4_and_cp2_with_data_parallel_2():
    _run_ranks(4, [4, 2])


if __name__ == "__main__":
    _worker(int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3]), [int(c) for c in sys.argv[4].split(",")])
