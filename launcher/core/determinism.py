"""train.deterministic: the environment and settings Megatron-LM's --deterministic-mode requires (both wings).

From Megatron-LM's ``megatron/training/determinism.py`` and its determinism catalogue: NCCL's all-reduce algorithm
pinned to one whose reduction order is fixed (``NCCL_ALGO``: Ring by default; CollnetDirect, CollnetChain and
``^NVLS`` accepted; Tree refused: its order is not user-controllable), Transformer Engine limited to deterministic
kernels (``NVTE_ALLOW_NONDETERMINISTIC_ALGO=0``: its attention backward otherwise accumulates with atomics), cuBLAS
on a fixed workspace (``CUBLAS_WORKSPACE_CONFIG`` ``:4096:8`` or ``:16:8``; torch refuses deterministic cuBLAS
without it), ``MAMBA_DETERMINISTIC`` and ``CAUSAL_CONV1D_DETERMINISTIC`` not switched off (upstream: "if set
(non-empty), must start with '1'"); and two settings refused: the fused cross-entropy loss and the TP
communication overlap (``ARG_VALUES_REQUIRED_FOR_DETERMINISM = {"cross_entropy_loss_fusion": False,
"tp_comm_overlap": False}``). The values are captured by NCCL, cuBLAS and TE at first use, so they go into env.sh,
before any rank starts; the ranks check and complete their own environment again (``apply_env``: upstream's
``apply_determinism_env(os.environ)``, which a launch that bypassed env.sh, or a shell's MAMBA_DETERMINISTIC=0,
would otherwise slip past). Standard library only.
"""
from __future__ import annotations

from typing import Dict, List, MutableMapping, Tuple

ENV_DEFAULTS: Dict[str, str] = {"NCCL_ALGO": "Ring", "NVTE_ALLOW_NONDETERMINISTIC_ALGO": "0",
                                "CUBLAS_WORKSPACE_CONFIG": ":4096:8"}
NCCL_ALGO_TOKENS = ("Ring", "CollnetDirect", "CollnetChain", "^NVLS")
ACCEPTED = {"NVTE_ALLOW_NONDETERMINISTIC_ALGO": ("0",), "CUBLAS_WORKSPACE_CONFIG": (":4096:8", ":16:8")}
SSM_SWITCHES = ("MAMBA_DETERMINISTIC", "CAUSAL_CONV1D_DETERMINISTIC")
"""Mamba SSM's and causal_conv1d's own switches: refused when set to anything but 1."""
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
    for name in SSM_SWITCHES:  # upstream: `if value: assert value[0] == "1"` (unset follows torch's setting)
        value = env.get(name)
        if value and not str(value).startswith("1"):
            out.append((name, str(value), "must be unset or 1"))
    return out


def apply_env(env: MutableMapping[str, str]) -> List[Tuple[str, str, str]]:
    """Megatron-LM's ``apply_determinism_env`` on ``env`` (the rank's ``os.environ``): the problems, else the
    defaults filled in where ``env`` sets none (nothing is changed when there is a problem)."""
    problems = env_problems(dict(env))
    if not problems:
        for name, value in ENV_DEFAULTS.items():
            env.setdefault(name, value)
    return problems


def accepted_value(name: str) -> str:
    """The value to suggest for ``name`` in place of a refused one."""
    return ENV_DEFAULTS.get(name) or (ACCEPTED.get(name) or ("1",))[0]


def env_for(env: Dict[str, str]) -> Dict[str, str]:
    """``env`` with the deterministic defaults filled in where it sets none (a value it sets, once accepted, wins)."""
    return {**ENV_DEFAULTS, **env}
