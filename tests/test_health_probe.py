"""Pre-flight link check: two torchrun agents on this machine form a 2-node job (c10d rendezvous), the probe
runs over gloo before training and reports both nodes; the verdict names a node far below the median."""
from __future__ import annotations

import os
import socket
import subprocess
import sys

from _rank_harness import ROOT, TINY, layout, rank_log_tails, write_bundle
from launcher.rank.health import report, verdict


def test_verdict_and_report_name_the_slow_node():
    assert verdict({"0:a": 10.0, "1:b": 10.5, "2:c": 2.0}, 0.5) == ["2:c"]
    assert verdict({"0:a": 10.0}, 0.5) == []
    every = [{"node": "0:a", "rank": 0, "intra": 9.0, "inter": 5.0}, {"node": "0:a", "rank": 1, "intra": 9.5, "inter": None},
             {"node": "1:b", "rank": 2, "intra": 9.0, "inter": 5.1}, {"node": "1:b", "rank": 3, "intra": 9.1, "inter": None},
             {"node": "2:c", "rank": 4, "intra": 1.0, "inter": 5.0}, {"node": "2:c", "rank": 5, "intra": 1.1, "inter": None}]
    lines = report(every, margin=0.5, size_mb=16)
    assert lines[0] == "health: node 0:a: intra-node all-reduce 9.00 GB/s, link to the next node 5.00 GB/s (16 MB)"
    assert lines[-1].startswith("warning: node 2:c intra-node bandwidth 1.00 GB/s is more than 50% below the median")
    assert len(lines) == 4


def test_two_node_job_on_one_machine_probes_before_training(tmp_path):
    bundle = write_bundle(tmp_path / "b", TINY + layout() + ["nodes=2", "train.train_steps=1",
                                                             "cluster.health_check=true"], 1)
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1", PYTHONWARNINGS="ignore")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nnodes=2", "--nproc-per-node=1", "--rdzv-backend=c10d",
           f"--rdzv-endpoint=127.0.0.1:{port}", "--rdzv-id=health", "-m", "launcher.rank", "--bundle", str(bundle)]
    procs = [subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
             for _ in range(2)]
    outs = [p.communicate(timeout=240)[0] for p in procs]
    # torchrun's output ends in its failure table; what failed is in the ranks' own logs (once red at load 40-60,
    # with only torchrun's output kept)
    logs = rank_log_tails(bundle)
    assert [p.returncode for p in procs] == [0, 0], "\n".join(o[-3000:] for o in outs) + logs
    out = "".join(outs)
    health = [line for line in out.splitlines() if line.startswith("health: node ")]
    assert len(health) == 2, out[-3000:]
    assert health[0].startswith("health: node 0:") and "link to the next node" in health[0], health
    assert health[1].startswith("health: node 1:"), health
    assert out.index("health: node 0:") < out.index("step     1")


def test_straggler_report_every_n_steps_in_a_real_run(tmp_path):
    from _rank_harness import run_train

    bundle = write_bundle(tmp_path / "s", TINY + layout(tp=2) + ["train.train_steps=4", "train.straggler_interval=2"], 2)
    proc = run_train(bundle, 2)
    assert proc.returncode == 0, proc.stdout[-3000:]
    lines = [line for line in proc.stdout.splitlines() if line.startswith("step ms per rank: ")]
    assert len(lines) == 2 and all(" 0:" in f" {line.split(': ', 1)[1]}" and " 1:" in line for line in lines), lines


def test_a_save_too_slow_for_the_slurm_signal_lead_is_flagged_and_the_ranks_stop_in_time(tmp_path, monkeypatch):
    """Under Slurm (job.sbatch exports the job's end time): the ranks stop by themselves, checkpointed, once
    less than 2 x the last save + a step + slurm.signal_margin_s is left, whatever the rendered lead."""
    import time

    from _rank_harness import run_train

    monkeypatch.setenv("SLURM_JOB_ID", "4242")  # as under Slurm; the lead below leaves no time to save
    monkeypatch.setenv("LAUNCHER_JOB_END", str(int(time.time()) + 400))  # the margin below says: stop now
    bundle = write_bundle(tmp_path / "s", TINY + layout() + ["train.train_steps=4", "checkpoint.save_at_end=true",
                                                            "slurm.signal_lead_s=30", "slurm.signal_margin_s=600"], 1)
    proc = run_train(bundle, 1)
    assert proc.returncode == 0, proc.stdout[-3000:]
    assert "slurm: the job ends at " in proc.stdout and " s estimated) + a step + 600 s is left" in proc.stdout
    assert " s to save; slurm.signal_lead_s=30 leaves less than 2 x that + a step + 600 s before the time limit " \
           "(training stops by itself " in proc.stdout, proc.stdout
    assert "s before it instead): submit with slurm.signal_lead_s=6" in proc.stdout, proc.stdout
    assert "stopped at step 1 of 4 (checkpointed; a requeued run resumes)" in proc.stdout, proc.stdout
    stopped = (bundle / "STOPPED").read_text()
    assert stopped.startswith("at step 1 of 4: the Slurm time limit is ") and "+ 600 s" in stopped, stopped
    assert (bundle / "checkpoints" / "iter_0000001" / "launcher.json").is_file()
    assert not (bundle / "DONE").exists()


def test_the_probe_leaves_no_process_group_behind(tmp_path):
    """Four ranks as two nodes of two: the probe's node groups and its leaders' group (NCCL communicators on a GPU,
    holding memory and connections) are destroyed once it has measured; the world group stays."""
    script = tmp_path / "probe_worker.py"
    script.write_text(
        "import os, torch.distributed as dist\n"
        "from launcher.rank import health\n"
        "dist.init_process_group('gloo')\n"
        "os.environ['LOCAL_WORLD_SIZE'] = '2'  # two 'nodes' of two ranks on this machine\n"
        "before = len(dist.distributed_c10d._world.pg_map)\n"
        "lines = health.probe(size_mb=0.1, iters=1)\n"
        "after = len(dist.distributed_c10d._world.pg_map)\n"
        "if dist.get_rank() == 0:\n"
        "    print('groups', before, after, len([l for l in lines if l.startswith('health: node ')]), flush=True)\n"
        "dist.destroy_process_group()\n")
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore", PYTHONPATH=str(ROOT))
    proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node=4", "--standalone",
                           str(script)], cwd=ROOT, env=env, capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    assert "groups 1 1 2" in proc.stdout, proc.stdout[-2000:]
