"""A catalogue of invalid jobs: each exits 2 with one line naming the right field, and no traceback."""
from __future__ import annotations

import subprocess
import sys

import pytest

from conftest import ROOT

L405 = ["recipe=llama405b"]
L70 = ["recipe=llama3_70b"]
L8 = ["recipe=llama3_8b"]
Q30 = ["recipe=qwen3_30b_a3b"]
SMOKE = ["recipe=smoke"]
MOE = ["recipe=smoke", "model.num_experts=4", "parallel.sequence_parallel=true"]

# (case id, overrides, field the message must name)
CASES = [
    ("world-size", L8 + ["nodes=1", "parallel.context=3"], "parallel.context="),
    ("tp-over-node", L405 + ["parallel.tensor=16", "nodes=128"], "parallel.tensor=16"),
    ("heads-tp", L8 + ["parallel.tensor=3", "nodes=3", "parallel.context=1"], "parallel.tensor=3"),
    ("gqa-groups-tp", L8 + ["model.num_query_groups=2", "parallel.tensor=4", "parallel.context=1"], "parallel.tensor=4"),
    ("layers-pp", L8 + ["parallel.pipeline=3", "nodes=3", "parallel.context=1"], "model.num_layers="),
    ("layers-pp-vpp", L70 + ["parallel.virtual_pipeline=3"], "model.num_layers="),
    ("uneven-split", L405 + ["parallel.first_stage_layers=14"], "parallel.first_stage_layers="),
    ("uneven-without-pp", L8 + ["parallel.first_stage_layers=4"], "parallel.first_stage_layers="),
    ("seq-cp", L8 + ["model.seq_length=8190"], "parallel.context="),
    ("cp-needs-te", L8 + ["precision.transformer_engine=false", "+experiment=bf16"], "parallel.context="),
    ("experts-ep", ["recipe=smoke", "model.num_experts=6", "parallel.expert=4", "parallel.tensor=1",
                    "parallel.pipeline=1"], "parallel.expert="),
    ("ep-dense", ["recipe=smoke", "parallel.expert=2"], "parallel.expert="),
    ("moe-tp-needs-sp", ["recipe=smoke", "model.num_experts=4"], "parallel.sequence_parallel="),
    ("gbs-micro-dp", L8 + ["train.global_batch_size=126"], "train.global_batch_size="),
    ("dp-assert", L8 + ["parallel.data=8"], "parallel.data="),
    ("fp8-on-cpu", ["recipe=smoke", "precision.fp8=delayed", "precision.dtype=bf16"], "precision.fp8="),
    ("mxfp8-on-hopper", L8 + ["precision.fp8=mxfp8"], "precision.fp8="),
    ("blockwise-on-blackwell", L8 + ["cluster.gpu=B200", "precision.fp8=blockwise"], "precision.fp8="),
    ("fp8-unknown", L8 + ["precision.fp8=fp4"], "precision.fp8="),
    ("fp8-with-fp32", L8 + ["precision.dtype=fp32"], "precision.dtype="),
    ("fp8-param-without-fp8", L8 + ["+experiment=bf16", "precision.fp8_param=true"], "precision.fp8_param="),
    ("te-on-cpu", ["recipe=smoke", "precision.transformer_engine=true"], "precision.transformer_engine="),
    ("interleaved-pp2-batched-p2p", ["recipe=smoke", "schedule.kind=interleaved", "parallel.virtual_pipeline=2"],
     "schedule.batch_p2p_comm="),
    ("interleaved-without-vpp", ["recipe=smoke", "schedule.kind=interleaved"], "schedule.kind="),
    ("vpp-without-interleaved", ["recipe=smoke", "parallel.virtual_pipeline=2"], "parallel.virtual_pipeline="),
    ("schedule-unknown", ["recipe=smoke", "schedule.kind=gpipe"], "schedule.kind="),
    ("overlap-p2p-1f1b", ["recipe=smoke", "schedule.overlap_p2p_comm=true"], "schedule.overlap_p2p_comm="),
    ("steps-and-tokens", ["recipe=smoke", "train.train_tokens=1000000"], "train.train_steps="),
    ("min-lr", ["recipe=smoke", "train.min_lr=1.0"], "train.min_lr="),
    ("warmup", ["recipe=smoke", "train.warmup_steps=30"], "train.warmup_steps="),
    ("lr-schedule", ["recipe=smoke", "train.lr_schedule=step"], "train.lr_schedule="),
    ("recompute", ["recipe=smoke", "train.recompute=partial"], "train.recompute="),
    ("blend-zero-weight", ["recipe=smoke", "data.blend=[0,a,1,b]"], "data.blend="),
    ("blend-malformed", ["recipe=smoke", "data.blend=[0.5,a,b]"], "data.blend="),
    ("split", ["recipe=smoke", "data.split='90,10'"], "data.split="),
    ("indexed-needs-blend", L8 + ["data.kind=indexed"], "data.blend="),
    ("local-multinode", ["recipe=smoke", "nodes=2"], "nodes="),
    ("nccl-on-cpu", ["recipe=smoke", "cluster.backend=nccl"], "cluster.backend="),
    ("secret-in-env", ["recipe=smoke", "+cluster.env.WANDB_API_KEY=abc123"], "cluster.env.WANDB_API_KEY="),
    ("container-path-outside-mount", L8 + ["cluster.container_image=nvcr.io/nvidia/pytorch:25.01-py3",
                                           "cluster.container_mounts=[/lustre:/lustre]", "output_dir=/home/me/runs"],
     "output_dir="),
    ("slurm-time", L8 + ["slurm.time=forever"], "slurm.time="),
    ("partition-injection", L8 + ["cluster.partition='a b'"], "cluster.partition="),
    ("action", ["action=launch"], "action="),
    ("heads-hidden", ["recipe=smoke", "model.num_attention_heads=3", "parallel.tensor=1", "model.num_query_groups=null"],
     "model.num_attention_heads="),
    ("topk", ["recipe=smoke", "model.num_experts=4", "model.moe_router_topk=8", "parallel.tensor=1"],
     "model.moe_router_topk="),
    ("unknown-field", ["parallel.tensorr=2"], "parallel.tensorr"),
    ("unknown-section", ["paralel.tensor=2"], "paralel.tensor"),
    ("unknown-recipe", ["recipe=llama4"], "recipe="),
    ("wrong-type", ["parallel.tensor=two"], "parallel.tensor"),
    ("ffn-tp", ["recipe=smoke", "model.ffn_hidden_size=351"], "parallel.tensor="),
    ("sp-seq", ["recipe=smoke", "parallel.sequence_parallel=true", "model.seq_length=255"],
     "parallel.sequence_parallel="),
    ("param-gather-needs-distopt", L8 + ["parallel.distributed_optimizer=false"], "parallel.overlap_param_gather="),
    ("tp-overlap-needs-sp", L8 + ["parallel.tp_comm_overlap=true"], "parallel.tp_comm_overlap="),
    ("zb-h1-needs-pp", ["recipe=smoke", "schedule.kind=zb_h1", "parallel.pipeline=1", "parallel.tensor=4"],
     "schedule.kind="),
    ("mla-needs-te", ["recipe=smoke", "model.multi_latent_attention=true"], "model.multi_latent_attention="),
    ("blend-with-mock", L8 + ["data.blend=[/lustre/a]"], "data.kind="),
    ("blend-missing-files", L8 + ["data.kind=indexed", "data.blend=[/nonexistent/a_text_document]",
                                  "data.tokenizer=data/assets/tokenizer.json"], "data.blend"),
    ("run-on-slurm-profile", L8 + ["action=run"], "action="),
    ("submit-on-local-profile", ["recipe=smoke", "action=submit"], "action="),
    ("norm", ["recipe=smoke", "model.normalization=BatchNorm"], "model.normalization="),
    ("choice-on-dense-model", ["recipe=smoke", "model.moe_token_dispatcher_type=alltoallv"],
     "model.moe_token_dispatcher_type="),
    ("fp8-format-unknown", L8 + ["precision.fp8_format=e5m2"], "precision.fp8_format="),
    ("fp8-param-needs-distopt", L8 + ["parallel.distributed_optimizer=false", "parallel.overlap_param_gather=false"],
     "precision.fp8_param="),
    ("param-gather-needs-grad-overlap", L8 + ["parallel.overlap_grad_reduce=false"], "parallel.overlap_param_gather="),
    ("tp-overlap-needs-te", ["recipe=smoke", "parallel.tp_comm_overlap=true", "parallel.sequence_parallel=true"],
     "parallel.tp_comm_overlap="),
    ("zero-gpus-per-node", L8 + ["cluster.gpus_per_node=0"], "cluster.gpus_per_node="),
    ("zero-tensor", L70 + ["parallel.tensor=0"], "parallel.tensor="),
    ("zero-virtual-pipeline", L70 + ["parallel.virtual_pipeline=0"], "parallel.virtual_pipeline="),
    ("absurd-pipeline", L70 + ["parallel.pipeline=100000"], "parallel.pipeline="),
    # --- validation that agrees with Megatron-Core: each class of the issue, one or two examples each
    ("attention-dropout-named", SMOKE + ["model.attention_dropout=1.5"], "model.attention_dropout="),
    ("adam-beta1-named", SMOKE + ["train.adam_beta1=1.0"], "train.adam_beta1="),
    ("shared-expert-tp", MOE + ["model.moe_shared_expert_intermediate_size=129"],
     "model.moe_shared_expert_intermediate_size="),
    ("shared-expert-zero", MOE + ["model.moe_shared_expert_intermediate_size=0"],
     "model.moe_shared_expert_intermediate_size="),
    ("expert-ffn-etp", MOE + ["model.moe_ffn_hidden_size=33"], "model.moe_ffn_hidden_size="),
    ("expert-ffn-etp-explicit", MOE + ["parallel.expert_tensor=2", "model.moe_ffn_hidden_size=65"],
     "parallel.expert_tensor="),
    ("top1-needs-pre-softmax", MOE + ["model.moe_router_topk=1"], "model.moe_router_topk="),
    ("sinkhorn-aux-loss", MOE + ["model.moe_router_load_balancing_type=sinkhorn", "model.moe_aux_loss_coeff=0.01"],
     "model.moe_aux_loss_coeff="),
    ("shared-expert-bias", MOE + ["parallel.tensor=1", "parallel.sequence_parallel=false",
                                  "model.moe_shared_expert_intermediate_size=128", "model.add_bias_linear=true"],
     "model.moe_shared_expert_intermediate_size="),
    ("moe-bias-etp", MOE + ["model.add_bias_linear=true"], "model.add_bias_linear="),
    ("kv-channels-zero", SMOKE + ["model.kv_channels=0"], "model.kv_channels="),
    ("kv-channels-odd-rope", SMOKE + ["model.kv_channels=7"], "model.kv_channels="),
    ("init-std-negative", SMOKE + ["model.init_method_std=-0.02"], "model.init_method_std="),
    ("expert-tensor-zero", SMOKE + ["parallel.expert_tensor=0"], "parallel.expert_tensor="),
    ("expert-tensor-negative", SMOKE + ["parallel.expert_tensor=-2"], "parallel.expert_tensor="),
    ("expert-tensor-world", MOE + ["parallel.expert_tensor=3"], "parallel.expert_tensor="),
    ("expert-tensor-dense-world", SMOKE + ["parallel.expert_tensor=3"], "parallel.expert_tensor="),
    ("recompute-layers-negative", SMOKE + ["train.recompute_num_layers=-1"], "train.recompute_num_layers="),
    ("recompute-layers-too-many", SMOKE + ["train.recompute=full", "train.recompute_num_layers=3"],
     "train.recompute_num_layers="),
    ("recompute-layers-selective", SMOKE + ["train.recompute=selective", "train.recompute_num_layers=1"],
     "train.recompute_num_layers="),
    ("ep-fp16", L8 + ["model.num_experts=8", "parallel.expert=2", "precision.dtype=fp16", "precision.fp8=null",
                      "precision.fp8_param=false"], "precision.dtype="),
    ("fp16-on-cpu", SMOKE + ["precision.dtype=fp16"], "precision.dtype="),
    ("mtp-learned-absolute", SMOKE + ["model.mtp_num_layers=1", "model.position_embedding=learned_absolute"],
     "model.position_embedding="),
    ("mla-gqa", L8 + ["model=deepseek_v3", "model.num_query_groups=8"], "model.num_query_groups="),
    ("world-hint-cp2", L8 + ["nodes=1", "parallel.context=2", "parallel.pipeline=3"], "parallel.pipeline="),
    ("context-5", SMOKE + ["parallel.context=5"], "parallel.context="),
    ("negative-lr", SMOKE + ["train.lr=-3e-4"], "train.lr="),
    ("negative-gbs", SMOKE + ["train.global_batch_size=-4"], "train.global_batch_size="),
    ("lr-inf", SMOKE + ["train.lr=inf"], "train.lr="),
    ("norm-eps-nan", SMOKE + ["model.norm_epsilon=nan"], "model.norm_epsilon="),
    # declared ranges (launcher/validate/generic.py BOUNDS; tests/test_bounds.py checks every one in-process)
    ("norm-eps-zero", SMOKE + ["model.norm_epsilon=0"], "model.norm_epsilon="),
    ("num-workers-negative", SMOKE + ["data.num_workers=-1"], "data.num_workers="),
    ("cluster-float-nan", L8 + ["cluster.gpu_memory_gb=nan"], "cluster.gpu_memory_gb="),
    ("blend-weight-inf", SMOKE + ["data.blend=[inf,data/assets/smoke_text_document]"], "data.blend="),
    ("async-save-fsdp", SMOKE + ["checkpoint.async_save=true", "parallel.megatron_fsdp=true", "parallel.pipeline=1",
                                 "parallel.distributed_optimizer=true"], "checkpoint.async_save="),
    ("wandb-project-semicolon", SMOKE + ["logging.wandb_project='a;b'"], "logging.wandb_project="),
    ("wandb-project-slash", SMOKE + ["logging.wandb_project=team/proj"], "logging.wandb_project="),
    ("wrong-type-float", SMOKE + ["train.lr=fast"], "train.lr="),
    ("wrong-type-bool", SMOKE + ["parallel.sequence_parallel=maybe"], "parallel.sequence_parallel="),
    ("secret-interpolation", SMOKE + ["+cluster.env.X=${oc.env:WANDB_API_KEY}"], "cluster.env.X="),
    ("secret-listed-interpolation", SMOKE + ["cluster.secret_env=[MY_PASS_VAR]", "logging.wandb_entity=${oc.env:MY_PASS_VAR}"],
     "logging.wandb_entity="),
    ("huge-int", SMOKE + ["train.seed=99999999999999999999"], "train.seed="),
    ("huge-first-stage", L70 + ["parallel.first_stage_layers=2147483648"], "parallel.first_stage_layers="),
    # --- nothing lost, nothing hangs: restart/requeue budgets, the stop-in-time arithmetic, the straggler report
    ("max-requeues-negative", SMOKE + ["slurm.max_requeues=-1"], "slurm.max_requeues="),
    ("max-restarts-negative", SMOKE + ["cluster.max_restarts=-2"], "cluster.max_restarts="),
    ("signal-lead-negative", SMOKE + ["slurm.signal_lead_s=-5"], "slurm.signal_lead_s="),
    ("signal-lead-over-limit", SMOKE + ["slurm.time=00:10:00", "slurm.signal_lead_s=600"], "slurm.signal_lead_s="),
    ("signal-factor-below-1", SMOKE + ["slurm.signal_save_factor=0.5"], "slurm.signal_save_factor="),
    ("signal-factor-inf", SMOKE + ["slurm.signal_save_factor=inf"], "slurm.signal_save_factor="),
    ("signal-margin-negative", SMOKE + ["slurm.signal_margin_s=-1"], "slurm.signal_margin_s="),
    ("signal-margin-over-limit", SMOKE + ["slurm.time=00:02:00"], "slurm.signal_margin_s="),
    ("checkpoint-write-zero", SMOKE + ["cluster.checkpoint_write_gbps=0"], "cluster.checkpoint_write_gbps="),
    ("straggler-interval-negative", SMOKE + ["train.straggler_interval=-5"], "train.straggler_interval="),
    ("straggler-margin-zero", SMOKE + ["train.straggler_margin=0"], "train.straggler_margin="),
    ("straggler-margin-nan", SMOKE + ["train.straggler_margin=nan"], "train.straggler_margin="),
    ("health-check-not-bool", SMOKE + ["cluster.health_check=maybe"], "cluster.health_check="),
    # the stated hint (PP 1, a 16-sample batch) would break the interleaved schedule: the hint is searched
    ("pipeline-zero-interleaved", ["recipe=qwen3_30b_a3b", "parallel.pipeline=0"], "parallel.pipeline=0"),
    ("gbs-below-interleaved", ["recipe=deepseek_v3", "train.global_batch_size=1"], "train.global_batch_size=1"),
    ("absurd-vpp", ["recipe=qwen3_30b_a3b", f"parallel.virtual_pipeline={10**400}"], "parallel.virtual_pipeline="),
    # --- issue 41, the optimizer's levers: Megatron-Core's OptimizerConfig and Megatron-LM's validate_args rules
    ("optimizer-dtype-needs-precision-aware", L8 + ["precision.exp_avg_dtype=bf16"], "precision.exp_avg_dtype="),
    ("offload-needs-precision-aware", L8 + ["train.optimizer_cpu_offload=true"], "train.optimizer_cpu_offload="),
    ("precision-aware-needs-distopt", L8 + ["precision.precision_aware_optimizer=true", "parallel.distributed_optimizer=false"],
     "precision.precision_aware_optimizer="),
    ("precision-aware-needs-te-fusedadam", SMOKE + ["precision.dtype=bf16", "parallel.distributed_optimizer=true",
                                                    "precision.precision_aware_optimizer=true"], "precision.precision_aware_optimizer="),
    ("offload-fp32-model", SMOKE + ["parallel.distributed_optimizer=true", "precision.precision_aware_optimizer=true", "train.optimizer_cpu_offload=true"], "train.optimizer_cpu_offload="),
    ("offload-ignores-moment-dtypes", L8 + ["precision.precision_aware_optimizer=true", "train.optimizer_cpu_offload=true", "precision.exp_avg_dtype=bf16"], "precision.exp_avg_dtype="),
    ("bf16-main-grads-with-fp32-reduce", L8 + ["precision.precision_aware_optimizer=true", "precision.main_grads_dtype=bf16",
                                               "precision.grad_reduce_in_fp32=true"], "precision.main_grads_dtype="),
    ("offload-fraction-above-one", L8 + ["precision.precision_aware_optimizer=true", "train.optimizer_cpu_offload=true", "train.optimizer_offload_fraction=1.5"],
     "train.optimizer_offload_fraction="),
    ("offload-fp8-params-need-delayed", L8 + ["precision.fp8=tensorwise", "precision.fp8_param=true", "precision.precision_aware_optimizer=true", "train.optimizer_cpu_offload=true"],
     "train.optimizer_cpu_offload="),
    # --- issue 40, calibrated cluster profiles (action=bench writes them; cluster.profile selects one)
    ("profile-does-not-parse", SMOKE + ["cluster.profile=tests/fixtures/profiles/broken.yaml"], "cluster.profile="),
    ("profile-other-gpu", SMOKE + ["cluster.profile=tests/fixtures/profiles/h100-calibrated.yaml"], "cluster.profile="),
    ("profile-not-calibrated", SMOKE + ["cluster.profile=recipes/cluster/local.yaml"], "cluster.profile="),
    ("profile-missing", SMOKE + ["cluster.profile=/nonexistent/calibrated-local.yaml"], "cluster.profile="),
    # --- issue 41, fine-grained activation offloading: TransformerConfig.__post_init__ / Megatron-LM validate_args,
    # and ours (modules that offload nothing in these layers, zero bubble, local graphs, full recompute)
    ("offload-unknown-module", Q30 + ["train.activation_offload_modules=[core_attn,bogus]"],
     "train.activation_offload_modules="),
    ("offload-on-cpu", SMOKE + ["train.activation_offload_modules=[qkv_linear]"], "train.activation_offload_modules="),
    ("offload-needs-te", L8 + ["train.activation_offload_modules=[qkv_linear]", "precision.transformer_engine=false",
                               "+experiment=bf16", "parallel.context=1"], "train.activation_offload_modules="),
    ("offload-attn-proj-alone", Q30 + ["train.activation_offload_modules=[attn_proj]"],
     "train.activation_offload_modules="),
    ("offload-recomputed-core-attn", L8 + ["train.recompute=selective", "train.activation_offload_modules=[core_attn]"],
     "train.activation_offload_modules="),
    ("offload-inside-recomputed-moe", Q30 + ["train.recompute=selective", "train.recompute_modules=[moe]",
                                             "train.activation_offload_modules=[expert_fc1]"],
     "train.activation_offload_modules="),
    ("offload-fused-group-mlp", Q30 + ["train.activation_offload_modules=[fused_group_mlp]"],
     "train.activation_offload_modules="),
    ("offload-experts-of-dense", L8 + ["train.activation_offload_modules=[moe_act]"], "train.activation_offload_modules="),
    ("offload-fused-attn-norm", L8 + ["train.activation_offload_modules=[attn_norm]"], "train.activation_offload_modules="),
    ("offload-fused-mlp-norm", L8 + ["train.activation_offload_modules=[mlp_norm]"], "train.activation_offload_modules="),
    ("offload-mlp-norm-graphed-router", Q30 + ["train.activation_offload_modules=[mlp_norm]",
                                               "train.cuda_graph_impl=transformer_engine",
                                               "train.cuda_graph_modules=[attn,moe_router]"],
     "train.activation_offload_modules="),
    ("offload-in-whole-layer-graph", L8 + ["train.activation_offload_modules=[qkv_linear]",
                                          "train.cuda_graph_impl=transformer_engine"], "train.activation_offload_modules="),
    ("offload-in-attention-graph-needs-te-2.14", Q30 + ["train.activation_offload_modules=[core_attn]",
                                                       "train.cuda_graph_impl=transformer_engine",
                                                       "train.cuda_graph_modules=[attn,moe_router]"],
     "train.activation_offload_modules="),
    ("offload-zero-bubble", L8 + ["train.activation_offload_modules=[qkv_linear]", "schedule.kind=zb_h1",
                                  "parallel.pipeline=2"], "train.activation_offload_modules="),
    ("offload-local-graphs", Q30 + ["train.activation_offload_modules=[expert_fc1]", "train.cuda_graph_impl=local",
                                    "train.cuda_graph_modules=[attn]"], "train.cuda_graph_impl="),
    ("offload-full-recompute", L8 + ["train.activation_offload_modules=[qkv_linear]", "train.recompute=full"],
     "train.recompute="),
    ("offload-env-not-v1", Q30 + ["train.activation_offload_modules=[expert_fc1]", "+cluster.env.NVTE_CPU_OFFLOAD_V1=0"],
     "cluster.env.NVTE_CPU_OFFLOAD_V1="),
    ("offload-fraction-out-of-range", Q30 + ["train.activation_offload_modules=[expert_fc1]",
                                             "train.activation_offload_fraction=1.5"], "train.activation_offload_fraction="),
    ("offload-negative-size", Q30 + ["train.activation_offload_modules=[expert_fc1]",
                                     "train.min_offloaded_tensor_size=-1"], "train.min_offloaded_tensor_size="),
    # --- issue 41, CUDA graphs: TransformerConfig.__post_init__ / Megatron-LM validate_args, and ours (zero bubble)
    ("graphs-on-cpu", SMOKE + ["train.cuda_graph_impl=local"], "train.cuda_graph_impl="),
    ("te-graphs-need-te", L8 + ["train.cuda_graph_impl=transformer_engine", "precision.transformer_engine=false",
                                "+experiment=bf16", "parallel.context=1"], "train.cuda_graph_impl="),
    ("graphs-with-zero-bubble", L8 + ["schedule.kind=zb_h1", "parallel.pipeline=2", "train.cuda_graph_impl=local"],
     "train.cuda_graph_impl="),
    ("graphs-full-recompute", L8 + ["train.cuda_graph_impl=local", "train.recompute=full"], "train.recompute="),
    ("graphs-moe-on-dense", L8 + ["train.cuda_graph_impl=local", "train.cuda_graph_modules=[attn,moe_router]"],
     "train.cuda_graph_modules="),
    ("graphs-moe-and-router", Q30 + ["train.cuda_graph_impl=transformer_engine", "train.cuda_graph_modules=[moe,moe_router]",
                                     "model.moe_expert_capacity_factor=1.0", "model.moe_pad_expert_input_to_capacity=true"],
     "train.cuda_graph_modules="),
    ("graphs-preprocess-without-router", Q30 + ["train.cuda_graph_impl=transformer_engine",
                                                "train.cuda_graph_modules=[attn,moe_preprocess]"], "train.cuda_graph_modules="),
    ("graphs-dropless-moe-layer", Q30 + ["train.cuda_graph_impl=local"], "train.cuda_graph_modules="),
    ("graphs-mlp-without-dense-layers", Q30 + ["train.cuda_graph_impl=transformer_engine",
                                               "train.cuda_graph_modules=[attn,mlp]"], "train.cuda_graph_modules="),
    ("graphs-dropout-recompute", L8 + ["train.cuda_graph_impl=local", "model.attention_dropout=0.1",
                                       "train.recompute=selective"], "model.attention_dropout="),
    ("te-graphs-expandable-segments", L8 + ["train.cuda_graph_impl=transformer_engine",
                                            "+cluster.env.PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True"],
     "cluster.env.PYTORCH_CUDA_ALLOC_CONF="),
    ("graphs-unknown-module", L8 + ["train.cuda_graph_impl=local", "train.cuda_graph_modules=[mamba]"],
     "train.cuda_graph_modules="),
    ("graphs-megatron-fsdp", L8 + ["train.cuda_graph_impl=local", "parallel.context=1", "parallel.megatron_fsdp=true",
                                   "cluster.env.CUDA_DEVICE_MAX_CONNECTIONS=8"], "train.cuda_graph_impl="),
    ("local-graphs-with-a2a-overlap", ["recipe=deepseek_v3", "train.cuda_graph_impl=local", "train.cuda_graph_modules=[attn]"],
     "train.cuda_graph_impl="),
    ("local-graphs-preprocess-dtoh", Q30 + ["train.cuda_graph_impl=local", "train.cuda_graph_modules=[attn,moe_router]",
                                            "model.moe_expert_capacity_factor=1.0"], "train.cuda_graph_modules="),
    ("graphs-warmup-negative", L8 + ["train.cuda_graph_impl=local", "train.cuda_graph_warmup_steps=-1"],
     "train.cuda_graph_warmup_steps="),
]

