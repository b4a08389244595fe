"""Planner accuracy against NVIDIA's published H100 training throughput (same layouts, batch sizes, sequence
lengths, precision). Prints, per row, predicted vs published tokens/s/GPU and TFLOP/s/GPU and the error, then the
mean |error| and the worst, separately for the rows the planner's constants were fitted on (NeMo 24.12 and
Megatron-Bridge releases up to 25.09) and the held-out rows (later releases). Also prints the H200 predictions
of the recipes (no published H200 training figure exists). Run: .venv/bin/python benchmarks/planner_accuracy.py

Published TFLOP/s are recomputed as tokens/s/GPU x our FLOPs/token (Megatron's formula, causal attention
halved, unpadded vocabulary; it matches the 25.09+ tables within ~0.1%; NeMo 24.12 did not halve causal
attention, so its TFLOP/s column is higher by 6·L·q·s and is not used). Sources:

- NEMO_2412: NeMo Framework 24.12 performance summary,
  https://docs.nvidia.com/nemo-framework/user-guide/24.12/nemotoolkit/performance/performance_summary.html
- MB_ARCHIVE: Megatron-Bridge performance summary archive (releases 25.09, 25.11, 26.02, 26.02.01, 26.04,
  26.04.01, 26.06; the 26.06.01 and 26.08 tables have no H100 row),
  https://docs.nvidia.com/nemo/megatron-bridge/latest/performance-summary-archive.html
  (repository file docs/performance-summary-archive.md of NVIDIA-NeMo/Megatron-Bridge; 25.09/25.11 as of its
  commit 74695a06d^, the later ones as of 4ab94dfad, Aug 2026)
- MB_CURRENT: Megatron-Bridge performance summary (25.11), https://docs.nvidia.com/nemo/megatron-bridge/latest/performance-summary.html

What each row sets beyond the table's columns is read from NVIDIA's performance recipes *of that release*
(Megatron-Bridge scripts/performance: 25.09 = run_script.py + configs/*.yaml at commit fa0315ae2, 25.11 = v0.2.0,
26.02 = v0.3.0, 26.04 = v0.4.0, 26.04.01 = v0.4.1, 26.06 = v0.5.0): FP8 params with their all-gather, bf16 gradient
reduction, the fused cross entropy, TP communication overlap (on for dense models with TP > 1; per recipe for
MoE), distributed optimizer, interleaved schedule when VP > 1, the MoE all-to-all overlap
(``overlap_moe_expert_parallel_comm``) and the flex dispatcher backend (DeepEP / HybridEP) where the recipe sets
them, DeepSeek-V3's recompute modules; see ``_overrides`` and the comments above the rows. MoE rows: dropless
rows force-balance routing (the planner assumes balance); "tokendrop" rows ran Megatron-Bridge's
``apply_moe_token_drop`` (capacity factor 1.0, padded). Where a table's layout columns and its release's recipe
disagree (Qwen3-30B 25.11 and 26.02.01: the tables repeat an earlier release's columns), the row is planned as the
recipe ran it. CUDA graphs: the recipe's ``cuda_graph_impl`` / ``cuda_graph_scope`` (only the 26.06 SFT row has any).
The host-time constant (``launcher.plan.host.OVERLAP_HOST_PER_EXPERT_S``) is fitted on one later row (Qwen3-30B 25.11,
``Row.fit``), which then counts among the fitted rows; NVIDIA tracks that run and 26.02's as a regression of the
dropless, overlapped schedule (Megatron-Bridge issue #1998, Jan 2026: "2X slower performance in QWEN3 30B on H100
and B200 with the dropless schedule"), which the planner prices as host time (launcher/plan/NOTES.md).
"""
from __future__ import annotations

import statistics
import sys
from dataclasses import dataclass, field
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from launcher.schema import Schedule  # noqa: E402

NEMO_2412 = "https://docs.nvidia.com/nemo-framework/user-guide/24.12/nemotoolkit/performance/performance_summary.html"
MB_ARCHIVE = "https://docs.nvidia.com/nemo/megatron-bridge/latest/performance-summary-archive.html"
MB_CURRENT = "https://docs.nvidia.com/nemo/megatron-bridge/latest/performance-summary.html"
FIT_RELEASES = ("24.12", "25.09")
"""Constants may be fitted only on these releases; every later one is held out."""

