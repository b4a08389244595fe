"""Test support: on PYTHONPATH for ranks that must crash the same way on every attempt (the no-progress rule,
tests/test_no_progress.py). With LAUNCHER_TEST_CRASH_AT_STEP=K (and LAUNCHER_TEST_CRASH_RANK=R, default 0), rank
R raises in step K each time it reaches it: a deterministic bug, as a data error or a kernel fault would be.
With LAUNCHER_TEST_NAN_AT_STEP=K, every rank fills its first weight with NaN before step K: the real forward and
backward then carry the NaN to the loss and the gradients, and the loop's own non-finite rule sees it (a train.lr
large enough to diverge is refused by validation, tests/test_nothing_lost.py).
With LAUNCHER_TEST_SPIKE_AT_STEP=K, the last stage multiplies its final norm's weights by -20 for step K's
forward and backward (the logits turn over and grow 20-fold: a loss spike) and puts them back bitwise after it; with
LAUNCHER_TEST_SPIKE_ONCE=1 only the first time this process computes step K (a transient fault, which a replay
does not meet), else every time (a poisoned batch: the replay meets it again) (tests/test_loss_spikes.py).
With LAUNCHER_TEST_SLOW_ASYNC_WRITE=K:S, the background writer of step K's asynchronous checkpoint sleeps S seconds
before it writes (checkpoint.async_save, tests/test_async_save.py): a kill or a stop signal lands during the write.
With LAUNCHER_TEST_STEP_SLEEP=S, every training step first sleeps S seconds: a run that only has to last (until a
scheduler's signal comes, tests/test_nothing_lost_slurm.py) waits off the CPU instead of training more steps, which
the suite's other tests need on a 2-core machine."""
import importlib.abc
import importlib.util
import os
import sys

_STEP = os.environ.get("LAUNCHER_TEST_CRASH_AT_STEP")
_NAN = os.environ.get("LAUNCHER_TEST_NAN_AT_STEP")
_SPIKE = os.environ.get("LAUNCHER_TEST_SPIKE_AT_STEP")
_SLOW_WRITE = os.environ.get("LAUNCHER_TEST_SLOW_ASYNC_WRITE")
_STEP_SLEEP = os.environ.get("LAUNCHER_TEST_STEP_SLEEP")


def _patch_writer(module) -> None:
    import time

    step, seconds = (float(x) for x in _SLOW_WRITE.split(":"))
    original = module._background_write

    def slow(at, write_fn, *args, **kwargs):
        if at == int(step):
            module._die_with_parent()  # as the real writer does first: no orphan sleeps on after a kill
            time.sleep(seconds)
        return original(at, write_fn, *args, **kwargs)

    module._background_write = slow


def _patch(module) -> None:
    original = module.Loop.train_step
    step = int(_STEP) if _STEP else None
    nan_step = int(_NAN) if _NAN else None
    spike_step, spiked = (int(_SPIKE) if _SPIKE else None), []
    rank = os.environ.get("LAUNCHER_TEST_CRASH_RANK", "0")

    def train_step(self, iterators):
        if _STEP_SLEEP:
            import time

            time.sleep(float(_STEP_SLEEP))
        if self.step + 1 == step and os.environ.get("RANK") == rank:
            raise RuntimeError(f"injected crash in step {step}")
        if self.step + 1 == nan_step:
            import torch

            with torch.no_grad():
                next(self.model[0].parameters()).fill_(float("nan"))
        if self.step + 1 == spike_step and not (spiked and os.environ.get("LAUNCHER_TEST_SPIKE_ONCE") == "1"):
            spiked.append(self.step + 1)
            return _spiked(self, original, iterators)
        return original(self, iterators)

    module.Loop.train_step = train_step


def _spiked(loop, original, iterators):
    import torch

    params = [p for chunk in loop.model for name, p in chunk.named_parameters()
              if "final_layernorm" in name]
    kept = [p.detach().clone() for p in params]
    with torch.no_grad():
        for p in params:
            p.mul_(-20.0)
    out = original(loop, iterators)
    with torch.no_grad():
        for p, k in zip(params, kept):
            p.copy_(k)  # bitwise as before (the spiked step applied no update: the rule under test skips it)
    return out


class _Hook(importlib.abc.MetaPathFinder):
    def __init__(self, name, patch):
        self.name, self.patch = name, patch

    def find_spec(self, name, path, target=None):
        if name != self.name:
            return None
        sys.meta_path.remove(self)
        spec = importlib.util.find_spec(name)
        load = spec.loader.exec_module
        patch = self.patch

        def exec_module(module):
            load(module)
            patch(module)

        spec.loader.exec_module = exec_module
        return spec


if (_STEP or _NAN or _SPIKE or _STEP_SLEEP) and os.environ.get("RANK") is not None:
    sys.meta_path.insert(0, _Hook("launcher.rank.loop", _patch))
if _SLOW_WRITE and os.environ.get("RANK") is not None:
    sys.meta_path.insert(0, _Hook("launcher.rank.checkpoint.async_save", _patch_writer))