HINTED = ["fp8-param-needs-distopt", "param-gather-needs-grad-overlap", "tp-overlap-needs-sp", "tp-overlap-needs-te",
          "pipeline-zero-interleaved", "gbs-below-interleaved", "optimizer-dtype-needs-precision-aware",
          "precision-aware-needs-te-fusedadam", "offload-fp32-model",
          "offload-ignores-moment-dtypes", "bf16-main-grads-with-fp32-reduce", "offload-fp8-params-need-delayed",
          "graphs-on-cpu", "te-graphs-need-te", "graphs-with-zero-bubble", "graphs-full-recompute", "graphs-moe-on-dense",
          "graphs-moe-and-router", "graphs-preprocess-without-router", "graphs-dropless-moe-layer",
          "graphs-mlp-without-dense-layers", "graphs-dropout-recompute", "te-graphs-expandable-segments",
          "graphs-unknown-module", "graphs-megatron-fsdp", "local-graphs-with-a2a-overlap",
          "local-graphs-preprocess-dtoh"]
"""Cases whose hint is a plain override (or several joined by " or "): each alternative must validate."""


def test_catalogue_is_large():
    assert len(CASES) >= 25


@pytest.mark.parametrize("overrides,field", [c[1:] for c in CASES], ids=[c[0] for c in CASES])
def test_invalid_config_is_refused(overrides, field, cli, tmp_path):
    code, out, err = cli("action=render", f"output_dir={tmp_path}", *overrides)
    assert code == 2
    assert "Traceback" not in err + out
    error_lines = [l for l in err.splitlines() if l.startswith("error:")]
    assert error_lines, err
    assert any(field in line for line in error_lines), err
    assert all("try " in line or "error: Error" in line or "flags" in line for line in error_lines), err
    assert list(tmp_path.iterdir()) == []  # nothing rendered


