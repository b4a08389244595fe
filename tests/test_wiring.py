"""Every schema field is wired: for each recipe, build in this one process -- for rank 0 (and the last
pipeline stage) of the recipe's real layout, Transformer Engine faked only at its import boundary, no GPU --
the exact TransformerConfig, DistributedDataParallelConfig, OptimizerConfig, initialize_model_parallel
arguments, GPTModel arguments, LR scheduler arguments and TE userbuffer call a GPU rank would make, and check
each destination in ``launcher.core.wiring.WIRING`` against the recipe's values, field by field.
"""
from __future__ import annotations

import dataclasses
import sys
import types
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from launcher import schema
from launcher.config import compose_job
from launcher.core import derive
from launcher.core.wiring import BUILT, DDP, GPT, LOGIN, MPU, OPT, SCHED, TC, UB, WIRING

ROOT = Path(__file__).resolve().parents[1]
RECIPES = sorted(p.stem for p in (ROOT / "recipes" / "recipe").glob("*.yaml"))
# Model entries without a recipe of their own, on a layout they validate with: MoE, MTP and MLA reach the
# rank-side objects too.
VARIANTS = {
    "deepseek_v3_mtp": ["recipe=llama3_70b", "model=deepseek_v3", "nodes=32", "parallel.tensor=2",
                        "parallel.pipeline=1", "parallel.virtual_pipeline=null", "parallel.context=1",
                        "parallel.expert=64", "parallel.sequence_parallel=true", "parallel.tp_comm_overlap=false",
                        "schedule.kind=1f1b", "train.global_batch_size=256", "force=true"],
    # NVIDIA's layouts: 405B with embedding and loss counted as pipeline layers (126 + 2 on PP8 x VPP8);
    # DeepSeek-V3 with an explicit per-chunk layout (PP8 x VPP4, MTP on the last chunk)
    "llama405b_account_split": ["recipe=llama405b", "parallel.first_stage_layers=null",
                                "parallel.last_stage_layers=null", "parallel.virtual_pipeline=8",
                                "parallel.account_for_embedding_in_pipeline_split=true",
                                "parallel.account_for_loss_in_pipeline_split=true", "schedule.kind=interleaved",
                                "force=true"],
    # zero bubble at a recipe's layout with its userbuffer TP overlap (issue 22)
    "llama3_70b_zb_h1": ["recipe=llama3_70b", "schedule.kind=zb_h1", "parallel.virtual_pipeline=null",
                         "schedule.overlap_p2p_comm=false"],
    # NVIDIA's best Llama3-8B H100 layout: Megatron-FSDP on one node
    "llama3_8b_fsdp": ["recipe=llama3_8b", "parallel.context=1", "parallel.megatron_fsdp=true",
                       "cluster.env.CUDA_DEVICE_MAX_CONNECTIONS=8"],
    # the precision-aware optimizer (TE's FusedAdam on GPUs; fp8 moments are uint8) and the optimizer CPU offload
    "llama3_70b_precision_aware": ["recipe=llama3_70b", "precision.precision_aware_optimizer=true",
                                   "precision.main_grads_dtype=bf16", "precision.exp_avg_dtype=bf16",
                                   "precision.exp_avg_sq_dtype=fp8"],
    "llama3_8b_cpu_offload": ["recipe=llama3_8b", "precision.precision_aware_optimizer=true",
                              "train.optimizer_cpu_offload=true", "train.optimizer_offload_fraction=0.5",
                              "train.overlap_cpu_optimizer_d2h_h2d=true"],
    # CUDA graphs: TE's per-layer graphs over attention and the MoE router/preprocess (NVIDIA's MoE recipes), and
    # Megatron-Core's local whole-layer graphs on a dense model
    "qwen3_30b_a3b_te_graphs": ["recipe=qwen3_30b_a3b", "train.cuda_graph_impl=transformer_engine",
                                "train.cuda_graph_modules=[attn,moe_router,moe_preprocess]",
                                "train.cuda_graph_warmup_steps=2"],
    "qwen3_30b_a3b_local_router_graphs": ["recipe=qwen3_30b_a3b", "train.cuda_graph_impl=local",
                                          "train.cuda_graph_modules=[attn,moe_router]"],
    "llama3_8b_local_graphs": ["recipe=llama3_8b", "train.cuda_graph_impl=local", "train.cuda_graph_warmup_steps=1"],
    # fine-grained activation offloading: a dense model's attention inputs, and an MoE model's expert inputs beside
    # TE's graphs (attention graphed; the offloaded experts run eagerly), with its fraction and size threshold
    "llama3_70b_activation_offload": ["recipe=llama3_70b", "train.recompute=none",
                                      "train.activation_offload_modules=[qkv_linear,core_attn,attn_proj]",
                                      "train.activation_offload_fraction=0.5",
                                      "train.min_offloaded_tensor_size=4096"],
    "qwen3_30b_a3b_offload_with_graphs": ["recipe=qwen3_30b_a3b", "train.cuda_graph_impl=transformer_engine",
                                          "train.cuda_graph_modules=[attn]",
                                          "train.activation_offload_modules=[expert_fc1,moe_act]"],
    "deepseek_v3_layout": ["recipe=llama3_70b", "model=deepseek_v3", "nodes=128", "parallel.tensor=2",
                           "parallel.pipeline=8", "parallel.virtual_pipeline=4", "parallel.context=1",
                           "parallel.expert=64", "parallel.sequence_parallel=true", "parallel.tp_comm_overlap=false",
                           "parallel.pipeline_model_parallel_layout='Et|(tt|)*30mL'", "schedule.kind=interleaved",
                           "train.global_batch_size=512", "parallel.moe_a2a_overlap=true",
                           "model.cross_entropy_loss_fusion=true", "train.recompute=selective",
                           "train.recompute_modules=[mla_up_proj,mlp]", "force=true"],
}
MLA_FIELDS = {f"model.{n}" for n in ("q_lora_rank", "kv_lora_rank", "qk_head_dim", "qk_pos_emb_head_dim", "v_head_dim")}
"""Fields of MLATransformerConfig only: they reach Megatron only when model.multi_latent_attention is on."""
MOE_FIELDS = {f.name for f in dataclasses.fields(schema.ModelConfig) if f.name.startswith("moe_")}
"""They reach TransformerConfig only for an MoE model (model.num_experts set)."""
SKIP = object()
"""An expectation that does not apply to this job (e.g. MoE fields of a dense model)."""
GPU_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
OPTIMIZER_DTYPES = {**GPU_DTYPES, "fp8": torch.uint8}  # Megatron-LM arguments.py dtype_map


