"""Login-node guarantees: composing, validating, planning and rendering import neither torch nor megatron,
answer in about a second, and --help / --cfg job work."""
from __future__ import annotations

import json
import subprocess
import sys

from conftest import ROOT

PROBE = r"""
import sys, time, json, io, contextlib
t0 = time.process_time()  # CPU seconds: wall time on a busy 2-core machine measured 53 s at load average 20
from launcher.cli import main
codes = {}
for action in ("validate", "plan", "render"):
    with contextlib.redirect_stdout(io.StringIO()):
        codes[action] = main(["recipe=llama405b", "cluster=h200", "nodes=64", f"action={action}",
                              "output_dir=" + sys.argv[1]])
elapsed = time.process_time() - t0
heavy = sorted(m for m in sys.modules if m.split(".")[0] in ("torch", "megatron", "transformer_engine", "apex"))
print(json.dumps({"codes": codes, "heavy": heavy, "elapsed": elapsed}))
"""


def test_compose_validate_plan_render_import_no_torch(tmp_path):
    proc = subprocess.run([sys.executable, "-c", PROBE, str(tmp_path)], cwd=ROOT, capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == 0, proc.stderr
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    assert result["codes"] == {"validate": 0, "plan": 0, "render": 0}
    assert result["heavy"] == []
    # A pathology bound, not the speed target ("about a second" per action is benchmarks/login_node.py's): the
    # three actions take about 4 CPU s; 40 CPU s (10x) only catches an import of torch through a side door or a
    # planner gone quadratic. Allowed in tests/test_no_timing_asserts.py.
    assert result["elapsed"] < 40.0, result["elapsed"]


def test_help_lists_every_field_with_its_docstring(cli):
    import dataclasses
    from launcher.schema import SECTIONS
    code, out, _ = cli("--help")
    assert code == 0
    for section, cls in SECTIONS.items():
        for f in dataclasses.fields(cls):
            line = next((l for l in out.splitlines() if l.split() and l.split()[0] == f"{section}.{f.name}"), None)
            assert line is not None, f"{section}.{f.name} missing from --help"
            assert len(line.split(None, 1)) == 2, f"{section}.{f.name} has no docstring"


def test_cfg_job_prints_the_resolved_config(cli):
    code, out, _ = cli("recipe=llama3_70b", "parallel.tensor=8", "--cfg", "job")
    assert code == 0
    assert "tensor: 8" in out and "name: llama3_70b" in out and "hidden_size: 8192" in out
