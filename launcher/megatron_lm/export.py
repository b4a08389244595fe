"""Our job -> Megatron-LM ``pretrain_gpt.py`` arguments (``to_args``, export; ``action=megatron-args``) and the
launch around them; the import direction is ``launcher.megatron_lm.translate``. Both read ``table.FLAGS`` for the
one-argument-one-field cases; this module handles the fields that several arguments decide together, and says
what Megatron-LM cannot express.

Login-node code: no torch, no megatron.
"""
from __future__ import annotations

import dataclasses
import shlex
from dataclasses import dataclass, field
from typing import Dict, List

from launcher.core import Layout, derive
from launcher.core.cuda_env import job_env
from launcher.megatron_lm.table import FLAGS, LAUNCHER_ONLY, REQUIRED, fmt, typed_override
from launcher.megatron_lm.translate import flatten, layer_pattern_text
from launcher.schema import JobConfig, Recompute, Schedule


@dataclass
class Export:
    """pretrain_gpt.py arguments of a job, the launch around them, and what Megatron-LM cannot express."""

    args: List[str]
    nodes: int
    gpus_per_node: int
    env: Dict[str, str]
    not_expressible: List[str]

    def script(self, title: str) -> str:
        lines = ["#!/bin/bash", f"# {title}",
                 "# Megatron-LM pretrain_gpt.py arguments of this job (python -m launcher ... action=megatron-args).",
                 "# Run from a Megatron-LM checkout; on several nodes, give torchrun its rendezvous "
                 "(--rdzv-endpoint) as usual."]
        lines += [f"# not expressible in Megatron-LM: {n}" for n in self.not_expressible]
        lines += [f"export {k}={shlex.quote(val)}" for k, val in self.env.items()]
        lines.append(f"torchrun --nnodes {self.nodes} --nproc-per-node {self.gpus_per_node} pretrain_gpt.py \\")
        pairs, i = [], 0
        while i < len(self.args):
            j = i + 1
            while j < len(self.args) and not self.args[j].startswith("--"):
                j += 1
            pairs.append((_section_rank(self.args[i]), " ".join(shlex.quote(a) for a in self.args[i:j])))
            i = j
        pairs = [text for _, text in sorted(pairs, key=lambda p: p[0])]  # model, parallel, ... (stable)
        lines += [f"    {p} \\" for p in pairs[:-1]] + [f"    {pairs[-1]}"]
        return "\n".join(lines) + "\n"


def _section_rank(flag: str) -> int:
    """Where an argument goes in the printed launch: grouped by the section of the field it sets."""
    from launcher.megatron_lm.table import COMBINED, FLAG_BY_NAME
    dotted = FLAG_BY_NAME[flag].field if flag in FLAG_BY_NAME else COMBINED.get(flag, "").split(",")[0]
    order = ["model", "parallel", "schedule", "precision", "train", "data", "checkpoint", "logging"]
    section = dotted.partition(".")[0] if "." in dotted else "logging"
    return order.index(section) if section in order else len(order)


def to_args(job: JobConfig, lay: Layout | None = None) -> Export:
    """The job as Megatron-LM arguments (the inverse of ``to_fields``; ``lay``: the job's layout, derived if None)."""
    v, out, missing = flatten(job), [], []
    lay = lay or derive(job)
    for f in FLAGS:
        if not f.when(v):
            continue
        value = v[f.field]
        if f.switch is not None:
            if value == f.switch and f.default != f.switch:
                out.append(f.flag)
            elif value != f.switch and value != f.default:
                missing.append(typed_override(f.field, value))
        elif value is not None and (f.default is REQUIRED or value != f.default):
            out += [f.flag, f.show(value)]
        elif value is None and f.default not in (None, REQUIRED):
            missing.append(f"{f.field}=null")
    m = job.model
    out += ["--ffn-hidden-size", str(m.ffn_hidden_size), "--vocab-size", str(m.vocab_size),
            "--max-position-embeddings", str(m.max_position_embeddings or m.seq_length)]
    if m.num_query_groups and m.num_query_groups != m.num_attention_heads:
        out += ["--group-query-attention", "--num-query-groups", str(m.num_query_groups)]
    out += {"swiglu": ["--swiglu"], "squared_relu": ["--squared-relu"], "gelu": []}[m.activation]
    if m.position_embedding != "learned_absolute":
        out += ["--position-embedding-type", m.position_embedding]
    if m.multi_latent_attention and m.position_embedding == "rope":
        out += ["--rope-type", "rope"]  # Megatron-LM's MLA default is yarn; our ranks build plain rope
    if m.num_experts:
        if m.moe_ffn_hidden_size:
            out += ["--moe-ffn-hidden-size", str(m.moe_ffn_hidden_size)]
        out += ["--moe-layer-freq", layer_pattern_text(m.num_layers, m.moe_layer_freq, m.moe_first_k_dense)]
        if m.moe_aux_loss_coeff:
            out += ["--moe-aux-loss-coeff", fmt(m.moe_aux_loss_coeff)]
        if m.moe_router_load_balancing_type != "aux_loss":
            out += ["--moe-router-load-balancing-type", m.moe_router_load_balancing_type]
    out += _export_schedule(job, lay, missing)
    out += _export_precision(job)
    out += _export_train(job, lay, missing)
    out += _export_data(job)
    out += _export_checkpoint(job, missing)
    defaults = flatten(JobConfig())
    for name, why in LAUNCHER_ONLY.items():
        if name in v and v[name] != defaults[name] and name not in ("action", "output_dir", "force", "model.name",
                                                                    "parallel.data", "schedule.batch_p2p_comm",
                                                                    "train.train_tokens", "logging.wandb_mode"):
            missing.append(f"{typed_override(name, v[name])} ({why})")
    env = job_env(job)  # CUDA_DEVICE_MAX_CONNECTIONS resolved for this job, as env.sh has it
    if job.logging.wandb_project:
        env["WANDB_MODE"] = job.logging.wandb_mode
    return Export(out, job.nodes, job.cluster.gpus_per_node, env, missing)