@pytest.mark.parametrize("case", HINTED)
def test_hint_is_itself_valid(case):
    from launcher.config import compose_job
    from launcher.validate import validate

    overrides, field = next((o, f) for cid, o, f in CASES if cid == case)
    [problem] = [p for p in validate(compose_job(overrides)) if p.severity == "error" and p.line().startswith(
        f"error: {field}")]
    for alternative in problem.hint.split(" or "):
        fixed = validate(compose_job([*overrides, alternative]))
        assert not [p for p in fixed if p.severity == "error"], (alternative, [p.line() for p in fixed])


@pytest.mark.parametrize("case", [c[0] for c in CASES])
def test_every_printed_alternative_validates(case):
    """Each override alternative a refusal prints makes its problem go away without a new error."""
    from launcher.config import ConfigError, compose_job
    from launcher.validate import raw_problems, validate
    from launcher.validate.hints import hint_overrides, problem_key

    overrides = next(o for cid, o, _ in CASES if cid == case)
    try:
        job = compose_job(overrides)
    except ConfigError:
        return  # refused while composing (unknown key, wrong type): its hint is checked by the CLI tests
    problems = validate(job)
    before = {problem_key(p) for p in problems if p.severity == "error"}
    for problem in (p for p in problems if p.severity == "error"):
        for alternative in problem.hint.split(" or "):
            pairs = hint_overrides(alternative)
            if not pairs:
                continue
            fixed = compose_job([*overrides, *(f"{k}={v}" for k, v in pairs)])
            after = {problem_key(p) for p in raw_problems(fixed) if p.severity == "error"}
            assert problem_key(problem) not in after and not after - before, (problem.line(), alternative, after - before)


