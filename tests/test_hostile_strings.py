"""Every string that reaches a shell script is quoted; secrets never reach the bundle.

The rendered scripts are executed for real (with stand-ins for srun/scontrol/python on PATH) and must pass
hostile values through literally, without running any of them.
"""
from __future__ import annotations

import os
import shlex
import subprocess
from pathlib import Path

import pytest

from launcher.config import compose_job
from launcher.render import render_texts, write_bundle

HOSTILE = [
    "$(touch {sentinel})",
    "`touch {sentinel}`",
    "a; touch {sentinel}",
    "line1\ntouch {sentinel}",
    "it's \"quoted\" $HOME \\ & | > <",
    "${{IFS}}touch${{IFS}}{sentinel}",
]


def _hostile_job(tmp_path: Path, value: str):
    job = compose_job(["recipe=llama3_8b"])
    job.cluster.env = {"HOSTILE": value, "NCCL_DEBUG": "INFO"}
    job.cluster.container_image = value
    job.cluster.container_mounts = ["/lustre:/lustre", f"/x:{value}"]
    job.cluster.workdir = str(tmp_path / f"work dir {value.splitlines()[0][:20]}")
    job.cluster.python = value
    return job


def _stub(bin_dir: Path, name: str, body: str) -> None:
    path = bin_dir / name
    path.write_text("#!/bin/bash\n" + body)
    path.chmod(0o755)


@pytest.mark.parametrize("template", HOSTILE)
def test_hostile_values_pass_through_literally(template, tmp_path):
    sentinel = tmp_path / "PWNED"
    value = template.format(sentinel=sentinel)
    job = _hostile_job(tmp_path, value)
    bundle = tmp_path / "bundle"
    bundle.mkdir()
    texts = render_texts(job, bundle)
    for name, text in texts.items():
        (bundle / name).write_text(text)
    Path(job.cluster.workdir).mkdir(parents=True)

    # env.sh: sourcing it sets HOSTILE to exactly the value.
    got = subprocess.run(["bash", "-c", f"source {shlex.quote(str(bundle / 'env.sh'))}; printf %s \"$HOSTILE\""],
                         capture_output=True, text=True)
    assert got.returncode == 0, got.stderr
    assert got.stdout == value

    # job.sbatch + launch.sh, run with stand-ins: srun records its argv, then runs the command it was given.
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    argv_log = tmp_path / "srun.argv"
    _stub(bin_dir, "scontrol", "echo node0\n")
    # the job's end time (squeue -o %e): unknown here. Without this stand-in a machine with Slurm's client
    # installed but no slurmctld running waits ~18 s per case for squeue to give up (issue 25)
    _stub(bin_dir, "squeue", "exit 1\n")
    _stub(bin_dir, "srun", f'printf "%s\\0" "$@" > {shlex.quote(str(argv_log))}\n'
                           'while [[ "$1" == --* ]]; do shift; done\n"$@"\n')
    env = {**os.environ, "PATH": f"{bin_dir}:{os.environ['PATH']}", "SLURM_JOB_ID": "42",
           "SLURM_JOB_NODELIST": "node0"}
    run = subprocess.run(["bash", str(bundle / "job.sbatch")], capture_output=True, text=True, env=env, timeout=60)
    # launch.sh ends by exec'ing the (hostile, nonexistent) python: that fails, and that is all that happens.
    assert run.returncode != 0
    assert not sentinel.exists(), "a hostile value was executed"
    args = argv_log.read_bytes().split(b"\0")
    assert f"--container-image={value}".encode() in args
    assert f"--container-mounts=/lustre:/lustre,/x:{value}".encode() in args


def test_secret_values_never_reach_the_bundle(tmp_path, monkeypatch):
    secret = "wandb-secret-0123456789abcdef"
    monkeypatch.setenv("WANDB_API_KEY", secret)
    job = compose_job(["recipe=smoke", f"output_dir={tmp_path}", "logging.wandb_project=proj"])
    bundle = write_bundle(job, argv=["recipe=smoke"])
    for path in bundle.path.rglob("*"):
        if path.is_file():
            assert secret not in path.read_text()
    assert "WANDB_API_KEY" in (bundle.path / "env.sh").read_text()  # named, so users know it passes through


def test_bundle_is_never_overwritten_and_written_atomically(tmp_path, monkeypatch):
    job = compose_job(["recipe=smoke", f"output_dir={tmp_path}"])
    first = write_bundle(job, argv=[])
    second = write_bundle(job, argv=[])
    assert first.path != second.path and first.path.exists() and second.path.exists()

    def boom(*_a, **_k):
        raise OSError("disk full")
    monkeypatch.setattr(os, "rename", boom)
    with pytest.raises(OSError):
        write_bundle(job, argv=[])
    assert sorted(tmp_path.iterdir()) == sorted([first.path, second.path])  # no partial bundle, no temp dir