MODELS = {"llama3_8b": "llama3_8b", "llama3_70b": "llama3_70b", "llama405b": "llama31_405b",
          "deepseek_v3": "deepseek_v3", "qwen3_30b": "qwen3_30b_a3b", "qwen3_235b": "qwen3_235b_a22b"}


@dataclass
class Row:
    release: str
    model: str
    gpus: int
    gbs: int
    mbs: int
    tp: int = 1
    pp: int = 1
    cp: int = 1
    vp: int = 1
    ep: int = 1
    tokens_per_gpu: float = 0.0
    """Published tokens/s/GPU."""
    source: str = MB_ARCHIVE
    fsdp: bool = False
    split: str = ""
    """How NVIDIA splits the pipeline: '' even, 'account' (embedding + loss counted as layers), or a layout string."""
    note: str = ""
    a2a_overlap: bool = False
    """The recipe sets moe_a2a_overlap (Megatron-Core overlap_moe_expert_parallel_comm)."""
    tp_overlap: bool | None = None
    """The recipe sets tp_comm_overlap; None: on for dense models with TP > 1 (Megatron-Bridge's default)."""
    seq: int = 0
    """Sequence length when the table's differs from the model entry's (0: the model's)."""
    dispatcher: str = ""
    """The recipe's flex dispatcher backend ('deepep' | 'hybridep'); '' for Megatron-Core's alltoall."""
    fp8: str = ""
    """FP8 recipe when not the release's default ('' : delayed for NeMo 24.12, tensorwise after); 'blockwise' is
    NVIDIA's DeepSeek-V3 sub-channel preset, which also keeps BF16 weights (no FP8 parameter gather)."""
    graphs: tuple = ("none", ())
    """The recipe's CUDA graphs (Megatron-Bridge cuda_graph_impl, cuda_graph_scope) -> train.cuda_graph_impl,
    train.cuda_graph_modules. Of the published H100 rows of our models only the 26.06 Llama3-70B SFT run used any
    (every H100 FP8 pretraining recipe of releases 25.09 .. 26.06 leaves them off; see NOTES.md)."""
    fit: str = ""
    """The constant this later-release row was fitted for ('' : none): a row counts as fitted if its release is
    in FIT_RELEASES or it names one."""
    extra: list = field(default_factory=list)

    @property
    def fitted(self) -> bool:
        return self.release in FIT_RELEASES or bool(self.fit)

    @property
    def name(self) -> str:
        lay = f"TP{self.tp} PP{self.pp}" + (f" VP{self.vp}" if self.vp > 1 else "") + (f" CP{self.cp}" if self.cp > 1 else "")
        lay += (f" EP{self.ep}" if self.ep > 1 else "") + (" FSDP" if self.fsdp else "")
        lay += f" {self.fp8}" if self.fp8 else ""
        return f"{self.release} {self.model} {self.gpus}g {lay} mbs{self.mbs} gbs{self.gbs}" + (f" seq{self.seq}" if self.seq else "")


DSV3_LAYOUT = "Et|(tt|)*30mL"
"""DeepSeek-V3 on PP8 x VP4 (61 layers + MTP): Megatron-Bridge's H100 layout for that shape."""