@pytest.mark.parametrize("overrides,field", [
    (L8 + ["data.kind=indexed", "data.blend=[/nonexistent/a_text_document]",
           "data.tokenizer=data/assets/tokenizer.json"], "data.blend"),
    (SMOKE + ["data.tokenizer=/nonexistent/tokenizer.json"], "data.tokenizer="),
    (SMOKE + ["model.vocab_size=256"], "model.vocab_size"),
], ids=["missing-blend", "missing-tokenizer", "vocab-below-largest-id"])
def test_validate_runs_the_data_preflight(overrides, field, cli):
    code, out, err = cli("action=validate", *overrides)
    assert code == 2 and "Traceback" not in err
    assert any(field in line for line in err.splitlines() if line.startswith("error:")), err


def test_type_error_names_the_field_and_its_range(cli):
    code, _, err = cli("recipe=smoke", "parallel.tensor=two", "action=validate")
    assert code == 2
    assert err.strip() == "error: parallel.tensor='two': must be a positive integer; try parallel.tensor=2"


def test_tri_state_accepts_bare_false(cli):
    code, out, err = cli("recipe=smoke", "precision.transformer_engine=false", "action=validate")
    assert code == 0, err
    code, _, err = cli("recipe=smoke", "precision.transformer_engine=False", "action=validate")
    assert code == 0, err


