"""Zero bubble under FP8: the bytes a deferred weight-gradient (W) GEMM keeps per element of its operands.

With ``delay_wgrad_compute`` Transformer Engine puts the quantised input and output gradient of each linear into
its ``wgrad_store`` until ``backward_dw`` (module/linear.py, layernorm_linear.py, grouped_linear.py; TE 2.7 to
2.20.0.dev0). The output gradient is quantised for both GEMMs and keeps both copies (rowwise for dgrad,
columnwise for wgrad: on Hopper a separate transpose); the input keeps its columnwise copy only, except a
per-tensor-FP8 input TE all-gathers in backward (column-parallel under SP), which keeps the gathered rowwise copy
and its transpose. MXFP8 and blockwise add one scale byte per 32 elements a copy; on Blackwell one per-tensor FP8
copy serves both layouts. The planner's old rule was 1 byte an element for both operands.
"""
import pytest

from launcher.config import compose_job
from launcher.core import derive
from launcher.plan.memory import memory_per_stage, stage_wgrad_bytes

LLAMA = ["recipe=llama3_8b", "cluster=h100", "parallel.context=1", "schedule.kind=zb_h1"]
SCALED = 1 + 1 / 32
"""One MXFP8 / blockwise copy: 1 byte + an E8M0 scale per 32 elements (MXFP8) or an fp32 per 128 (blockwise)."""


def _job(*extra):
    return compose_job([*LLAMA, *extra])


