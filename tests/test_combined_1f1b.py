"""The combined 1F1B protocol (parallel.moe_a2a_overlap = Megatron-Core's overlap_moe_expert_parallel_comm).

Megatron-Core 0.19.2's combined schedule (``pipeline_parallel/combined_1f1b.py``) calls
``forward_step_func(data_iterator, unwrapped_gpt_model, return_schedule_plan=True)`` and asserts that the first
value returned is an ``AbstractSchedulePlan`` (Megatron-LM ``pretrain_gpt.py`` ``forward_step`` returns
``model.build_schedule_plan(tokens, position_ids, attention_mask, labels=labels, loss_mask=loss_mask)``).

What runs on CPU torch, and where it stops:
- as shipped (models/cpu_compat.py only), ``GPTModel.build_schedule_plan`` stops at
  ``models/common/model_chunk_schedule_plan.py:376`` ``self._event = torch.cuda.Event()``, and the combined
  schedule itself earlier, at ``pipeline_parallel/utils.py:392`` ``torch.cuda.Stream(device="cuda")`` (set_streams);
  both are asserted below, so an upstream change of that line shows here;
- with the test-only stream bridge (tests/_combined_1f1b_worker.py ``cpu_streams``: no-op streams/events for the
  six schedule-plan modules, ``Tensor.record_stream`` ignoring them) the whole combined schedule runs with EP=2
  on two gloo ranks: Megatron's own schedule plan, fine-grained layer callables (attention, dispatch all-to-all,
  experts, combine all-to-all) and loss node, forward of one microbatch beside backward of another; its losses and
  every gradient equal plain 1F1B's exactly. What that cannot show is the stream overlap itself (CPU ops are
  synchronous), which only the GPU lane can.
"""
from __future__ import annotations

import json
import traceback

import pytest
import torch

from _rank_harness import ROOT, run_worker  # noqa: E402
SEQ = 32
MOE_TINY = ["recipe=smoke", "data=mock", "model.num_experts=4", "parallel.tensor=1", "parallel.pipeline=1",
            "model.num_layers=2", "model.hidden_size=64", "model.ffn_hidden_size=128",
            "model.num_attention_heads=4", "model.num_query_groups=2", f"model.seq_length={SEQ}",
            "model.vocab_size=1024", "model.make_vocab_size_divisible_by=64", "train.micro_batch_size=2"]


@pytest.fixture(scope="module")
def moe_chunk():
    """A tiny MoE GPTModel (alltoall dispatcher) in a world-1 process group, with the overlap flag on its config."""
    from _rank_harness import single_process_group
    from launcher.config import compose_job
    from models.builder import build_model

    single_process_group()
    job = compose_job([*MOE_TINY, "train.global_batch_size=2", "cluster.gpus_per_node=1"])
    assert job.model.moe_token_dispatcher_type == "alltoall"
    chunk = build_model(model=job.model, parallel=job.parallel, precision=job.precision, schedule=job.schedule)[0]
    # TransformerConfig asserts EP > 1 and bf16 for the flag (GPU rules); one CPU process has EP 1 and fp32
    chunk.config.overlap_moe_expert_parallel_comm = True
    yield chunk
    chunk.config.overlap_moe_expert_parallel_comm = False


def _batch(seed: int = 0) -> dict:
    g = torch.Generator().manual_seed(seed)
    mask = torch.ones(2, SEQ)
    mask[1, -5:] = 0
    return {"tokens": torch.randint(0, 1000, (2, SEQ), generator=g),
            "labels": torch.randint(0, 1000, (2, SEQ), generator=g),
            "loss_mask": mask, "position_ids": torch.arange(SEQ).repeat(2, 1)}