ROWS = [
    # ---- fitted on (NeMo 24.12, Megatron-Bridge <= 25.09)
    # The NeMo 24.12 page's table is headed "Container: NeMo24.07": these two figures were measured on NeMo 24.07 (NeMo
    # commit 8e3d65dcfe "24.07 perf numbers", Sep 2024, which also replaced an earlier 1,549 for the 70B row: a 1.6%
    # re-measurement; v2.1.0 docs/source/performance/performance_summary.md). Labelled by the page that publishes them;
    # FP8 delayed scaling either way.
    Row("24.12", "llama3_8b", 8, 128, 1, cp=2, tokens_per_gpu=12273, source=NEMO_2412),
    Row("24.12", "llama3_70b", 64, 128, 1, tp=4, pp=4, vp=5, cp=2, tokens_per_gpu=1524, source=NEMO_2412),
    Row("25.09", "llama3_8b", 8, 128, 1, fsdp=True, tokens_per_gpu=14079),
    Row("25.09", "llama3_70b", 64, 128, 1, tp=4, pp=8, vp=5, tokens_per_gpu=1619),
    Row("25.09", "llama405b", 1024, 512, 1, tp=8, pp=8, cp=2, vp=8, split="account", tokens_per_gpu=302),
    # 25.09 run_script.py on H100: DeepEP (flex), the 1F1B all-to-all overlap with delayed wgrad, recompute
    # mla_up_proj + mlp, no TP overlap (the recipe's CommOverlapConfig(tp_comm_overlap=False)).
    Row("25.09", "deepseek_v3", 1024, 8192, 1, tp=2, pp=8, vp=4, ep=64, split=DSV3_LAYOUT, tokens_per_gpu=1297,
        note="dropless; flex DeepEP, a2a overlap", a2a_overlap=True, tp_overlap=False, dispatcher="deepep",
        extra=["train.recompute_modules=[mla_up_proj,mlp]"]),
    # 25.09 run_script.py for Qwen3: apply_moe_token_drop (capacity 1.0, padded), CommOverlapConfig(tp_comm_overlap=True),
    # no all-to-all overlap, alltoall dispatcher.
    Row("25.09", "qwen3_30b", 16, 512, 2, pp=2, vp=24, ep=8, tokens_per_gpu=10494, note="tokendrop"),
    Row("25.09", "qwen3_235b", 256, 2048, 1, tp=2, pp=8, vp=4, ep=32, split="account", tokens_per_gpu=1204,
        note="tokendrop", tp_overlap=True),
    # The 25.09 table's parenthesised DeepSeek-V3 figure: the same run with blockwise FP8 (128x128 weights, 1x128
    # activations), 330 TFLOP/s against 338; tokens/s derived from that ratio (1,297 x 330 / 338). Its recipe is 25.09's
    # fp8_ss preset (bf16_with_fp8_subchannel_scaling_mixed at fa0315ae2: fp8_recipe blockwise, fp8_param_gather False;
    # the yaml's h100 fp8_ss entry is empty, so layout and settings are the tensorwise run's). The planner prices its
    # GEMMs + casts at TE's measured blockwise / per-tensor ratio (timing.BLOCKWISE_FP8_TIME), not fitted on this pair.
    Row("25.09", "deepseek_v3", 1024, 8192, 1, tp=2, pp=8, vp=4, ep=64, split=DSV3_LAYOUT, tokens_per_gpu=1297 * 330 / 338,
        note="dropless; flex DeepEP, a2a overlap; blockwise FP8", a2a_overlap=True, tp_overlap=False,
        dispatcher="deepep", fp8="blockwise", extra=["train.recompute_modules=[mla_up_proj,mlp]"]),
    # ---- held out (later releases). 25.11 (v0.2.0) and later: dropless with forced balance; Qwen3-235B: all-to-all
    # overlap, tp_comm_overlap=False, alltoall; Qwen3-30B: 25.11 alltoall + a2a overlap, 26.02 (v0.3.0) DeepEP + a2a
    # overlap, 26.04+ (v0.4.0..v0.5.0) EP16 HybridEP without a2a overlap.
    Row("25.11", "llama3_8b", 8, 128, 1, fsdp=True, tokens_per_gpu=14451),
    Row("25.11", "llama3_70b", 64, 128, 1, tp=4, pp=8, vp=5, tokens_per_gpu=1602),
    Row("25.11", "llama405b", 1024, 512, 1, tp=8, pp=8, cp=2, vp=8, split="account", tokens_per_gpu=292),
    # 25.11 Qwen3-30B: the table repeats 25.09's layout columns (VP24, mbs 2, GA 32), the release's recipe (v0.2.0
    # QWEN3_30B_A3B_H100_FP8_CS_BASE_CONFIG) runs PP2 x VP12 x EP8 at mbs 1 (the default) with the a2a overlap,
    # alltoall dispatcher, dropless: planned as the recipe ran it (the table's layout: see NOTES.md). The one row
    # the host constant OVERLAP_HOST_PER_EXPERT_S is fitted on (host-bound: Megatron-Bridge #1998).
    Row("25.11", "qwen3_30b", 16, 512, 1, pp=2, vp=12, ep=8, tokens_per_gpu=5275, note="dropless; recipe layout",
        a2a_overlap=True, fit="OVERLAP_HOST_PER_EXPERT_S"),
    Row("25.11", "qwen3_235b", 256, 2048, 1, tp=2, pp=8, vp=4, ep=32, split="account", tokens_per_gpu=1575,
        note="dropless", a2a_overlap=True, tp_overlap=False),
    Row("26.02", "llama3_70b", 64, 256, 1, tp=4, pp=8, vp=5, tokens_per_gpu=1621),
    Row("26.02", "llama405b", 1024, 1536, 1, tp=8, pp=8, cp=2, vp=8, split="account", tokens_per_gpu=311),
    # host-bound as 25.11 (Megatron-Bridge #1998); held out from the host constant's fit (another dispatcher, DeepEP)
    Row("26.02", "qwen3_30b", 16, 1024, 1, pp=2, vp=12, ep=8, tokens_per_gpu=5113, note="dropless",
        a2a_overlap=True, dispatcher="deepep"),
    Row("26.02", "qwen3_235b", 256, 8192, 1, tp=2, pp=8, vp=4, ep=32, split="account", tokens_per_gpu=1633,
        note="dropless", a2a_overlap=True, tp_overlap=False),
    # 26.02.01: the patch container (docs commit 2c2425ace, Mar 2026) republished 26.02's layouts; its Qwen3-30B row
    # keeps PP2 x VP12 x EP8, but the release's recipe (tag v0.3.1, Mar 20, 2026: QWEN3_30B_A3B_PRETRAIN_CONFIG_H100_
    # FP8_CS_V1) runs PP1 x EP16 HybridEP without the a2a overlap: planned as the recipe ran it (as 25.11's row).
    Row("26.02.01", "llama3_70b", 64, 256, 1, tp=4, pp=8, vp=5, tokens_per_gpu=1639),
    Row("26.02.01", "qwen3_30b", 16, 1024, 1, ep=16, tokens_per_gpu=9058, note="dropless; recipe layout",
        dispatcher="hybridep"),
    Row("26.02.01", "qwen3_235b", 256, 8192, 1, tp=2, pp=8, vp=4, ep=32, split="account", tokens_per_gpu=1611,
        note="dropless", a2a_overlap=True, tp_overlap=False),
    Row("26.04", "llama3_70b", 64, 256, 1, tp=4, pp=8, vp=5, tokens_per_gpu=1633),
    Row("26.04", "qwen3_30b", 16, 1024, 1, ep=16, tokens_per_gpu=8901, note="dropless", dispatcher="hybridep"),
    Row("26.04", "qwen3_235b", 256, 8192, 1, tp=2, pp=8, vp=4, ep=32, split="account", tokens_per_gpu=1686,
        note="dropless", a2a_overlap=True, tp_overlap=False),
    Row("26.04.01", "llama3_70b", 64, 256, 1, tp=4, pp=8, vp=5, tokens_per_gpu=1664),
    Row("26.04.01", "llama405b", 1024, 1536, 1, tp=8, pp=8, cp=2, vp=8, split="account", tokens_per_gpu=328),
    Row("26.04.01", "qwen3_30b", 16, 1024, 1, ep=16, tokens_per_gpu=8960, note="dropless", dispatcher="hybridep"),
    Row("26.04.01", "qwen3_235b", 256, 8192, 1, tp=2, pp=8, vp=4, ep=32, split="account", tokens_per_gpu=1712,
        note="dropless", a2a_overlap=True, tp_overlap=False),
    Row("26.06", "llama405b", 1024, 1536, 1, tp=8, pp=8, cp=2, vp=8, split="account", tokens_per_gpu=326),
    Row("26.06", "qwen3_30b", 16, 1024, 1, ep=16, tokens_per_gpu=8826, note="dropless", dispatcher="hybridep"),
    # 26.06's SFT table: Llama3-70B fine-tuning on packed 4,096-token sequences, planned as pretraining at that length
    # (the same GEMMs; packing only shortens attention, which the planner does not credit). LoRA is out of scope.
    # Its recipe (v0.5.0 LLAMA3_70B_SFT_CONFIG_H100_FP8_CS_V1, as since v0.3.1) captures the MLPs in TE's CUDA graphs.
    Row("26.06", "llama3_70b", 32, 32, 1, tp=4, pp=4, vp=5, seq=4096, tokens_per_gpu=1638, note="SFT, packed",
        graphs=("transformer_engine", ("mlp",))),
]


