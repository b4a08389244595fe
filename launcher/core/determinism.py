"""train.deterministic: the environment and settings Megatron-LM's --deterministic-mode requires (both wings).

From Megatron-LM's ``megatron/training/determinism.py`` and its determinism catalogue: NCCL's all-reduce algorithm
pinned to one whose reduction order is fixed (``NCCL_ALGO``: Ring by default; CollnetDirect, CollnetChain and
``^NVLS`` accepted; Tree refused: its order is not user-controllable), Transformer Engine limited to deterministic
kernels (``NVTE_ALLOW_NONDETERMINISTIC_ALGO=0``: its attention backward otherwise accumulates with atomics), cuBLAS
on a fixed workspace (``CUBLAS_WORKSPACE_CONFIG`` ``:4096:8`` or ``:16:8``; torch refuses deterministic cuBLAS
without it), ``MAMBA_DETERMINISTIC`` not switched off; and two settings refused: the fused cross-entropy loss and
the TP communication overlap. The values are captured by NCCL, cuBLAS and TE at first use, so they go into env.sh,
before any rank starts. Standard library only.
"""
from __future__ import annotations

from typing import Dict, List, Tuple

ENV_DEFAULTS: Dict[str, str] = {"NCCL_ALGO": "Ring", "NVTE_ALLOW_NONDETERMINISTIC_ALGO": "0",
                                "CUBLAS_WORKSPACE_CONFIG": ":4096:8"}
NCCL_ALGO_TOKENS = ("Ring", "CollnetDirect", "CollnetChain", "^NVLS")
ACCEPTED = {"NVTE_ALLOW_NONDETERMINISTIC_ALGO": ("0",), "CUBLAS_WORKSPACE_CONFIG": (":4096:8", ":16:8")}
REFUSED_SETTINGS: Tuple[Tuple[str, str, object], ...] = (
    ("model.cross_entropy_loss_fusion", "the fused cross-entropy kernel is not deterministic", False),
    ("parallel.tp_comm_overlap", "overlapped TP collectives do not run in a reproducible order", False),
)
"""(field, why, the value deterministic mode needs)."""


def env_problems(env: Dict[str, str]) -> List[Tuple[str, str, str]]:
    """(variable, its value, the rule) for each cluster.env entry that would make a deterministic job not so."""
    out = []
    algo = env.get("NCCL_ALGO")
    if algo is not None:
        tokens = [t.strip() for t in str(algo).split(",") if t.strip()]
        if not tokens or any(t not in NCCL_ALGO_TOKENS for t in tokens):
            out.append(("NCCL_ALGO", str(algo), f"each algorithm must be one of {', '.join(NCCL_ALGO_TOKENS)} (Tree's "
                                                 "reduction order is not fixed)"))
    for name, accepted in ACCEPTED.items():
        value = env.get(name)
        if value is not None and str(value) not in accepted:
            out.append((name, str(value), f"must be {' or '.join(accepted)} for deterministic kernels"))
    mamba = env.get("MAMBA_DETERMINISTIC")
    if mamba and not str(mamba).startswith("1"):
        out.append(("MAMBA_DETERMINISTIC", str(mamba), "must be unset or 1"))
    return out


def env_for(env: Dict[str, str]) -> Dict[str, str]:
    """``env`` with the deterministic defaults filled in where it sets none (a value it sets, once accepted, wins)."""
    return {**ENV_DEFAULTS, **env}