def test_secret_interpolation_never_prints_the_value(cli, monkeypatch, tmp_path):
    monkeypatch.setenv("WANDB_API_KEY", "s3cr3t-value")
    code, out, err = cli("recipe=smoke", "+cluster.env.X=${oc.env:WANDB_API_KEY}", f"output_dir={tmp_path}")
    assert code == 2 and "s3cr3t-value" not in out + err and "cluster.env.X" in err
    assert list(tmp_path.iterdir()) == []
    code, _, err = cli("recipe=smoke", "+cluster.env.HOME_DIR=${oc.env:HOME,/root}", "action=validate")
    assert code == 2 and "cluster.env.HOME_DIR" in err, err  # no environment value is written (issue 45)


@pytest.mark.parametrize("action", ["validate", "plan"])
def test_zero_gpus_per_node_does_not_crash(action, cli):
    code, _, err = cli("recipe=llama3_8b", "cluster.gpus_per_node=0", f"action={action}")
    assert code == 2 and "Traceback" not in err and "cluster.gpus_per_node" in err


def test_several_failures_are_all_reported(cli):
    code, _, err = cli("recipe=llama3_8b", "parallel.tensor=3", "train.lr_schedule=step", "slurm.time=x")
    assert code == 2
    fields = [l.split("=")[0] for l in err.splitlines() if l.startswith("error:")]
    assert {"error: parallel.tensor", "error: train.lr_schedule", "error: slurm.time"} <= set(fields)


@pytest.mark.parametrize("args", [["parallel.tensor=3", "recipe=llama3_8b"], ["recipe=nope"], ["--bogus"],
                                  ["parallel.tensor=x"]])
def test_real_process_exit_code_and_no_traceback(args):
    proc = subprocess.run([sys.executable, "-m", "launcher", *args], cwd=ROOT, capture_output=True, text=True,
                          timeout=60)
    assert proc.returncode == 2
    assert "Traceback" not in proc.stderr
    assert proc.stderr.startswith("error:")


def test_hang_exclusion_on_a_local_cluster_is_said(cli):
    """slurm.on_hang=exclude resubmits through Slurm without the culprit's node; a local run has no scheduler:
    the field was accepted silently and the run just stopped. A warning, with the alternative; Slurm is quiet."""
    code, out, err = cli("recipe=smoke", "slurm.on_hang=exclude", "action=validate")
    assert code == 0 and err.startswith("warning: slurm.on_hang='exclude': cluster local runs on this machine"), err
    assert "try slurm.on_hang=stop" in err
    code, out, err = cli("recipe=smoke", "slurm.on_hang=exclude", "cluster=h200", "action=validate")
    assert code == 0 and "slurm.on_hang" not in err, err
