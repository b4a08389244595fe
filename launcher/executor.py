"""Executors with one shape (after submitit): given a rendered bundle, start it and say how to follow it.

SlurmExecutor submits job.sbatch with ``sbatch --parsable`` and parses the job id; LocalExecutor runs the
same launch.sh on this machine and tees its output into the bundle's logs. Login-node code: no torch.
"""
from __future__ import annotations

import json
import subprocess
import sys
from dataclasses import dataclass

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
    """Run a bundle's launch.sh here, streaming its output to the terminal and logs/local.log."""

    def run(self, bundle: Bundle) -> int:
        log_path = bundle.path / "logs" / "local.log"
        with open(log_path, "ab") as log:
            proc = subprocess.Popen(["bash", str(bundle.launch)], stdout=subprocess.PIPE,
                                    stderr=subprocess.STDOUT)
            assert proc.stdout is not None
            for chunk in iter(lambda: proc.stdout.readline(), b""):
                sys.stdout.buffer.write(chunk)
                sys.stdout.flush()
                log.write(chunk)
            return proc.wait()
