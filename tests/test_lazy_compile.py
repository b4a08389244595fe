"""models/lazy_compile.py: the rank process defers torch.compile's backend set-up to the first call, so importing
Megatron-Core does not import TorchInductor on every rank, and a decorated function still compiles, with the
decorator's options, when it is first called."""
from __future__ import annotations

import subprocess
import sys

from conftest import ROOT


def test_first_call_compiles_with_the_decorators_options(monkeypatch):
    import torch

    from models import lazy_compile

    calls = []

    def recording(model, **options):
        calls.append((model, options))
        return lambda *a, **k: ("compiled", model(*a, **k))

    monkeypatch.setattr(lazy_compile, "_ORIGINAL", recording)

    @lazy_compile._deferred_compile(dynamic=False, fullgraph=True)
    def double(x):
        return 2 * x

    assert calls == []  # decorating compiles nothing
    assert double(3) == ("compiled", 6) and double(4) == ("compiled", 8)
    assert len(calls) == 1 and calls[0][1] == {"dynamic": False, "fullgraph": True}  # once, with its options
    assert double.__name__ == "double" and double.__wrapped_for_compile__ is calls[0][0]

    module = torch.nn.Linear(2, 2)  # modules and disable=True go straight to torch.compile
    lazy_compile._deferred_compile(module)
    assert calls[-1] == (module, {})
    lazy_compile._deferred_compile(double, disable=True)
    assert calls[-1][1] == {"disable": True}


def test_rank_entry_imports_megatron_without_inductor():
    # what `python -m launcher.rank` does first (launcher/rank/__main__.py), then the modules train() imports
    code = ("import sys, runpy\n"
            "src = open('launcher/rank/__main__.py').read()\n"
            "assert src.index('defer_torch_compile()') < src.index('sys.exit(main())')\n"
            "from models.lazy_compile import defer_torch_compile, is_deferred\n"
            "defer_torch_compile()\n"
            "import megatron.core, megatron.core.pipeline_parallel, megatron.core.models.gpt\n"
            "from megatron.core import jit\n"
            "from megatron.core.fusions import fused_bias_swiglu\n"
            "assert jit.jit_fuser.__module__ == 'models.lazy_compile', jit.jit_fuser\n"
            "assert hasattr(fused_bias_swiglu.swiglu, '__wrapped_for_compile__')\n"
            "assert 'torch._inductor.compile_fx' not in sys.modules, 'TorchInductor imported at import time'\n")
    proc = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
