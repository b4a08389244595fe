"""PyTorch's Flight Recorder (FR) in the hang evidence: each live rank's trace, and who it says hangs the others.

The Flight Recorder keeps, per rank, its last ``TORCH_FR_BUFFER_SIZE`` collectives (env.sh sets it on every bundle:
launcher/core/timeouts.py ``fr_env``), gloo's included: each entry names its process group, its
``collective_seq_id`` in that group, the op (``profiling_name``, e.g. ``gloo:all_reduce``) and whether its work
retired. On NCCL a timed-out collective makes every rank dump it itself (``TORCH_NCCL_DUMP_ON_TIMEOUT``); on gloo
nothing dumps it, so the rank does on the hang watchdog's stack request (launcher/rank/forensics.py: the same
SIGUSR2), into ``BUNDLE/forensics/fr/rank_N``, and the watchdog copies the fresh ones into ``BUNDLE/hang-STEP/fr/``.
A rank that is stopped leaves none: that absence is evidence too.

The analysis: torch's own (``torch.distributed.flight_recorder.components.builder.build_db``, what
``python -m torch.distributed.flight_recorder.fr_trace DIR --allow-incomplete-ranks`` runs) names a rank that has a
trace but is missing from a collective the others entered ("Not all ranks joining collective"); it cannot name a
rank that left no trace (utils.py ``error_analysis`` reports missing ranks only where they are among the dumps).
So the culprit comes from the present traces first: the collective most ranks are in (work not retired) and the
member of its group that either left no trace (and was asked for one) or whose last collective in that group is
older; torch's analysis, where it runs, confirms the second kind, and the line says which source named the rank.
"""
from __future__ import annotations

import os
import pickle
from collections import Counter
from pathlib import Path
from typing import Iterable, Optional

DIR = "fr"
PREFIX = "rank_"
"""Trace files are ``<DIR>/rank_<global rank>``: fr_trace infers that prefix (components/loader.py)."""


def trace_bytes() -> bytes:
    """This rank's Flight Recorder trace, pickled as torch dumps it, with its process groups' members filled in
    (gloo registers none: the dump's ``pg_config`` holds ``ranks: '[]'``, and fr_trace matches by members)."""
    import torch
    import torch.distributed as dist

    c10d = torch._C._distributed_c10d
    # (includeCollectives, includeStackTraces, onlyActive): torch/csrc/distributed/c10d/init.cpp `_dump_fr_trace`
    nccl = dist.is_initialized() and dist.get_backend() == "nccl" and hasattr(c10d, "_dump_nccl_trace")
    data = pickle.loads((c10d._dump_nccl_trace if nccl else c10d._dump_fr_trace)(True, True, False))
    if dist.is_initialized():
        config = {}
        world = dist.distributed_c10d._world
        for group, name in list(world.pg_names.items()):
            try:
                ranks = dist.get_process_group_ranks(group)
            except Exception:  # noqa: BLE001 - a group being torn down: left out
                continue
            config[name] = {"name": name, "desc": getattr(group, "group_desc", "undefined"), "ranks": str(ranks)}
        # gloo's entry is a nameless one (its default group's members, or '[]' once there are more groups)
        data["pg_config"] = {**{k: v for k, v in (data.get("pg_config") or {}).items() if k}, **config}
    return pickle.dumps(data)


def dump(directory: Path, rank: int) -> Path:
    """Write this rank's trace to ``directory/rank_N``, whole (tmp, then rename)."""
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    path = directory / f"{PREFIX}{rank}"
    tmp = directory / f".{PREFIX}{rank}.tmp"
    tmp.write_bytes(trace_bytes())
    os.replace(tmp, path)
    return path


def read(directory: Path) -> dict:
    """{rank: dump} of every readable ``rank_N`` in ``directory``."""
    out = {}
    for path in sorted(Path(directory).glob(f"{PREFIX}*")):
        tail = path.name[len(PREFIX):]
        if tail.isdigit():
            try:
                out[int(tail)] = pickle.loads(path.read_bytes())
            except Exception:  # noqa: BLE001 - a torn or foreign file is no evidence
                continue
    return out


def _members(dumps: dict) -> dict:
    """{pg name: sorted member ranks}, from every dump's pg_config."""
    out = {}
    for d in dumps.values():
        for name, cfg in (d.get("pg_config") or {}).items():
            try:
                ranks = [int(r) for r in str(cfg.get("ranks", "[]")).strip("[]").split(",") if r.strip()]
            except ValueError:
                continue
            if ranks:
                out[str(name)] = sorted(ranks)
    return out


