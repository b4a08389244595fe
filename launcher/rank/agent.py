"""``python -m launcher.rank.agent [torchrun arguments]``: torchrun, with an operator's exit instead of a traceback.

The same agent as ``python -m torch.distributed.run`` (its argument parser and ``run``), except how it ends:

- a rank failed (after ``--max-restarts``): one line naming the first failed rank and its exit, exit 1 (torchrun
  prints a ``ChildFailedError`` traceback and its failure table; each rank has already printed its own one-line
  error and written its traceback to ``logs/rank-N.log``);
- a death signal (Ctrl-C's SIGINT, SIGTERM from ``scancel`` or preemption, SIGHUP): torchrun forwards it to the
  ranks, which finish the step in flight, checkpoint and exit (``launcher.rank.signals``), and waits for them
  (``TORCH_ELASTIC_SHUTDOWN_TIMEOUT`` from launch.sh: the signal lead, ``launcher.core.signal_lead.shutdown_timeout_s``;
  not torchrun's 30 s, which killed ranks in the middle of their stop checkpoint); then exit 128 + the signal's
  number (130 for Ctrl-C, 143 for SIGTERM), as a shell
  does, with no traceback.
"""
from __future__ import annotations

import os
import signal
import sys

SHUTDOWN_ENV = "TORCH_ELASTIC_SHUTDOWN_TIMEOUT"


def main(argv=None) -> int:
    try:  # torchrun installs its signal handlers only once it starts the ranks, seconds from now
        from torch.distributed.elastic.multiprocessing.api import SignalException
        from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
        from torch.distributed.run import parse_args, run

        args = parse_args(sys.argv[1:] if argv is None else argv)
        shutdown_timeout_for_older_torch(args)
    except KeyboardInterrupt:  # Ctrl-C while importing torch: nothing to stop yet
        print("torchrun: SIGINT received while starting; no rank was started", file=sys.stderr, flush=True)
        return 128 + signal.SIGINT
    watchdog = start_watchdog()
    try:
        run(args)
    except ChildFailedError as exc:
        if watchdog is not None and watchdog.line:  # the ranks were stopped for a hang: that is the first cause
            print(f"torchrun: ranks stopped by the hang watchdog: {watchdog.line}", file=sys.stderr, flush=True)
            return 1
        print(f"torchrun: {first_failure(exc)}", file=sys.stderr, flush=True)
        return 1
    except SignalException as exc:
        print(f"torchrun: {signal.Signals(exc.sigval).name} received; the ranks were asked to checkpoint and stop",
              file=sys.stderr, flush=True)
        return 128 + int(exc.sigval)
    except KeyboardInterrupt:
        return 128 + signal.SIGINT
    return 0


def start_watchdog():
    """The node's hang watchdog (launcher/rank/watchdog.py) when env.sh set its threshold (timeouts.hang_s) and the
    bundle; on a hang: the line on stderr and in BUNDLE/FAILED (unless a rank wrote one first), the local ranks
    killed. None when not configured."""
    from launcher.core.timeouts import HANG_ENV

    raw, bundle = os.environ.get(HANG_ENV, "").strip(), os.environ.get("LAUNCHER_BUNDLE", "").strip()
    if not raw.isdigit() or int(raw) <= 0 or not bundle:
        return None
    from pathlib import Path

    from launcher.rank import watchdog

    def on_hang(line: str) -> None:
        print(f"hang watchdog: {line}", file=sys.stderr, flush=True)
        import tempfile

        fd, tmp = tempfile.mkstemp(prefix=".FAILED.", dir=bundle)
        with os.fdopen(fd, "w") as f:
            f.write(line + "\n")
        try:
            os.link(tmp, Path(bundle) / "FAILED")  # whole, and only where no rank or node wrote one first
        except FileExistsError:
            pass
        finally:
            os.unlink(tmp)
        watchdog.record_culprit_node(Path(bundle), dog.culprit)  # slurm.on_hang=exclude leaves it out next time
        watchdog.kill_local(watchdog.read_states(Path(bundle)), dog.host)

    dog = watchdog.Watchdog(Path(bundle), int(raw), on_hang)
    dog.start()
    return dog


def shutdown_timeout_for_older_torch(args) -> None:
    """A torch with ``--shutdown-timeout`` (pytorch PR #172596, 2026) reads ``TORCH_ELASTIC_SHUTDOWN_TIMEOUT`` itself
    (``LaunchConfig.shutdown_timeout``). Older ones (the NGC 25.09 image's 2.9) wait a fixed 30 s: its signal path calls
    ``PContext.close(death_sig)`` with the default ``timeout=30`` (torch/distributed/elastic/multiprocessing/api.py),
    so the default is what this sets there."""
    raw = os.environ.get(SHUTDOWN_ENV, "").strip()
    if hasattr(args, "shutdown_timeout") or not raw.isdigit():
        return
    from torch.distributed.elastic.multiprocessing.api import PContext

    death_sig, _ = PContext.close.__defaults__
    PContext.close.__defaults__ = (death_sig, int(raw))


def first_failure(exc) -> str:
    """'rank 1 (local rank 1, pid 123) exited with 1 first; ...' from torchrun's ChildFailedError."""
    try:
        rank, failure = exc.get_first_failure()
    except Exception:  # noqa: BLE001 - the summary is a courtesy; never fail on it
        return f"{exc.name} failed"
    code = failure.exitcode
    how = (f"was killed by {signal.Signals(-code).name}" if isinstance(code, int) and code < 0
           and -code in signal.Signals._value2member_map_ else f"exited with {code}")
    return (f"rank {rank} (local rank {failure.local_rank}, pid {failure.pid}) {how} first; every rank's traceback "
            "is in its logs/rank-N.log")


if __name__ == "__main__":
    sys.exit(main())
