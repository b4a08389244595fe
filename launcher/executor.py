"""Executors with one shape (after submitit): given a rendered bundle, start it and say how to follow it.

SlurmExecutor submits job.sbatch with ``sbatch --parsable`` and parses the job id; LocalExecutor runs the
same launch.sh on this machine and tees its output into the bundle's logs. Login-node code: no torch.
"""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from launcher.render import Bundle, atomic_write


class SubmitError(Exception):
    """sbatch refused the job or is not installed."""


def parse_job_id(output: str) -> str:
    """``sbatch --parsable`` prints ``<id>`` or ``<id>;<cluster>``; older sbatch prints a sentence."""
    text = output.strip().splitlines()[-1] if output.strip() else ""
    token = text.split(";")[0].split()[-1] if text else ""
    if not token.isdigit():
        raise SubmitError(f"could not parse a job id from sbatch output: {output.strip()!r}")
    return token


@dataclass
class SlurmExecutor:
    """Submit bundles with sbatch. The submitting environment (and its secrets) is exported by sbatch."""

    sbatch: str = "sbatch"

    def submit(self, bundle: Bundle) -> str:
        try:
            proc = subprocess.run([self.sbatch, "--parsable", str(bundle.sbatch)], capture_output=True,
                                  text=True, timeout=120)
        except FileNotFoundError:
            raise SubmitError(f"{self.sbatch} not found: run on a Slurm login node, or use action=render") from None
        if proc.returncode != 0:
            raise SubmitError(f"sbatch failed ({proc.returncode}): {' '.join(proc.stderr.split())}")
        job_id = parse_job_id(proc.stdout)
        atomic_write(bundle.path / "submission.json", json.dumps({"job_id": job_id}, indent=2) + "\n")
        return job_id


@dataclass
class LocalExecutor:
    """Run a bundle's launch.sh here, streaming its output to the terminal and logs/local.log.

    Never hangs on orphans: launch.sh runs in its own session (process group); we wait for it to exit, then end
    whatever is left of its group by the group's id (e.g. a checkpoint-writer process that outlived a killed
    rank and still holds the output pipe), and drain the pipe for at most ``drain_s`` seconds."""

    drain_s: float = 5.0
    grace_s: float = 5.0

    def run(self, bundle: Bundle, script: str = "launch.sh", log_name: str = "local.log") -> int:
        """Run the bundle's ``script`` (launch.sh: training; post.sh: the post steps) into ``logs/<log_name>``."""
        import threading

        log_path = bundle.path / "logs" / log_name
        with open(log_path, "ab") as log:
            proc = subprocess.Popen(["bash", str(bundle.path / script)], stdout=subprocess.PIPE,
                                    stderr=subprocess.STDOUT, start_new_session=True)
            assert proc.stdout is not None
            pump = threading.Thread(target=_pump, args=(proc.stdout, log), daemon=True)
            pump.start()
            try:
                code = proc.wait()
            except KeyboardInterrupt:  # Ctrl-C: the ranks checkpoint at the next step boundary, then exit 130
                print("launcher: Ctrl-C: training checkpoints at the next step boundary and stops (Ctrl-C again to "
                      "end it now)", flush=True)
                _signal_group(proc.pid, signal.SIGINT)
                try:
                    code = _wait(proc, self.grace_s * 12)  # torchrun gives its ranks 30 s
                except KeyboardInterrupt:
                    code = None
                code = 130 if code is None else code
            finally:
                end_group(proc.pid, grace_s=self.grace_s)
                end_strays(bundle.path, grace_s=self.grace_s)
                pump.join(self.drain_s)
            if code is None:
                code = proc.wait()
            return code


def _pump(stream, log) -> None:
    """Copy the child's output to our stdout and the log until EOF (or until the pipe breaks)."""
    try:
        for chunk in iter(lambda: stream.read1(65536), b""):
            sys.stdout.buffer.write(chunk)
            sys.stdout.flush()
            log.write(chunk)
            log.flush()
    except (OSError, ValueError):
        pass


def _wait(proc: subprocess.Popen, timeout: float):
    try:
        return proc.wait(timeout)
    except subprocess.TimeoutExpired:
        return None


def _send(send, target: int, sig) -> bool:
    """send(target, sig) (os.kill or os.killpg); False once the target is gone or not ours."""
    try:
        send(target, sig)
        return True
    except (ProcessLookupError, PermissionError):
        return False


def _signal_group(pgid: int, sig) -> bool:
    return _send(os.killpg, pgid, sig)


def _terminate(targets, send, grace_s: float) -> None:
    """SIGTERM every target, then SIGKILL those still there after grace_s."""
    alive = [t for t in targets if _send(send, t, signal.SIGTERM)]
    deadline = time.monotonic() + grace_s
    while alive and time.monotonic() < deadline:
        time.sleep(0.1)
        alive = [t for t in alive if _send(send, t, 0)]
    for t in alive:
        _send(send, t, signal.SIGKILL)


def end_group(pgid: int, grace_s: float = 5.0) -> None:
    """SIGTERM the process group ``pgid`` (one we created), then SIGKILL what is still there after grace_s."""
    _terminate([pgid], os.killpg, grace_s)


def bundle_processes(bundle_path) -> list:
    """PIDs of this user's processes started for the bundle (launch.sh exports LAUNCHER_BUNDLE to everything it
    starts), other than this process and its ancestors. torchrun gives each rank its own session, so a helper of a
    killed rank (Megatron's checkpoint writer) is outside launch.sh's group and would live on, holding memory."""
    mark = f"LAUNCHER_BUNDLE={bundle_path}".encode() + b"\0"
    skip, pid = set(), os.getpid()
    while pid > 1:  # ourselves and our ancestors
        skip.add(pid)
        try:
            pid = int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[1])
        except (OSError, ValueError, IndexError):
            break
    out = []
    for entry in Path("/proc").iterdir() if Path("/proc").is_dir() else ():
        if entry.name.isdigit() and int(entry.name) not in skip:
            try:
                if mark in (entry / "environ").read_bytes():
                    out.append(int(entry.name))
            except OSError:  # gone, or not ours
                pass
    return out


def end_strays(bundle_path, grace_s: float = 5.0) -> None:
    """SIGTERM every process left over for the bundle (bundle_processes), then SIGKILL what remains after grace_s."""
    _terminate(bundle_processes(bundle_path), os.kill, grace_s)