def _operands(job):
    """Per token of the micro-batch, one dense Llama layer's deferred GEMMs on one rank: (input, gathered by TE in
    backward) and output-gradient widths, counted by hand (qkv, proj, fc1, fc2)."""
    m, lay = job.model, derive(job)
    t, sp = lay.tp, lay.sequence_parallel and lay.tp > 1
    h, f = m.hidden_size, m.ffn_hidden_size
    q, kv = h, m.num_query_groups * (h // m.num_attention_heads)
    inputs = [(h, sp), (q / t, False), (h, sp), (f / t, False)]
    grads = [(q + 2 * kv) / t, h, 2 * f / t, h]
    return inputs, grads


def _expected_layer_bytes(job, in_bytes, gathered_in_bytes, grad_bytes):
    inputs, grads = _operands(job)
    return sum(w * (gathered_in_bytes if g else in_bytes) for w, g in inputs) + grad_bytes * sum(grads)


def _planned_layer_bytes(job, stage=0):
    """One microbatch's pending W of one layer per token, as the planner prices it (stage 0: no output layer)."""
    lay = derive(job)
    n = len([i for chunk in lay.chunk_layers[stage] for i in chunk])
    return stage_wgrad_bytes(job, lay, stage) / (n * job.train.micro_batch_size * job.model.seq_length / lay.cp)


@pytest.mark.parametrize("extra,in_b,gathered_b,grad_b", [
    # Hopper, per-tensor scaling: input's transpose only, output gradient data + transpose.
    (["precision.fp8=delayed", "parallel.tensor=1"], 1, 1, 2),
    (["precision.fp8=tensorwise", "parallel.tensor=1"], 1, 1, 2),
    # ... with TP + SP, qkv and fc1 inputs are all-gathered rowwise and transposed in backward: both kept.
    (["precision.fp8=delayed", "parallel.tensor=2", "parallel.sequence_parallel=true"], 1, 2, 2),
    # Blockwise (Hopper) and MXFP8 (Blackwell): columnwise input (gathered columnwise), both output-gradient copies.
    (["precision.fp8=blockwise", "parallel.tensor=2", "parallel.sequence_parallel=true"],
     SCALED, SCALED, 2 * SCALED),
    (["precision.fp8=mxfp8", "cluster.gpu=B200", "parallel.tensor=2", "parallel.sequence_parallel=true"],
     SCALED, SCALED, 2 * SCALED),
    # Blackwell, per-tensor: one copy serves both layouts (the old 1-byte rule holds there).
    (["precision.fp8=tensorwise", "cluster.gpu=B200", "parallel.tensor=2", "parallel.sequence_parallel=true"],
     1, 1, 1),
    # Without FP8: both operands in bf16, as before.
    (["precision.fp8=null", "parallel.tensor=2", "parallel.sequence_parallel=true"], 2, 2, 2),
])
def test_pending_w_bytes_are_element_counts_times_what_te_keeps(extra, in_b, gathered_b, grad_b):
    job = _job("parallel.pipeline=4", *extra)
    assert _planned_layer_bytes(job) == pytest.approx(_expected_layer_bytes(job, in_b, gathered_b, grad_b), rel=1e-12)


def test_fp8_pending_w_is_more_than_half_of_bf16():
    """The old rule made an FP8 job's pending W exactly half of the bf16 job's (1 byte against 2 per element).
    What TE keeps on Hopper (TP1): inputs 1 byte, output gradients 2, so FP8 / bf16 = (I + 2 O) / (2 (I + O))."""
    fp8 = _job("parallel.pipeline=4", "parallel.tensor=1", "precision.fp8=delayed")
    bf16 = _job("parallel.pipeline=4", "parallel.tensor=1", "precision.fp8=null")
    inputs, grads = _operands(fp8)
    i, o = sum(w for w, _ in inputs), sum(grads)
    ratio = _planned_layer_bytes(fp8) / _planned_layer_bytes(bf16)
    assert ratio == pytest.approx((i + 2 * o) / (2 * (i + o)), rel=1e-12)
    assert ratio > 0.6  # Llama3-8B: 0.809 (the old rule: 0.5)


@pytest.mark.parametrize("kind", ["zb_h1", "zb_v"])
def test_stage_memory_holds_pending_w_at_te_bytes(kind):
    """memory_per_stage's ``pending_wgrad`` is the pending count times one microbatch's W at TE's bytes, on every
    stage, for ZB-H1 and ZB-V; the last stage's output layer (Megatron's own linear) stays in bf16."""
    job = _job("parallel.pipeline=4", "parallel.tensor=1", "precision.fp8=delayed", f"schedule.kind={kind}",
               *(["parallel.virtual_pipeline=null"] if kind == "zb_h1" else []))
    lay = derive(job)
    tokens = job.train.micro_batch_size * job.model.seq_length / lay.cp
    per_layer = _expected_layer_bytes(job, 1, 1, 2) * tokens
    output = 2 * (job.model.hidden_size + lay.padded_vocab / lay.tp) * tokens
    last = 0 if kind == "zb_v" else lay.pp - 1  # ZB-V: rank 0 holds the last stage (and the loss)
    stages = memory_per_stage(job)
    assert any(st.pending_w for st in stages)
    for st in stages:
        n = len([i for chunk in lay.chunk_layers[st.stage] for i in chunk])
        w_mb = n * per_layer + (output if st.stage == last else 0.0)
        assert stage_wgrad_bytes(job, lay, st.stage) == pytest.approx(w_mb, rel=1e-12)
        assert st.parts["pending_wgrad"] == pytest.approx(st.pending_w * w_mb, rel=1e-12)


def test_operand_bytes_table():
    """The per-element table itself, recipe by recipe (Hopper unless B200)."""
    from launcher.plan.memory import wgrad_operand_bytes

    def ob(*extra, gathered):
        return wgrad_operand_bytes(compose_job(["recipe=llama3_8b", "cluster=h100", *extra]), gathered)
    assert ob("precision.fp8=delayed", gathered=False) == (1, 2)
    assert ob("precision.fp8=delayed", gathered=True) == (2, 2)
    assert ob("precision.fp8=tensorwise", "cluster.gpu=B200", gathered=True) == (1, 1)
    assert ob("precision.fp8=mxfp8", "cluster.gpu=B200", gathered=True) == (SCALED, 2 * SCALED)
    assert ob("precision.fp8=blockwise", gathered=False) == (SCALED, 2 * SCALED)
    assert ob("precision.fp8=null", gathered=True) == (2, 2)
    assert ob("precision.fp8=null", "precision.dtype=fp32", gathered=False) == (4, 4)


def test_search_goldens_offer_only_layouts_that_fit():
    """Every layout the search goldens record fits its GPU by the planner's own peak (the search takes a ZB-V
    candidate's re-tuned order only where that order's peak fits too; before, two Llama3-70B rows read 80.4/79.6 GB)."""
    import json
    from pathlib import Path

    for golden in sorted((Path(__file__).parent / "golden").glob("search_*.json")):
        rows = json.loads(golden.read_text())
        assert rows and all(r["peak_gb"] <= r["gpu_memory_gb"] for r in rows), golden.name