H200_RECIPES = ("llama3_8b", "llama3_70b", "llama405b", "mixtral", "deepseek_v3", "qwen3_30b_a3b", "qwen3_235b_a22b",
                "gpt3")
"""Every shipped GPU recipe; its ``<name>_h200`` variant (the H200 profile, the layout chosen for 141 GB) is planned."""


def _overrides(row: Row, cluster: str = "h100") -> list[str]:
    moe = row.ep > 1
    out = ["recipe=llama3_70b", f"model={MODELS[row.model]}", f"cluster={cluster}", f"nodes={row.gpus // 8}",
           f"parallel.tensor={row.tp}", f"parallel.pipeline={row.pp}", f"parallel.context={row.cp}",
           f"parallel.expert={row.ep}", f"parallel.virtual_pipeline={row.vp if row.vp > 1 else 'null'}",
           f"parallel.sequence_parallel={'true' if row.tp > 1 else 'false'}",
           f"parallel.tp_comm_overlap={'true' if _tp_overlap(row) else 'false'}",
           "parallel.first_stage_layers=null", "parallel.last_stage_layers=null",
           f"train.micro_batch_size={row.mbs}", f"train.global_batch_size={row.gbs}",
           f"schedule.kind={Schedule.INTERLEAVED if row.vp > 1 else Schedule.ONE_F_ONE_B}",
           f"schedule.overlap_p2p_comm={'true' if row.vp > 1 else 'false'}",
           f"precision.fp8={row.fp8 or ('delayed' if row.release == '24.12' else 'tensorwise')}",
           "train.recompute=selective" if row.model == "deepseek_v3" else "train.recompute=none", "force=true"]
    out += ["model.cross_entropy_loss_fusion=true"]  # Megatron-Bridge's performance recipes fuse the loss
    if row.seq:
        out += [f"model.seq_length={row.seq}"]
    impl, modules = row.graphs
    out += [f"train.cuda_graph_impl={impl}"] + ([f"train.cuda_graph_modules=[{','.join(modules)}]"] if modules else [])
    if row.fp8 == "blockwise":
        out += ["precision.fp8_param=false"]
    if moe:
        out += ["parallel.expert_tensor=1", "model.moe_grouped_gemm=true",
                f"parallel.moe_a2a_overlap={'true' if row.a2a_overlap else 'false'}"]
    if row.dispatcher:
        out += ["model.moe_token_dispatcher_type=flex", f"model.moe_flex_dispatcher_backend={row.dispatcher}"]
    if row.split == "account":
        out += ["parallel.account_for_embedding_in_pipeline_split=true", "parallel.account_for_loss_in_pipeline_split=true"]
    elif row.split:
        out += [f"parallel.pipeline_model_parallel_layout='{row.split}'"]
    if row.fsdp:
        out += _fsdp()
    if "tokendrop" in row.note:  # Megatron-Bridge's token-drop MoE runs: capacity 1.0, padded to it
        out += ["model.moe_expert_capacity_factor=1.0", "model.moe_pad_expert_input_to_capacity=true"]
    return out + row.extra


