"""The Slurm time limit in seconds: what validation checks the stop arithmetic against and what the signal lead
(``launcher/core/signal_lead.py``) is derived for. Torch-free, standard library only."""
from __future__ import annotations

import re


def slurm_seconds(text: str) -> int | None:
    """``[D-]HH:MM:SS`` (the form ``slurm.time`` accepts) in seconds; None for any other text."""
    m = re.fullmatch(r"(?:(\d+)-)?(\d{1,2}):(\d{2}):(\d{2})", str(text))
    if not m:
        return None
    days, h, mi, s = (int(g or 0) for g in m.groups())
    return ((days * 24 + h) * 60 + mi) * 60 + s


def time_limit_s(job) -> int:
    """The job's ``slurm.time`` in seconds, 0 when it is not a time Slurm reads (validation refuses that)."""
    return slurm_seconds(job.slurm.time) or 0
