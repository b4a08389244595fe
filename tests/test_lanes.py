"""The lane marks tests/conftest.py gives from what a test does (`make test-fast` must never train): the static
reading of a test's source and the runtime guard on the processes it starts agree on what starts ranks."""
from __future__ import annotations

from pathlib import Path

from conftest import ROOT, _lane_needed, _ModuleSpawns, _spawns_ranks


def test_running_a_bundles_launch_script_starts_ranks_and_naming_the_file_does_not():
    # launch.sh runs the bundle's torchrun (launcher.rank.agent) and its ranks
    assert _spawns_ranks('proc = subprocess.Popen(["bash", str(bundle / "launch.sh")], cwd=ROOT)')
    assert _lane_needed(["bash", "/tmp/run/launch.sh"]) == "multirank"
    assert _lane_needed(["/bin/bash", str(Path("/x") / "launch.sh")]) == "multirank"
    # reading or rendering it, or bash for something else, starts nothing
    assert not _spawns_ranks('for name in ("job.sbatch", "launch.sh", "env.sh"):')
    assert not _spawns_ranks('assert "launch.sh" in texts["job.sbatch"]')
    assert _lane_needed(["bash", "-c", "echo launch.sh"]) is None
    assert _lane_needed(["cat", "/tmp/run/launch.sh"]) is None
    # `bash -n` only parses it (test_recipes' syntax check of every recipe's bundle); `bash -x` runs it
    assert _lane_needed(["bash", "-n", "/tmp/run/launch.sh"]) is None
    assert _lane_needed(["bash", "-xn", "/tmp/run/launch.sh"]) is None
    assert _lane_needed(["bash", "-x", "/tmp/run/launch.sh"]) == "multirank"
    # the others, as before
    assert _spawns_ranks('[sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=2"]')
    assert _lane_needed([Path("/usr/bin/python"), "-m", "launcher", "action=run"]) == "multirank"


def test_the_truncated_data_run_is_in_the_multirank_lane():
    """It runs `bash <bundle>/launch.sh` (one rank behind torchrun's agent): it was in `make test-fast`."""
    spawns = _ModuleSpawns(ROOT / "tests" / "test_no_progress.py").spawns
    assert "test_a_data_file_truncated_after_render_is_not_retried" in spawns
    assert "test_verdict_after_a_crash_at_the_same_step_without_a_new_checkpoint" not in spawns


def test_the_stopped_rank_hang_run_is_in_the_multirank_lane():
    """Its fixture runs launch.sh through _rank_harness.run_with_a_stopped_rank: CI's runtime guard caught it."""
    spawns = _ModuleSpawns(ROOT / "tests" / "test_hang_forensics.py").spawns
    assert {"hung_run", "test_a_stopped_rank_is_named_and_the_run_stops"} <= spawns
    assert "test_watchdog_is_not_armed_before_the_first_step" not in spawns
