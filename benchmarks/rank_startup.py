"""What a rank costs before it trains, side by side in one run (medians of alternating repetitions):

1. ``import megatron.core`` (+ the GPT model and pipeline modules a rank imports) in a fresh interpreter, with
   Megatron-Core's import-time ``torch.compile`` decorations as shipped vs deferred to the first call
   (``models/lazy_compile.py``, what ``python -m launcher.rank`` installs first): CPU seconds and wall seconds.
2. A tiny TP2 x PP2 run of one step (4 ranks, tests/_rank_harness.py TINY) started by torchrun vs forked by the
   test suite's warm rank server (tests/_rank_zygote.py): wall seconds, and that both print the same loss.

    .venv/bin/python benchmarks/rank_startup.py            # 3 repetitions of each
    .venv/bin/python benchmarks/rank_startup.py --repeat 5
"""
from __future__ import annotations

import argparse
import os
import resource
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))
sys.path.insert(0, str(ROOT))

IMPORTS = "import megatron.core, megatron.core.pipeline_parallel, megatron.core.models.gpt"
DEFER = "from models.lazy_compile import defer_torch_compile; defer_torch_compile(); "


def _child_cpu() -> float:
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


def time_import(deferred: bool) -> tuple[float, float]:
    code = (DEFER if deferred else "") + IMPORTS
    cpu0, t0 = _child_cpu(), time.perf_counter()
    subprocess.run([sys.executable, "-W", "ignore", "-c", code], cwd=ROOT, check=True, env=dict(os.environ,
                                                                                              OMP_NUM_THREADS="1"))
    return _child_cpu() - cpu0, time.perf_counter() - t0


def time_run(tmp: Path, via_torchrun: bool, i: int) -> tuple[float, float]:
    from _rank_harness import TINY, layout, run_train, steps, write_bundle

    bundle = write_bundle(tmp / f"{'torchrun' if via_torchrun else 'forked'}-{i}",
                          TINY + layout(tp=2, pp=2) + ["train.train_steps=1"], 4)
    t0 = time.perf_counter()
    proc = run_train(bundle, 4, env={"LAUNCHER_TEST_TORCHRUN": "1"} if via_torchrun else None)
    took = time.perf_counter() - t0
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    return took, steps(proc.stdout)[1]["loss"]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeat", type=int, default=3)
    args = parser.parse_args()
    print(f"machine: {os.cpu_count()} CPUs, load average {os.getloadavg()[0]:.1f} at start")

    shipped, deferred = [], []
    for _ in range(args.repeat):  # alternating, so a change of load hits both
        shipped.append(time_import(False))
        deferred.append(time_import(True))
    for name, rows in (("as shipped", shipped), ("deferred", deferred)):
        print(f"import megatron.core ({name:10s}): CPU {statistics.median(r[0] for r in rows):5.2f} s, "
              f"wall {statistics.median(r[1] for r in rows):5.2f} s (median of {len(rows)})")
    ratio = statistics.median(r[0] for r in deferred) / statistics.median(r[0] for r in shipped)
    print(f"import CPU ratio deferred / shipped: {ratio:.2f}")

    from _rank_harness import _zygote_for, RANK_ENV

    tmp = Path(tempfile.mkdtemp(prefix="rank-startup-"))
    try:
        _zygote_for(dict(os.environ, **RANK_ENV))  # the server's warm-up is paid once per test session, not per run
        torchrun, forked = [], []
        for i in range(args.repeat):
            torchrun.append(time_run(tmp, True, i))
            forked.append(time_run(tmp, False, i))
        assert {r[1] for r in torchrun} == {r[1] for r in forked}, (torchrun, forked)
        t, f = statistics.median(r[0] for r in torchrun), statistics.median(r[0] for r in forked)
        print(f"1-step TP2xPP2 run (4 ranks): torchrun {t:5.1f} s, forked {f:5.1f} s wall (median of "
              f"{args.repeat}); ratio forked / torchrun {f / t:.2f}; loss {torchrun[0][1]} in both")
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    print(f"load average {os.getloadavg()[0]:.1f} at the end")
    return 0


if __name__ == "__main__":
    sys.exit(main())