def _pending(dump: dict) -> Optional[tuple]:
    """(pg name, collective seq, op) where the rank's last entry is a collective whose work has not retired, else
    None (a p2p wait, compute, or nothing recorded). Gloo never moves ``state`` past 'scheduled', so not ``retired``
    is what says "still in it" (torch/csrc/distributed/c10d/FlightRecorder.hpp ``retire_id``: work that finished)."""
    entries = dump.get("entries") or []
    e = entries[-1] if entries else None
    if e is None or e.get("retired") or e.get("is_p2p"):
        return None
    return str(e["process_group"][0]), int(e["collective_seq_id"]), str(e["profiling_name"])


def _last_seq(dump: dict, pg: str) -> int:
    return max((int(e["collective_seq_id"]) for e in dump.get("entries") or []
                if str(e["process_group"][0]) == pg and not e.get("is_p2p")), default=0)


def op_name(profiling_name: str) -> str:
    """'gloo:all_reduce' -> 'all_reduce' (components/types.py ``Op``: backend, then the op)."""
    return profiling_name.split(":", 1)[-1].split(" ")[0]


def analyse(dumps: dict, asked: Iterable[int]) -> Optional[dict]:
    """Who hangs the others, from the traces present. ``asked``: the ranks asked for one that did not answer (a
    member not asked, e.g. on another node, is not blamed for having none). First, a collective that traced ranks
    are in whose group holds a rank that left no trace (most waiters first); else the collective most traced ranks
    are in and a member whose last collective in that group is older (it never entered), followed into the
    collective it is inside itself, until one that is in none. None where no member is to blame (all inside, a
    cycle, or only p2p waits)."""
    asked, members = set(asked), _members(dumps)
    inside = Counter(p for p in (_pending(d) for d in dumps.values()) if p is not None)

    def found(rank: int, here: tuple) -> dict:
        return {"rank": rank, "trace": rank in dumps, "pg": here[0], "seq": here[1], "op": op_name(here[2]),
                "group": members.get(here[0], []), "waiting": inside[here], "traced": sorted(dumps)}

    for here, _ in inside.most_common():
        absent = [m for m in members.get(here[0], []) if m not in dumps and m in asked]
        if absent:
            return found(absent[0], here)
    for start, _ in inside.most_common():
        here, seen, last = start, set(), None
        while here is not None:
            behind = [m for m in members.get(here[0], []) if m in dumps and _last_seq(dumps[m], here[0]) < here[1]]
            if not behind:
                break
            rank = behind[0]
            if rank in seen:  # back to a rank of the chain: collectives called in different orders, no one culprit
                return None
            seen.add(rank)
            last = found(rank, here)
            here = _pending(dumps[rank])
        if last is not None:
            return last
    return None


def torch_missing(directory: Path) -> Optional[list]:
    """[(op, seq, group ranks, missing ranks)] that torch's own analysis reports (``build_db`` with incomplete
    ranks allowed, as ``fr_trace --allow-incomplete-ranks``), or None where it does not run on these traces."""
    import argparse
    import logging

    try:
        from torch.distributed.flight_recorder.components.fr_logger import FlightRecorderLogger

        log = FlightRecorderLogger().logger  # it prints every finding (and a missing tabulate) to stderr: the one
        level = log.level                    # line says it instead
        log.setLevel(logging.CRITICAL + 1)
        try:
            from torch.distributed.flight_recorder.components.builder import build_db

            details = {f"{PREFIX}{r}": {"host_name": f"host_rank{r}", "rank": r, "entries": d.get("entries") or [],
                                       "version": d.get("version"), "pg_config": d.get("pg_config") or {}}
                       for r, d in read(directory).items()}
            if not details:
                return None
            version = str(next(iter(details.values()))["version"])
            args = argparse.Namespace(verbose=False, just_print_entries=False, allow_incomplete_ranks=True,
                                      mismatch_cap=10, selected_ranks=None, pg_filters=None, print_stack_trace=False)
            db = build_db(details, args, version)
        finally:
            log.setLevel(level)
    except Exception:  # noqa: BLE001 - torch's analysis is a second opinion; the traces stand without it
        return None
    return [(op_name(c.collective_name), int(c.collective_seq_id), sorted(c.expected_ranks),
             sorted(c.missing_ranks)) for c in db.collectives if c.missing_ranks]
