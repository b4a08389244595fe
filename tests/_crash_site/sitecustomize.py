"""Test support: on PYTHONPATH for ranks that must crash the same way on every attempt (the no-progress rule,
tests/test_no_progress.py). With LAUNCHER_TEST_CRASH_AT_STEP=K (and LAUNCHER_TEST_CRASH_RANK=R, default 0), rank
R raises in step K each time it reaches it: a deterministic bug, as a data error or a kernel fault would be."""
import importlib.abc
import importlib.util
import os
import sys

_STEP = os.environ.get("LAUNCHER_TEST_CRASH_AT_STEP")


def _patch(module) -> None:
    original = module.Loop.train_step
    step, rank = int(_STEP), os.environ.get("LAUNCHER_TEST_CRASH_RANK", "0")

    def train_step(self, iterators):
        if self.step + 1 == step and os.environ.get("RANK") == rank:
            raise RuntimeError(f"injected crash in step {step}")
        return original(self, iterators)

    module.Loop.train_step = train_step


class _Hook(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path, target=None):
        if name != "launcher.rank.loop":
            return None
        sys.meta_path.remove(self)
        spec = importlib.util.find_spec(name)
        load = spec.loader.exec_module

        def exec_module(module):
            load(module)
            _patch(module)

        spec.loader.exec_module = exec_module
        return spec


if _STEP and os.environ.get("RANK") is not None:
    sys.meta_path.insert(0, _Hook())
