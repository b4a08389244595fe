"""The torch-free core both wings read: the job's derived layout, computed once, and the job file.

``derive(job)`` turns a composed job into a frozen :class:`Layout` (world, TP/PP/VPP/CP/EP/ETP, DP,
microbatches, steps, tokens, padded vocabulary, MoE layer pattern, layers per stage and chunk). Validation's
cross-rules, the planner, render's cross-check and the rank wing all read these values instead of re-deriving
them. FLOPs per token (Megatron's formula) lives here too: the planner predicts with it and the ranks log with it.
Only ``launcher.schema``, the standard library and OmegaConf are imported here.
"""
from launcher.core.blend import parse_blend
from launcher.core.jobfile import job_to_yaml, load_job
from launcher.core.layout import Layout, derive, moe_layer_pattern, padded_vocab, stage_layer_counts

__all__ = ["Layout", "derive", "moe_layer_pattern", "padded_vocab", "stage_layer_counts", "parse_blend",
           "load_job", "job_to_yaml"]