def _field_names() -> list[str]:
    names = []
    for f in dataclasses.fields(schema.JobConfig):
        cls = schema.SECTIONS.get(f.name)
        names += [f"{f.name}.{g.name}" for g in dataclasses.fields(cls)] if cls else [f.name]
    return names


def _value(job, dotted: str):
    obj = job
    for part in dotted.split("."):
        obj = getattr(obj, part)
    return obj


def test_every_schema_field_has_a_destination():
    missing = [n for n in _field_names() if n not in WIRING]
    unknown = [n for n in WIRING if n not in _field_names()]
    assert not missing and not unknown, f"no wiring entry: {missing}; entries for no field: {unknown}"
    for name, wires in WIRING.items():
        assert wires and all(w.target == LOGIN or w.attr for w in wires if w.target in BUILT), name


# ------------------------------------------------------------------------------------ building on CPU
@pytest.fixture
def gpu_rank(monkeypatch):
    """CUDA 'available' and a fake transformer_engine whose userbuffer initialiser records its call."""
    import megatron.core.models.gpt.gpt_layer_specs  # noqa: F401  (Megatron probes TE at import: real first)
    import megatron.core.transformer.transformer_config  # noqa: F401
    from megatron.core import utils as mcore_utils
    from packaging.version import Version

    calls = []
    base = types.ModuleType("transformer_engine.pytorch.module.base")
    base.initialize_ub = lambda **kw: calls.append(kw)
    for name in ("transformer_engine", "transformer_engine.pytorch", "transformer_engine.pytorch.module"):
        monkeypatch.setitem(sys.modules, name, types.ModuleType(name))
    monkeypatch.setitem(sys.modules, "transformer_engine.pytorch.module.base", base)
    optimizers = types.ModuleType("transformer_engine.pytorch.optimizers")  # what OptimizerConfig inspects

    class FusedAdam:
        def __init__(self, params, master_weight_dtype=None, exp_avg_dtype=None, exp_avg_sq_dtype=None,
                     use_decoupled_grad=False):
            pass
    optimizers.FusedAdam = FusedAdam
    monkeypatch.setitem(sys.modules, "transformer_engine.pytorch.optimizers", optimizers)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(mcore_utils, "get_te_version", lambda: Version("2.8.0"))
    return calls


