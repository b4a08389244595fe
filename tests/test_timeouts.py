"""Timeouts derived from the job (launcher/core/timeouts.py): the process-group (collective) timeout and NCCL's
heartbeat come from the planned step and save times, are printed by action=plan, rendered into env.sh and
meta.json, read by the ranks, and overridden by their fields; impossible overrides are refused in one line."""
from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from launcher.config import compose_job
from launcher.core import timeouts

CATALOGUE = ["llama3_70b", "llama405b", "qwen3_30b_a3b"]
LINE = re.compile(r"timeouts: hang (\d+) s \(5 steps (\d+) s, a save (\d+) s\), collective (\d+) s \(first step "
                  r"(\d+) s\), heartbeat (\d+) s")


def _numbers(match) -> dict:
    return dict(zip(("hang", "steps5", "save", "collective", "first", "heartbeat"), map(int, match.groups())))


def _env(bundle: Path) -> dict:
    return dict(re.findall(r"^export (\w+)=(.*)$", (bundle / "env.sh").read_text(), re.M))


def _render(cli, tmp_path, *args) -> Path:
    code, out, err = cli(*args, "action=render", f"output_dir={tmp_path}")
    assert code == 0, err or out
    return next(tmp_path.glob("*/env.sh")).parent


@pytest.mark.parametrize("recipe", CATALOGUE)
def test_plan_prints_the_timeouts_render_writes(cli, tmp_path, recipe):
    code, out, err = cli(f"recipe={recipe}", "cluster=h100", "action=plan")
    assert code == 0, err
    printed = LINE.search(out)
    assert printed, out[-1500:]
    n = _numbers(printed)
    collective, heartbeat = n["collective"], n["heartbeat"]
    assert n["hang"] == max(timeouts.HANG_FLOOR_S, n["steps5"], n["save"])
    assert collective == max(n["first"], n["hang"] + timeouts.HANG_LEAD_S)
    assert heartbeat == collective + timeouts.HEARTBEAT_GRACE_S
    bundle = _render(cli, tmp_path, f"recipe={recipe}", "cluster=h100")
    env = _env(bundle)
    assert env[timeouts.ENV] == str(collective) and env[timeouts.HEARTBEAT_ENV] == str(heartbeat)
    assert env[timeouts.HANG_ENV] == str(n["hang"])
    assert env["TORCH_NCCL_DUMP_ON_TIMEOUT"] == "1" and int(env["TORCH_NCCL_TRACE_BUFFER_SIZE"]) > 0
    assert env["TORCH_FR_DUMP_TEMP_FILE"] == f"{bundle}/flight-recorder/rank-"
    meta = json.loads((bundle / "meta.json").read_text())["timeouts"]
    assert meta["collective_s"] == collective and meta["collective_source"] == "derived"
    assert meta["step_s"] > 0 and meta["save_s"] > 0  # from the plan, not the no-plan floor


def test_a_longer_planned_step_gives_longer_timeouts(cli, tmp_path):
    """Slower GPUs (a fiftieth of the profile's peak) make every step much longer: the first step's allowance
    (ten steps + the load) and with it the collective timeout grow past the 10-minute floor."""
    base = compose_job(["recipe=llama3_70b", "cluster=h100"])
    slow = [f"cluster.peak_tflops_bf16={base.cluster.peak_tflops_bf16 / 50:g}",
            f"cluster.peak_tflops_fp8={base.cluster.peak_tflops_fp8 / 50:g}"]
    outs = []
    for extra in ([], slow):
        code, out, err = cli("recipe=llama3_70b", "cluster=h100", *extra, "action=plan")
        assert code == 0, err
        outs.append(LINE.search(out))
    fast, slowed = (_numbers(m) for m in outs)
    assert slowed["steps5"] > 5 * fast["steps5"]  # the step got much longer
    assert slowed["collective"] > fast["collective"] == timeouts.FIRST_STEP_FLOOR_S
    assert slowed["hang"] > fast["hang"]
    bundle = _render(cli, tmp_path, "recipe=llama3_70b", "cluster=h100", *slow)
    assert _env(bundle)[timeouts.ENV] == str(slowed["collective"])
    assert _env(bundle)[timeouts.HANG_ENV] == str(slowed["hang"])


