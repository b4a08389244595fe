"""Fully parallel checkpoint saves (Megatron-LM's default ``fully_parallel_save``, launcher/rank/checkpoint/store.py
``save_strategy``): every data-parallel replica writes an even share of the replicated weights, instead of DP
rank 0 writing all of them; and the ranks' first save-time estimate is the busiest node's bytes over one node's
write bandwidth."""
from __future__ import annotations

import types
from pathlib import Path

import pytest
import torch

from _rank_harness import TINY, layout
from launcher.config import compose_job
from launcher.rank.checkpoint import store as checkpoint


def _bytes_by_rank(ckpt: Path) -> dict:
    """Bytes of the torch_dist data files each rank wrote (they are named __<rank>_<n>.distcp)."""
    out: dict = {}
    for f in ckpt.glob("__*_*.distcp"):
        rank = int(f.name.split("_")[2])
        out[rank] = out.get(rank, 0) + f.stat().st_size
    return out


def test_dp2_ranks_write_even_shares(reference_run):
    """The DP=2 distributed-optimizer run of test_train_resume (same overrides: trained once per session).
    Without the wrapper DP rank 0 writes every weight plus its optimizer shard, rank 1 only its optimizer
    shard (about 2:1 here)."""
    overrides = TINY + layout() + ["parallel.distributed_optimizer=true", "train.train_steps=6",
                                   "checkpoint.save_interval=3", "checkpoint.save_at_end=true"]
    run = reference_run(2, overrides)
    written = _bytes_by_rank(run.bundle / "checkpoints" / "iter_0000006")
    assert sorted(written) == [0, 1], written
    assert max(written.values()) / min(written.values()) < 1.25, written


class _Model(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.dense = torch.nn.Parameter(torch.zeros(1000))              # fp32: 12 bytes/param
        self.expert = torch.nn.Parameter(torch.zeros(400, dtype=torch.bfloat16))  # 14 bytes/param
        self.expert.allreduce = False                                  # Megatron's mark of expert params


def _sizes(monkeypatch, dp: int, edp: int):
    from megatron.core import parallel_state

    from _rank_harness import single_process_group

    single_process_group()
    monkeypatch.setattr(parallel_state, "get_data_parallel_world_size", lambda **k: dp)
    monkeypatch.setattr(parallel_state, "get_expert_data_parallel_world_size", lambda **k: edp)


def test_each_rank_counts_its_share_of_each_replicated_shard(monkeypatch):
    _sizes(monkeypatch, dp=4, edp=2)
    need = checkpoint.checkpoint_shares([_Model()], distributed_optimizer=False)
    assert need["total"] == round(1000 * 12 / 4 + 400 * 14 / 2)  # world 1 here: this rank's share only
    assert need["busiest_node"] == need["total"] and need["nodes"] == 1


def test_busiest_node_sums_the_ranks_of_each_node(monkeypatch):
    """Four ranks, two per node (torchrun numbers them node by node): node 1 (ranks 2, 3) writes most."""
    _sizes(monkeypatch, dp=1, edp=1)
    shares = [10.0, 20.0, 30.0, 5.0]
    monkeypatch.setattr(checkpoint, "_world", lambda: 4)
    monkeypatch.setattr(checkpoint, "_rank", lambda: 0)
    monkeypatch.setattr(checkpoint, "_written_here", lambda model: shares[0])

    def all_reduce(tensor, *a, **k):  # what the other three ranks contribute
        tensor[1:] += torch.tensor(shares[1:], dtype=tensor.dtype)

    monkeypatch.setattr(torch.distributed, "all_reduce", all_reduce)
    need = checkpoint.checkpoint_shares([_Model()], distributed_optimizer=True, ranks_per_node=2)
    assert need == {"total": 65, "busiest_node": 35, "nodes": 2}


def test_first_save_estimate_is_busiest_node_over_node_bandwidth():
    from launcher.rank.training import stop_guard

    job = compose_job(["recipe=smoke", "nodes=4", "cluster.checkpoint_write_gbps=2.0"])
    guard = stop_guard(job, None, int(6e9), lambda s: None)
    assert guard.save_s == pytest.approx(3.0)  # 6 GB on the busiest node at 2 GB/s, not 6 GB / (4 x 2 GB/s)


def test_save_uses_the_fully_parallel_strategy_over_dp(monkeypatch):
    from megatron.core import parallel_state
    from megatron.core.dist_checkpointing.strategies.fully_parallel import FullyParallelSaveStrategyWrapper

    _sizes(monkeypatch, dp=1, edp=1)
    strategy = checkpoint.save_strategy()
    assert isinstance(strategy, FullyParallelSaveStrategyWrapper)
    assert strategy.parallelization_group is parallel_state.get_data_parallel_group(with_context_parallel=True)