class _Recorder:
    """Stands in for GPTModel: keeps the keyword arguments build_model passes."""

    built: list = []

    def __init__(self, **kwargs):
        _Recorder.built.append(kwargs)

    def cuda(self, *_):
        return self


def _gpt_kwargs(monkeypatch, job, layout, stage: int) -> list[dict]:
    """Run the real models.builder.build_model for pipeline stage ``stage`` with GPTModel recorded and the TE
    layer specs replaced by placeholders (TE's modules cannot be imported without TE)."""
    from megatron.core import parallel_state
    from megatron.core.models.gpt import gpt_layer_specs
    from megatron.core.transformer.multi_token_prediction import MultiTokenPredictionBlockSubmodules

    import megatron.core.models.gpt as gpt_pkg
    from models import backend, builder

    last = layout.pp - 1
    monkeypatch.setattr(parallel_state, "get_pipeline_model_parallel_rank", lambda *a, **k: stage)
    monkeypatch.setattr(parallel_state, "is_pipeline_first_stage",
                        lambda ignore_virtual=True, vp_stage=None: stage == 0 and (vp_stage or 0) == 0)
    monkeypatch.setattr(parallel_state, "is_pipeline_last_stage",
                        lambda ignore_virtual=True, vp_stage=None: stage == last and (vp_stage or 0) == layout.vpp - 1)
    monkeypatch.setattr(backend, "decoder_block_spec", lambda config, te, vp_stage=None, pp_rank=None: "decoder-spec")
    monkeypatch.setattr(builder, "_seed_layers", lambda spec, seed: spec)
    monkeypatch.setattr(gpt_layer_specs, "get_gpt_mtp_block_spec",
                        lambda config, spec, use_transformer_engine, vp_stage=None, pp_rank=None:
                        MultiTokenPredictionBlockSubmodules(layer_specs=[])
                        if stage == last and (vp_stage or 0) == layout.vpp - 1 else None)
    monkeypatch.setattr(gpt_pkg, "GPTModel", _Recorder)
    _Recorder.built = []
    tr = job.train
    builder.build_model(model=job.model, parallel=job.parallel, precision=job.precision, layout=layout,
                        schedule=job.schedule, seed=tr.seed, recompute=tr.recompute,
                        recompute_num_layers=tr.recompute_num_layers, recompute_modules=tr.recompute_modules)
    return list(_Recorder.built)


def _built(job, layout, calls, monkeypatch) -> dict:
    from launcher.rank import optim, setup
    from models import backend, builder

    tr = job.train
    tc = builder.transformer_config(model=job.model, parallel=job.parallel, precision=job.precision, layout=layout,
                                    schedule=job.schedule, recompute=tr.recompute,
                                    recompute_num_layers=tr.recompute_num_layers,
                                    recompute_modules=tr.recompute_modules, deterministic=tr.deterministic,
                                    cuda_graph_impl=tr.cuda_graph_impl, cuda_graph_modules=tr.cuda_graph_modules,
                                    cuda_graph_warmup_steps=tr.cuda_graph_warmup_steps,
                                    activation_offload_modules=tr.activation_offload_modules,
                                    activation_offload_fraction=tr.activation_offload_fraction,
                                    min_offloaded_tensor_size=tr.min_offloaded_tensor_size)
    called = backend.initialize_tp_comm_overlap(model=job.model, parallel=job.parallel, precision=job.precision,
                                                train=tr, layout=layout, schedule_kind=job.schedule.kind)
    first = _gpt_kwargs(monkeypatch, job, layout, 0)
    last = _gpt_kwargs(monkeypatch, job, layout, layout.pp - 1) if layout.pp > 1 else []
    return {
        TC: tc,
        DDP: optim.ddp_config(parallel=job.parallel, precision=job.precision, on_gpu=True),
        OPT: optim.optimizer_config(train=tr, parallel=job.parallel, precision=job.precision, on_gpu=True),
        MPU: setup.parallel_state_kwargs(layout),
        SCHED: optim.scheduler_kwargs(train=tr, steps=layout.steps),
        UB: {**(calls[-1] if calls else {}), "called": called},
        GPT: first[0], "GPTModel (all chunks, first and last stage)": first + last,
    }