def _tp_overlap(row: Row) -> bool:
    return row.tp > 1 and (row.tp_overlap if row.tp_overlap is not None else row.ep == 1)


def _fsdp() -> list[str]:
    """Megatron FSDP; Megatron-LM refuses it with CUDA_DEVICE_MAX_CONNECTIONS=1 (the profiles' value for TP/CP
    overlap)."""
    return ["parallel.megatron_fsdp=true", "cluster.env.CUDA_DEVICE_MAX_CONNECTIONS=8"]


def indistinguishable() -> list[list[Row]]:
    """Groups of two or more rows the planner cannot tell apart: the same overrides, i.e. the same job (NVIDIA's
    releases of one layout, which differ only in what the planner does not take: the container, small recipe
    settings; see NOTES.md)."""
    groups: dict = {}
    for row in ROWS:
        groups.setdefault(tuple(_overrides(row)), []).append(row)
    return [g for g in groups.values() if len(g) > 1]


def floor(rows: list[Row]) -> float:
    """The least max |error| any one prediction can have against these rows: at the harmonic mean p of the lowest
    (lo) and highest (hi) published figure, p / lo - 1 = 1 - p / hi = (hi - lo) / (hi + lo)."""
    lo, hi = min(r.tokens_per_gpu for r in rows), max(r.tokens_per_gpu for r in rows)
    return (hi - lo) / (hi + lo)