def _export_schedule(job: JobConfig, lay, missing: List[str]) -> List[str]:
    s, out = job.schedule, []
    if s.kind == Schedule.ZB_H1:
        missing.append("schedule.kind=zb_h1 (Megatron-LM has no zero-bubble schedule; exported as "
                       + ("interleaved over the same chunks)" if lay.vpp > 1 else "1f1b)"))
    if s.kind == Schedule.ZB_V:
        missing.append("schedule.kind=zb_v (Megatron-LM has no zero-bubble schedule; exported as interleaved with "
                       "two chunks per rank: the same layers per chunk, placed interleaved instead of in a V)")
    layout = job.parallel.pipeline_model_parallel_layout
    if layout:
        out += ["--pipeline-model-parallel-layout", layout]
    elif lay.vpp > 1:
        out += ["--num-virtual-stages-per-pipeline-rank", str(lay.vpp)]
    if lay.vpp > 1:
        if not s.overlap_p2p_comm:
            out.append("--no-overlap-p2p-communication")
    megatron_batch = not (lay.vpp > 1 and s.overlap_p2p_comm)
    if s.batch_p2p_comm != megatron_batch and not s.overlap_p2p_comm:
        missing.append(f"{typed_override('schedule.batch_p2p_comm', s.batch_p2p_comm)} (Megatron-LM batches p2p exactly "
                       "when it does not overlap it)")
    return out


def _export_precision(job: JobConfig) -> List[str]:
    p, out = job.precision, []
    out += {"bf16": ["--bf16"], "fp16": ["--fp16"], "fp32": []}[p.dtype]
    out.append("--attention-softmax-in-fp32")  # Megatron-Core's default, which our ranks keep; not Megatron-LM's
    if p.fp8:
        out += ["--fp8-format", p.fp8_format, "--fp8-recipe", p.fp8]
    if p.dtype == "bf16" and not p.grad_reduce_in_fp32:
        out.append("--grad-reduce-in-bf16")
    elif p.dtype != "bf16" and p.grad_reduce_in_fp32:
        out.append("--accumulate-allreduce-grads-in-fp32")
    return out


def _export_train(job: JobConfig, lay, missing: List[str]) -> List[str]:
    t = job.train
    if t.train_tokens is not None:
        missing.append(f"train.train_tokens={t.train_tokens} (exported as its {lay.steps} steps)")
    out = ["--global-batch-size", str(t.global_batch_size), "--train-iters", str(lay.steps),
           "--lr-decay-iters", str(lay.steps),
           "--lr-decay-style", {"wsd": "WSD"}.get(t.lr_schedule, t.lr_schedule)]
    if t.warmup_steps:
        out += ["--lr-warmup-iters", str(t.warmup_steps)]
    if t.lr_schedule == "wsd":
        out += ["--lr-wsd-decay-iters", str(t.wsd_decay_steps or max(1, lay.steps // 10)),
                "--lr-wsd-decay-style", "linear"]
    if t.recompute == Recompute.SELECTIVE:
        out += ["--recompute-granularity", "selective"] + (
            ["--recompute-modules", *t.recompute_modules] if getattr(t, "recompute_modules", None) else [])
    elif t.recompute == Recompute.FULL:
        out += ["--recompute-granularity", "full", "--recompute-method", "uniform",
                "--recompute-num-layers", str(t.recompute_num_layers or 1)]
    if t.cuda_graph_impl != "none" and t.cuda_graph_modules:  # empty: the whole layer, Megatron-LM's default
        out += ["--cuda-graph-modules", *t.cuda_graph_modules]
    if t.activation_offload_modules:  # Megatron-LM's switch and its list (our switch is a non-empty list)
        out += ["--fine-grained-activation-offloading", "--offload-modules", *t.activation_offload_modules]
    return out


def _export_data(job: JobConfig) -> List[str]:
    d = job.data
    if d.kind == "mock":
        return ["--mock-data", "--tokenizer-type", "NullTokenizer"]
    out = ["--data-path"] + [fmt(x) for x in d.blend]
    if d.tokenizer:
        out += ["--tokenizer-type", "HuggingFaceTokenizer", "--tokenizer-model", d.tokenizer]
    return out


def _export_checkpoint(job: JobConfig, missing: List[str]) -> List[str]:
    c, out = job.checkpoint, []
    if c.dir:
        out += ["--save", c.dir]
        if c.load:
            out += ["--load", c.load]
        elif c.resume:
            out += ["--load", c.dir]
    elif c.load:
        missing.append(f"checkpoint.load={c.load} without checkpoint.dir (Megatron-LM would save into it too)")
    if job.parallel.megatron_fsdp:  # Megatron-LM validate_args: "Megatron-FSDP requires the fsdp_dtensor format"
        out += ["--ckpt-format", "fsdp_dtensor"]
    if job.logging.tensorboard:
        out += ["--tensorboard-dir", f"{job.output_dir}/{job.name}/tensorboard"]
    return out