def test_forward_step_returns_megatrons_schedule_plan(moe_chunk):
    from _combined_1f1b_worker import cpu_streams
    from megatron.core.models.common.model_chunk_schedule_plan import TransformerModelChunkSchedulePlan
    from megatron.core.pipeline_parallel.utils import AbstractSchedulePlan, NoopScheduleNode

    from launcher.rank import loop
    from launcher.rank.batch import masked_token_loss

    batch = _batch()
    with cpu_streams():
        plan, loss_func = loop.forward_step(iter([batch]), moe_chunk, return_schedule_plan=True)
    assert isinstance(plan, AbstractSchedulePlan) and type(plan) is TransformerModelChunkSchedulePlan
    assert plan.num_layers() == 2 and plan.post_process is not None  # the last stage's output layer + loss node
    for i in range(2):  # MoE layers: real dispatch/combine nodes, not no-ops
        assert not isinstance(plan.get_layer(i).moe_dispatch, NoopScheduleNode)
    state = plan.state  # what build_schedule_plan was given: pretrain_gpt.py's inputs
    assert state.model is moe_chunk and state.attention_mask is None
    for ours, theirs in (("tokens", "input_ids"), ("position_ids", "position_ids"), ("labels", "labels"),
                         ("loss_mask", "loss_mask")):
        assert torch.equal(getattr(state, theirs), batch[ours]), theirs
    assert loss_func.func is masked_token_loss and torch.equal(loss_func.args[0], batch["loss_mask"])


def test_schedule_plan_gets_this_cp_ranks_slice(moe_chunk, monkeypatch):
    """Context parallelism slices before the plan is built, as before the plain forward (pretrain_gpt.py get_batch
    slices for both); CP itself needs TE attention, so the slice is stood in for."""
    from _combined_1f1b_worker import cpu_streams

    from launcher.rank import loop

    half = lambda b: {k: v[:, : SEQ // 2] for k, v in b.items()}  # noqa: E731
    monkeypatch.setattr(loop, "slice_batch_for_context_parallel", half)
    batch = _batch(1)
    with cpu_streams():
        plan, loss_func = loop.forward_step(iter([batch]), moe_chunk, return_schedule_plan=True)
    assert torch.equal(plan.state.input_ids, batch["tokens"][:, : SEQ // 2])
    assert torch.equal(loss_func.args[0], batch["loss_mask"][:, : SEQ // 2])


def test_plain_forward_unchanged_and_flag_required(moe_chunk):
    from launcher.rank import loop

    batch = _batch(2)
    out, loss_func = loop.forward_step(iter([batch]), moe_chunk)  # the two-argument call of the other schedules
    assert out.shape == (2, SEQ)  # per-token losses
    ref = moe_chunk(batch["tokens"], batch["position_ids"], None, labels=batch["labels"])
    assert torch.equal(out, ref)
    moe_chunk.config.overlap_moe_expert_parallel_comm = False
    try:
        with pytest.raises(RuntimeError, match="parallel.moe_a2a_overlap=true"):
            loop.forward_step(iter([batch]), moe_chunk, return_schedule_plan=True)
    finally:
        moe_chunk.config.overlap_moe_expert_parallel_comm = True


def test_without_the_stream_bridge_the_plan_stops_at_the_cuda_event(moe_chunk):
    from launcher.rank import loop

    with pytest.raises(RuntimeError) as info:
        loop.forward_step(iter([_batch()]), moe_chunk, return_schedule_plan=True)
    last = [f for f in traceback.extract_tb(info.value.__traceback__) if "megatron/core" in f.filename][-1]
    assert last.filename.endswith("models/common/model_chunk_schedule_plan.py")
    assert last.line.strip() == "self._event = torch.cuda.Event()", last


def test_combined_schedule_equals_1f1b_with_expert_parallelism(tmp_path):
    """Two gloo ranks, EP=2: Megatron-Core's combined 1F1B (no pipelining) vs plain 1F1B, 4 microbatches."""
    out = tmp_path / "cb"
    overrides = [o for o in MOE_TINY] + ["parallel.expert=2", "train.global_batch_size=16", "cluster.gpus_per_node=2"]
    proc = run_worker(ROOT / "tests" / "_combined_1f1b_worker.py", [out, *overrides], 2, "the combined 1F1B worker")
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    for r in range(2):
        rep = json.loads((out / f"rank-{r}.json").read_text())
        stop = rep["stops_at"]  # as shipped: the schedule's first CUDA call
        assert (stop["file"], stop["code"]) == ("megatron/core/pipeline_parallel/utils.py",
                                                'comm_stream = torch.cuda.Stream(device="cuda")'), stop
        assert len(rep["losses_combined"]) == 4 and rep["losses_combined"] == rep["losses_1f1b"], rep
        experts = [g for name, g in rep["grads"].items() if "local_experts" in name]
        assert experts and all(g["max_abs"] > 0 for g in experts)  # the experts were reached and trained
        for name, g in rep["grads"].items():
            assert g["max_abs_diff"] <= 1e-6 * max(g["max_abs"], 1e-12), (r, name, g)