def predict(row: Row, cluster: str = "h100"):
    from launcher.config import compose_job
    from launcher.plan import plan_job

    return plan_job(compose_job(_overrides(row, cluster)))


def error(row: Row, plan) -> float:
    """Predicted / published tokens per second per GPU - 1."""
    return plan.perf["tokens_per_s_per_gpu"] / row.tokens_per_gpu - 1


def _summary(label: str, errs: list[float]) -> str:
    worst = max(errs, key=abs)
    return (f"{label}: {len(errs)} rows, mean |error| {100 * statistics.mean(map(abs, errs)):.1f}%, "
            f"worst {100 * worst:+.1f}%, mean signed {100 * statistics.mean(errs):+.1f}%")


def main() -> int:
    print(f"{'row':<66} {'published':>9} {'predicted':>9} {'pub TF':>7} {'pred TF':>7} {'error':>7}  {'peak GB':>7}  note")
    errs = {}
    for row in ROWS:
        plan = predict(row)
        pub_tf = row.tokens_per_gpu * plan.flops_per_token / 1e12
        pred = plan.perf["tokens_per_s_per_gpu"]
        errs[row.name] = err = error(row, plan)
        mark = "" if plan.fits else " OOM!"
        note = ("fitted" if row.fitted else "held-out") + (f", {row.note}" if row.note else "")
        if row.graphs[0] != "none":
            note += f"; CUDA graphs {row.graphs[0]} [{','.join(row.graphs[1])}]"
        if row.fit:
            note += f"; fitted {row.fit}"
        print(f"{row.name:<66} {row.tokens_per_gpu:>9,.0f} {pred:>9,.0f} {pub_tf:>7.0f} {plan.perf['tflops_per_gpu']:>7.0f} "
              f"{100 * err:>+6.1f}%  {plan.peak_gb:>7.1f}{mark}  {note}")
    print(_summary("fitted rows (<= 25.09, NeMo 24.12; Qwen3-30B 25.11 for the host constant)",
                   [errs[r.name] for r in ROWS if r.fitted]))
    print(_summary("held-out rows (25.11 .. 26.06)", [errs[r.name] for r in ROWS if not r.fitted]))
    print(_summary("MoE rows (fitted + held-out)", [errs[r.name] for r in ROWS if r.ep > 1]))
    print(_summary("all rows", list(errs.values())))
    print("rows the planner cannot tell apart (one job, several releases): the least max |error| one prediction can "
          "reach on each group, and the planner's")
    for group in indistinguishable():
        head = group[0]
        print(f"  {head.model} {head.name.split(' ', 2)[2]:<52} releases {', '.join(r.release for r in group):<34} "
              f"floor {100 * floor(group):.1f}%  planner {100 * max(abs(errs[r.name]) for r in group):.1f}%")
    print("\nH200 predictions (the *_h200 recipes: cluster=h200 and their own layouts; no published H200 training figure exists):")
    from launcher.config import compose_job
    from launcher.plan import plan_job

    for recipe in H200_RECIPES:
        plan = plan_job(compose_job([f"recipe={recipe}_h200"]))
        print(f"  {recipe:<16} {plan.perf['tokens_per_s_per_gpu']:>8,.0f} tokens/s/GPU  {plan.perf['tflops_per_gpu']:>5.0f} "
              f"TFLOP/s/GPU  MFU {100 * plan.perf['mfu']:.1f}%  peak {plan.peak_gb:.1f} GB")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
