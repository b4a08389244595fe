"""What a rank prints, and where: one clean console (rank 0), every rank's full output in the bundle.

``open_rank_log`` points this process's stdout and stderr (file descriptors 1 and 2, so C extensions, NCCL
and worker processes land there too) at ``<bundle>/logs/rank-N.log`` and keeps the original stdout as the
console. ``Console.line`` writes to the rank log and, on rank 0, to the console: step lines, evaluations,
checkpoints and the reason the run stopped. A failing rank prints one line to the console naming its log.

``quiet_known_warnings`` silences the upstream warnings that are harmless for this launcher, each with why.
"""
from __future__ import annotations

import datetime
import faulthandler
import logging
import os
import sys
import warnings
from pathlib import Path
from typing import Optional, TextIO

KNOWN_HARMLESS_WARNINGS = (
    # Megatron-Core probes for Transformer Engine / Apex kernels and falls back to its own: expected on CPU
    # and in the BF16 local-spec benchmark; a GPU job that plans TE fails loudly in models/backend.py instead.
    r".*Transformer Engine and Apex are not installed.*",
    r".*Apex is not installed.*",
    r".*transformer_engine.*not installed.*",
    # 0.19.2's TransformerConfig warns about its own default cuda_graph_scope even with CUDA graphs off.
    r".*full scope is deprecated.*",
    # Importing megatron.core.models imports the experimental MIMO model's config; we never build one.
    r".*MimoModelConfig is experimental.*",
    # torch's deprecation chatter from Megatron-Core internals (nothing a user can change).
    r".*torch\.distributed\._.*is deprecated.*",
    r".*TypedStorage is deprecated.*",
)
"""warnings.warn messages (regexes) silenced on every rank."""
KNOWN_HARMLESS_LOG_RECORDS = (
    # 0.19.2 marks GPTModel deprecated in favour of HybridModel; this product builds GPTModel on purpose
    # (models/builder.py is the one seam where a HybridModel path can be added).
    "GPTModel IS DEPRECATED",
    # 0.19.2's *synchronous* save goes through its deprecated async path and warns once per rank; we never
    # ask for async saving, so the warning only misleads.
    "async save is deprecated",
)
"""Substrings of Megatron-Core log records silenced on every rank."""


class _DropKnown(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        message = record.getMessage()
        return not any(text in message for text in KNOWN_HARMLESS_LOG_RECORDS)


def quiet_known_warnings() -> None:
    """Install the filters above (call before importing megatron: some warn at import time)."""
    for pattern in KNOWN_HARMLESS_WARNINGS:
        warnings.filterwarnings("ignore", message=pattern)
    drop = _DropKnown()
    logging.getLogger().addFilter(drop)
    for name in ("megatron", "megatron.core", "megatron.core.models.gpt.gpt_model",
                 "megatron.core.dist_checkpointing.strategies.torch"):
        logging.getLogger(name).addFilter(drop)
    # Handlers see records that propagated from child loggers, which logger-level filters do not.
    logging.basicConfig(level=logging.WARNING)
    for handler in logging.getLogger().handlers:
        handler.addFilter(drop)


class Console:
    """Lines for the person watching the run: rank 0 writes them to the console and its log."""

    def __init__(self, rank: int, console: Optional[TextIO] = None):
        self.rank, self.console = rank, console

    def line(self, text: str, *, all_ranks: bool = False) -> None:
        print(text, flush=True)  # the rank log (fd 1) after open_rank_log; the terminal before
        if self.console is not None and (self.rank == 0 or all_ranks):
            self.console.write(text + "\n")
            self.console.flush()

    def failure(self, exc: BaseException, log_path: Optional[Path]) -> None:
        where = f" (full traceback in {log_path})" if log_path else ""
        self.line(f"rank {self.rank} failed: {type(exc).__name__}: {exc}{where}", all_ranks=True)


def open_rank_log(bundle: Path, rank: int) -> tuple[Console, Path]:
    """Send fds 1 and 2 to <bundle>/logs/rank-N.log (appending: a requeued job keeps its history), and have a
    rank that dies of a fatal signal (SIGSEGV, SIGBUS, SIGFPE, SIGABRT, SIGILL: a native crash in a kernel, a
    collective or a library) leave every thread's Python stack there (``faulthandler``) instead of only torchrun's
    "exited with code -11"."""
    logs = Path(bundle) / "logs"
    logs.mkdir(parents=True, exist_ok=True)
    path = logs / f"rank-{rank}.log"
    sys.stdout.flush()
    sys.stderr.flush()
    console = os.fdopen(os.dup(1), "w", buffering=1)  # os.dup: not inherited by exec'd helper processes
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    os.close(fd)
    faulthandler.enable(file=sys.stderr, all_threads=True)  # fd 2: the rank log
    restart = os.environ.get("SLURM_RESTART_COUNT", "0")
    print(f"=== rank {rank} started {datetime.datetime.now(datetime.timezone.utc).isoformat(timespec='seconds')}"
          f" (restart {restart}, pid {os.getpid()})", flush=True)
    return Console(rank, console), path