def test_an_override_wins_and_reaches_the_bundle(cli, tmp_path):
    bundle = _render(cli, tmp_path, "recipe=llama3_70b", "cluster=h100", "timeouts.collective_s=1234")
    env = _env(bundle)
    assert env[timeouts.ENV] == "1234" and env[timeouts.HEARTBEAT_ENV] == str(1234 + timeouts.HEARTBEAT_GRACE_S)
    meta = json.loads((bundle / "meta.json").read_text())["timeouts"]
    assert meta["collective_source"] == "timeouts.collective_s (explicit)"
    bundle2 = _render(cli, tmp_path / "b", "recipe=llama3_70b", "cluster=h100", "timeouts.heartbeat_s=5000")
    assert _env(bundle2)[timeouts.HEARTBEAT_ENV] == "5000"


def test_a_cpu_bundle_sets_the_timeout_and_the_flight_recorder_but_no_nccl_variables(cli, tmp_path):
    env = _env(_render(cli, tmp_path))  # the embedded default: cluster=local, gloo
    assert env[timeouts.ENV] == str(timeouts.FIRST_STEP_FLOOR_S)
    assert env["TORCH_FR_BUFFER_SIZE"] == str(timeouts.TRACE_BUFFER)  # gloo's collectives are recorded too
    assert not any(k.startswith("TORCH_NCCL") or k.startswith("TORCH_FR_DUMP") for k in env)


def test_cluster_env_wins_over_the_flight_recorder_defaults(cli, tmp_path):
    env = _env(_render(cli, tmp_path, "recipe=llama3_70b", "cluster=h100", "+cluster.env.TORCH_NCCL_TRACE_BUFFER_SIZE=50",
                       "+cluster.env.TORCH_FR_BUFFER_SIZE=60"))
    assert env["TORCH_NCCL_TRACE_BUFFER_SIZE"] == "50" and env["TORCH_FR_BUFFER_SIZE"] == "60"


@pytest.mark.parametrize("args,field,hint", [
    (["timeouts.collective_s=5"], "timeouts.collective_s=5", "timeouts.collective_s=600"),
    (["timeouts.collective_s=900", "timeouts.heartbeat_s=800"], "timeouts.heartbeat_s=800",
     "timeouts.heartbeat_s=1020"),
    (["timeouts.heartbeat_s=600"], "timeouts.heartbeat_s=600", "timeouts.heartbeat_s=720"),
    (["timeouts.collective_s=600", "timeouts.hang_s=700"], "timeouts.hang_s=700", "timeouts.hang_s=540"),
    (["timeouts.collective_s=200"], "timeouts.hang_s=259", "timeouts.hang_s=140"),
    (["timeouts.hang_s=30"], "timeouts.hang_s=30", "timeouts.hang_s=120"),
])
def test_an_impossible_override_is_refused_in_one_line_before_anything_is_rendered(cli, tmp_path, args, field, hint):
    for action in ("validate", "render"):
        code, out, err = cli("recipe=llama3_70b", "cluster=h100", *args, f"action={action}", f"output_dir={tmp_path}")
        lines = [line for line in (err + out).splitlines() if line.startswith("error:")]
        assert code == 2 and len(lines) == 1 and lines[0].startswith(f"error: {field}:"), (action, err, out)
        assert lines[0].endswith(f"try {hint}")
        assert "Traceback" not in err
    assert not list(tmp_path.iterdir())
    fixed = [a for a in args if not a.startswith(field.split("=")[0])] + [hint]  # the alternative replaces the field
    code, out, err = cli("recipe=llama3_70b", "cluster=h100", *fixed, "action=validate")
    assert code == 0, err  # the alternative the line names works


def test_an_override_shorter_than_the_first_step_is_a_warning(cli):
    code, out, err = cli("recipe=llama3_70b", "cluster=h100", "timeouts.collective_s=400", "action=validate")
    assert code == 0
    assert "warning: timeouts.collective_s=400: is shorter than the first step's allowance" in err + out


def test_the_ranks_read_the_rendered_timeout(monkeypatch):
    from launcher.rank import setup

    monkeypatch.setenv(timeouts.ENV, "1234")
    assert setup.collective_timeout_s() == 1234
    for bad in ("", "0", "-5", "ten"):
        monkeypatch.setenv(timeouts.ENV, bad)
        assert setup.collective_timeout_s() == timeouts.DEFAULT_COLLECTIVE_S
