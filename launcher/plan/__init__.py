"""Login-node planner: FLOPs, memory per pipeline stage, step time, MFU, layout search. No torch import."""
from launcher.plan.flops import flops_per_step, flops_per_token

__all__ = ["flops_per_token", "flops_per_step"]