def _get(obj, attr):
    return obj[attr] if isinstance(obj, dict) else getattr(obj, attr)


# ------------------------------------------------------------- what translated values must be, in words
def _expected(field: str, target: str, attr: str, job, lay, built):
    """The value a translated (same=False) destination must hold; SKIP when it does not apply."""
    m, p, pr, t, s = job.model, job.parallel, job.precision, job.train, job.schedule
    moe = m.num_experts is not None
    zb_ub = p.tp_comm_overlap and s.kind in ("zb_h1", "zb_v")
    table = {
        ("model.num_query_groups", TC, "num_query_groups"): m.num_query_groups or m.num_attention_heads,
        ("model.kv_channels", TC, "kv_channels"):
            SKIP if m.multi_latent_attention else m.kv_channels or m.hidden_size // m.num_attention_heads,
        ("model.activation", TC, "activation_func"): {"swiglu": F.silu, "gelu": F.gelu}.get(m.activation, SKIP),
        ("model.activation", TC, "gated_linear_unit"): m.activation == "swiglu",
        ("model.moe_ffn_hidden_size", TC, "moe_ffn_hidden_size"): (m.moe_ffn_hidden_size or m.ffn_hidden_size) if moe else SKIP,
        ("model.moe_grouped_gemm", TC, "moe_grouped_gemm"): m.moe_grouped_gemm,  # on GPU (CPU: off)
        ("model.moe_layer_freq", TC, "moe_layer_freq"): _moe_pattern(m) if moe else SKIP,
        ("model.moe_first_k_dense", TC, "moe_layer_freq"): _moe_pattern(m) if moe else SKIP,
        ("model.mtp_num_layers", TC, "mtp_num_layers"): m.mtp_num_layers or None,
        ("model.vocab_size", GPT, "vocab_size"): _padded(m.vocab_size, m.make_vocab_size_divisible_by * p.tensor),
        ("model.make_vocab_size_divisible_by", GPT, "vocab_size"):
            _padded(m.vocab_size, m.make_vocab_size_divisible_by * p.tensor),
        ("model.seq_length", GPT, "max_sequence_length"): m.max_position_embeddings or m.seq_length,
        ("model.max_position_embeddings", GPT, "max_sequence_length"): m.max_position_embeddings or m.seq_length,
        ("model.rotary_base", GPT, "rotary_base"): int(m.rotary_base),
        ("model.seq_length", UB, "shape"): _ub_shape(job) if p.tp_comm_overlap else SKIP,
        ("parallel.context", UB, "shape"): _ub_shape(job) if p.tp_comm_overlap else SKIP,
        ("train.micro_batch_size", UB, "shape"): _ub_shape(job) if p.tp_comm_overlap else SKIP,
        ("parallel.virtual_pipeline", MPU, "virtual_pipeline_model_parallel_size"): (p.virtual_pipeline or 1) > 1 and p.virtual_pipeline or None,
        ("parallel.virtual_pipeline", TC, "virtual_pipeline_model_parallel_size"): (p.virtual_pipeline or 1) > 1 and p.virtual_pipeline or None,
        ("parallel.virtual_pipeline", DDP, "align_param_gather"): (p.virtual_pipeline or 1) > 1,  # Megatron-LM's default
        ("parallel.expert_tensor", MPU, "expert_tensor_parallel_size"): p.expert_tensor or p.tensor,
        ("parallel.expert_tensor", TC, "expert_tensor_parallel_size"): p.expert_tensor or p.tensor,
        ("parallel.sequence_parallel", TC, "sequence_parallel"): p.sequence_parallel and p.tensor > 1,
        ("parallel.overlap_grad_reduce", DDP, "overlap_grad_reduce"): p.overlap_grad_reduce,
        ("parallel.megatron_fsdp", DDP, "data_parallel_sharding_strategy"):
            "optim_grads_params" if p.megatron_fsdp else "no_shard",
        ("parallel.overlap_param_gather", DDP, "overlap_param_gather"): p.overlap_param_gather and p.distributed_optimizer,
        ("parallel.overlap_param_gather", OPT, "overlap_param_gather"): p.overlap_param_gather and p.distributed_optimizer,
        ("parallel.tp_comm_overlap", UB, "called"): p.tp_comm_overlap,
        # zero bubble keeps userbuffer TP overlap without the bulk overlaps (TE: deferred wgrad), the input
        # gradient's reduce-scatter pipelined with dgrad instead (on pipelined userbuffers); else Megatron's defaults
        ("schedule.kind", TC, "tp_comm_bulk_wgrad"): not zb_ub,
        ("schedule.kind", TC, "tp_comm_bulk_dgrad"): not zb_ub,
        ("schedule.kind", TC, "tp_comm_overlap_rs_dgrad"): zb_ub,
        ("schedule.kind", UB, "ub_cfgs"):
            {"qkv_dgrad": {"method": "pipeline"}, "fc1_dgrad": {"method": "pipeline"}} if zb_ub else None,
        ("schedule.microbatch_group_size", TC, "microbatch_group_size_per_vp_stage"):
            (s.microbatch_group_size or p.pipeline) if (p.virtual_pipeline or 1) > 1 else SKIP,
        ("schedule.batch_p2p_comm", TC, "batch_p2p_comm"): s.batch_p2p_comm and not s.overlap_p2p_comm and not (
            (p.virtual_pipeline or 1) > 1 and p.pipeline == 2),
        ("precision.dtype", TC, "params_dtype"): GPU_DTYPES[pr.dtype],
        ("precision.dtype", TC, "bf16"): pr.dtype == "bf16", ("precision.dtype", TC, "fp16"): pr.dtype == "fp16",
        ("precision.dtype", OPT, "params_dtype"): GPU_DTYPES[pr.dtype],
        ("precision.dtype", OPT, "bf16"): pr.dtype == "bf16", ("precision.dtype", OPT, "fp16"): pr.dtype == "fp16",
        ("precision.fp8", UB, "use_fp8"): pr.fp8 is not None if p.tp_comm_overlap else SKIP,
        ("precision.fp8_format", TC, "fp8"): pr.fp8_format if pr.fp8 else None,
        ("precision.fp8_amax_history_len", TC, "fp8_amax_history_len"): pr.fp8_amax_history_len if pr.fp8 == "delayed" else SKIP,
        ("precision.fp8_amax_compute_algo", TC, "fp8_amax_compute_algo"): pr.fp8_amax_compute_algo if pr.fp8 == "delayed" else SKIP,
        **{(f"precision.{n}", OPT, n): OPTIMIZER_DTYPES[getattr(pr, n)]
           for n in ("main_grads_dtype", "main_params_dtype", "exp_avg_dtype", "exp_avg_sq_dtype")},
        ("precision.transformer_engine", TC, "transformer_impl"):
            "local" if pr.transformer_engine == "false" else "transformer_engine",
        ("train.train_steps", SCHED, "lr_decay_steps"): max(lay.steps, t.warmup_steps + 1),
        ("train.train_tokens", SCHED, "lr_decay_steps"): max(lay.steps, t.warmup_steps + 1),
        ("train.lr_schedule", SCHED, "lr_decay_style"): {"wsd": "WSD"}.get(t.lr_schedule, t.lr_schedule),
        ("train.wsd_decay_steps", SCHED, "wsd_decay_steps"):
            (t.wsd_decay_steps or max(1, lay.steps // 10)) if t.lr_schedule == "wsd" else None,
        ("parallel.pipeline_model_parallel_layout", TC, "pipeline_model_parallel_layout"):
            _Repr(p.pipeline_model_parallel_layout) if p.pipeline_model_parallel_layout else None,
        ("train.recompute", TC, "recompute_granularity"): None if t.recompute == "none" else t.recompute,
        ("train.recompute_modules", TC, "recompute_modules"):
            _recompute_modules(t, moe) if t.recompute == "selective" else SKIP,
        ("train.cuda_graph_modules", TC, "cuda_graph_modules"): _graph_modules(t),
        ("train.activation_offload_modules", TC, "fine_grained_activation_offloading"):
            bool(t.activation_offload_modules),
        ("train.recompute_num_layers", TC, "recompute_num_layers"): (t.recompute_num_layers or 1) if t.recompute == "full" else SKIP,
    }
    if (field, target, attr) == ("model.mtp_num_layers", GPT, "mtp_block_spec"):
        return SKIP  # checked over every chunk in test_mtp_block_spec_reaches_the_last_chunk
    if field == "precision.fp8" and (target, attr) == (TC, "fp8_recipe"):
        return pr.fp8 if pr.fp8 else SKIP  # without FP8, TransformerConfig.fp8 is None (checked above)
    return table[(field, target, attr)]


def _graph_modules(t) -> list:
    """train.cuda_graph_modules as CudaGraphModule members; the local implementation captures the router and the
    preprocess together, so Megatron-Core appends the missing one of the two (transformer_config.py)."""
    from megatron.core.transformer.cuda_graph_config import CudaGraphModule

    names = list(t.cuda_graph_modules)
    if t.cuda_graph_impl == "local" and {"moe_router", "moe_preprocess"} & set(names):
        names += [n for n in ("moe_router", "moe_preprocess") if n not in names]
    return [CudaGraphModule[n] for n in names]


def _recompute_modules(t, moe: bool) -> list:
    """The modules asked for (Megatron's default core_attn when none), as TransformerConfig keeps them."""
    return list(t.recompute_modules or ["core_attn"])


class _Repr:
    """Equal to an object whose repr is ``text`` (TransformerConfig turns the layout string into a
    PipelineParallelLayerLayout, whose repr is the string it was parsed from)."""

    def __init__(self, text: str):
        self.text = text

    def __eq__(self, other):
        return repr(other) == self.text

    def __ne__(self, other):
        return not self.__eq__(other)

    def __repr__(self):
        return f"layout {self.text!r}"


def _moe_pattern(m) -> list[int]:
    return [int(i >= m.moe_first_k_dense and i % m.moe_layer_freq == 0) for i in range(m.num_layers)]


def _padded(vocab: int, unit: int) -> int:
    return -(-vocab // unit) * unit


def _ub_shape(job) -> list[int]:
    return [job.model.seq_length * job.train.micro_batch_size // job.parallel.context, job.model.hidden_size]


CASES = {**{r: [f"recipe={r}"] for r in RECIPES}, **VARIANTS}


@pytest.mark.parametrize("case", sorted(CASES))
def test_recipe_reaches_megatron_core_field_by_field(case, gpu_rank, monkeypatch):
    job = compose_job(CASES[case])
    layout = derive(job)
    built = _built(job, layout, gpu_rank, monkeypatch)
    checked, wrong = 0, []
    for field, wires in WIRING.items():
        value = _value(job, field)
        if field in MLA_FIELDS and not job.model.multi_latent_attention:
            continue
        if field.split(".")[-1] in MOE_FIELDS and job.model.num_experts is None:
            continue
        for wire in wires:
            if wire.target not in BUILT:
                continue
            got = _get(built[wire.target], wire.attr) if (wire.attr in built[wire.target] if isinstance(
                built[wire.target], dict) else True) else SKIP
            if wire.target == UB and not built[UB]["called"] and wire.attr != "called":
                continue  # no userbuffers without tp_comm_overlap
            want = value if wire.same else _expected(field, wire.target, wire.attr, job, layout, built)
            if want is SKIP:
                continue
            checked += 1
            if got != want:
                wrong.append(f"{field}={value!r} -> {wire.target}.{wire.attr} is {got!r}, expected {want!r}")
    assert not wrong, "\n".join(wrong)
    assert checked > 80, checked


def test_every_translated_destination_has_an_expectation():
    """A same=False wire into a built object needs a rule in _expected (else the wiring test would skip it)."""
    job = compose_job(["recipe=llama405b"])
    missing = []
    for field, wires in WIRING.items():
        for w in wires:
            if w.target in BUILT and not w.same:
                try:
                    _expected(field, w.target, w.attr, job, derive(job), {})
                except KeyError:
                    missing.append(f"{field} -> {w.target}.{w.attr}")
    assert not missing, missing


@pytest.mark.parametrize("case", sorted(CASES))
def test_mtp_block_spec_reaches_the_last_chunk(case, gpu_rank, monkeypatch):
    job = compose_job(CASES[case])
    layout = derive(job)
    chunks = _built(job, layout, gpu_rank, monkeypatch)["GPTModel (all chunks, first and last stage)"]
    with_mtp = [kw for kw in chunks if kw["mtp_block_spec"] is not None]
    if job.model.mtp_num_layers:
        assert len(with_mtp) == 1 and with_mtp[0]["post_process"], "MTP spec must reach the last chunk"
    else:
        assert not with_mtp


def test_choice_fields_match_the_rank_side_maps():
    from launcher.rank.optim import LR_STYLES
    from models.builder import ACTIVATIONS, DTYPES

    assert set(ACTIVATIONS) == set(schema.ACTIVATIONS)
    assert set(DTYPES) == set(schema.DTYPES)
    assert set(LR_STYLES) == set(schema.LR_SCHEDULES)


# --------------------------------------------------------------------------------------------- CUDA graphs
@pytest.mark.parametrize("impl,te,want", [
    ("none", True, {}),
    ("local", False, {"te_rng_tracker": False, "use_cudagraphable_rng": True}),
    ("local", True, {"te_rng_tracker": True, "use_cudagraphable_rng": True}),
    ("transformer_engine", True, {"te_rng_tracker": True, "use_cudagraphable_rng": True}),
    # Megatron-LM: "transformer_engine" in (transformer_impl, cuda_graph_impl) (validation refuses this pair first)
    ("transformer_engine", False, {"te_rng_tracker": True, "use_cudagraphable_rng": True}),
])
def test_cuda_graphs_get_a_graph_safe_rng_tracker(impl, te, want):
    """train.cuda_graph_impl -> model_parallel_cuda_manual_seed's tracker, as Megatron-LM sets it (CudaGraphManager
    asserts "RNG tracker does not support cudagraphs!" otherwise)."""
    from launcher.rank.setup import rng_tracker_kwargs

    assert rng_tracker_kwargs(impl, te) == want


def test_te_cuda_graphs_are_captured_at_the_warmup_step_and_deleted(monkeypatch):
    """train.cuda_graph_impl=transformer_engine: the loop builds TECudaGraphHelper from the model's config, captures
    at this run's step cuda_graph_warmup_steps with the forward pre-hooks off around it (distributed optimizer with
    overlapped param gather), then sets the graphs' manual hooks; deletes the graphs at the end."""
    from megatron.core import utils as mcore_utils
    from megatron.core.transformer import cuda_graphs

    from launcher.rank import loop

    calls = []

    class Helper:
        def __init__(self, model, config, seq_length, micro_batch_size, optimizers):
            calls.append(("init", config, seq_length, micro_batch_size, optimizers))
            self.done = False

        def capture_finished(self):
            return self.done

        def graphs_created(self):
            return self.done

        def create_cudagraphs(self):
            calls.append("create")
            self.done = True

        def cuda_graph_set_manual_hooks(self):
            calls.append("manual hooks")

        def delete_cuda_graphs(self):
            calls.append("delete")

    class Chunk:
        ddp_config = types.SimpleNamespace(use_megatron_fsdp=False, use_distributed_optimizer=True,
                                           overlap_param_gather=True)

        def disable_forward_pre_hook(self, param_sync=True):
            calls.append(("hooks off", param_sync))

        def enable_forward_pre_hook(self):
            calls.append("hooks on")

    monkeypatch.setattr(cuda_graphs, "TECudaGraphHelper", Helper)
    monkeypatch.setattr(mcore_utils, "get_model_config", lambda chunk: "config")
    train = compose_job(["recipe=qwen3_30b_a3b", "train.cuda_graph_impl=transformer_engine",
                         "train.cuda_graph_modules=[attn,moe_router]", "train.cuda_graph_warmup_steps=2"]).train
    from megatron.core import num_microbatches_calculator as nmc

    graphs = loop.TECudaGraphs(model=[Chunk()], optimizer="opt", train=train, seq_length=4096, num_microbatches=32,
                               dp_size=8)
    assert calls == [("init", "config", 4096, train.micro_batch_size, ["opt"])]
    assert nmc.get_num_microbatches() == 32  # the helper's capture order reads Megatron's global calculator
    for done in range(2):
        graphs.before_step(done)
    assert len(calls) == 1  # eager warm-up steps
    graphs.before_step(2)
    assert calls[1:] == [("hooks off", False), "create", "hooks on", "manual hooks"]
    graphs.before_step(3)
    graphs.close()
    assert calls[-1] == "delete" and calls.count("create") == 1
    assert nmc._GLOBAL_NUM_MICROBATCHES_CALCULATOR is None  # the calculator the loop set up is gone again
    off = compose_job(["recipe=qwen3_30b_a3b"]).train
    assert loop.TECudaGraphs(model=[Chunk()], optimizer="opt", train=off, seq_length=4096, num_microbatches=32,
                             dp_size=8).helper is None
