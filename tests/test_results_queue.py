"""The checkpoint writers' results queue (launcher/rank/signals.py ``writer_results_queue``): Megatron-Core's
``filesystem_async`` puts the write results (torch.distributed.checkpoint objects) or an exception into it and
reads them back with ``get_nowait``. Ours holds them pickled, so its helper process (a spawned manager server, one
per rank) stores bytes and never imports torch to unpickle them; the rank gets the same objects back."""
from __future__ import annotations

import pickle
import queue
from pathlib import Path

import pytest


def test_the_helper_stores_bytes_never_imports_torch_and_the_rank_gets_the_results_back():
    from megatron.core.dist_checkpointing.strategies import filesystem_async
    from torch.distributed.checkpoint.metadata import MetadataIndex
    from torch.distributed.checkpoint.storage import WriteResult

    from launcher.rank import signals

    before = filesystem_async._results_queue
    filesystem_async._results_queue = None
    try:
        signals.writer_results_queue()
        results_queue = filesystem_async.get_write_results_queue()  # what FileSystemWriterAsync asks for
        manager = signals._HELPERS[-1]
        results = {0: [WriteResult(index=MetadataIndex("decoder.weight", (0, 0)), size_in_bytes=64,
                                   storage_data="__0_0.distcp")]}
        results_queue.put(results)
        assert results_queue.get_nowait() == results
        results_queue.put(RuntimeError("worker 1 failed"))
        error = results_queue.get_nowait()
        assert isinstance(error, RuntimeError) and str(error) == "worker 1 failed"
        with pytest.raises(queue.Empty):
            results_queue.get_nowait()
        assert pickle.loads(pickle.dumps(results)) == results
        maps = Path(f"/proc/{manager._process.pid}/maps").read_text()
        assert "libtorch" not in maps and "torch/lib" not in maps
    finally:
        for manager in signals._HELPERS:
            manager.shutdown()
        signals._HELPERS.clear()
        filesystem_async._results_queue = before
