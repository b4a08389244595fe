"""How long the login-node actions take for the big recipes (compose + validate + plan + render), and
whether any of them imported torch. Prints one line per recipe. Run: .venv/bin/python benchmarks/login_node.py
"""
from __future__ import annotations

import statistics
import subprocess
import sys
import tempfile
import time

PROBE = r"""
import contextlib, io, sys, time
t0 = time.perf_counter()
from launcher.cli import main
t_import = time.perf_counter() - t0
with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
    code = main([f"recipe={sys.argv[1]}", "action=render", f"output_dir={sys.argv[2]}"])
total = time.perf_counter() - t0
heavy = any(m.split(".")[0] in ("torch", "megatron") for m in sys.modules)
print(f"{code} {t_import:.3f} {total:.3f} {int(heavy)}")
"""


def main() -> None:
    recipes = sys.argv[1:] or ["llama3_8b", "llama3_70b", "llama405b"]
    with tempfile.TemporaryDirectory() as out:
        for recipe in recipes:
            runs = []
            for _ in range(3):
                wall0 = time.perf_counter()
                res = subprocess.run([sys.executable, "-c", PROBE, recipe, out], capture_output=True, text=True)
                wall = time.perf_counter() - wall0
                code, t_import, total, heavy = res.stdout.split()
                runs.append((wall, float(total), float(t_import), int(code), int(heavy)))
            print(f"{recipe:<12} render exit={runs[0][3]} process wall median {statistics.median(r[0] for r in runs):.2f} s, "
                  f"in-process median {statistics.median(r[1] for r in runs):.2f} s "
                  f"(imports {statistics.median(r[2] for r in runs):.2f} s), torch imported: {bool(runs[0][4])}")


if __name__ == "__main__":
    main()
