"""One process of tests/test_convert_memory.py (no torchrun: the conversion reads without collectives).

``write DIR``: an fsdp_dtensor-shaped checkpoint (Megatron-FSDP's names: gated fc1 as ``weight_w``/``weight_v``,
Adam's moments under ``optimizer.state.module.module.``) of LAYERS layers, fp32, deterministic values, in its own
process so that none of its buffers is still held by the allocator of the process that measures.

``convert DIR``: a DDP rank's torch_dist load template (stacked per-layer ShardedTensors over live, touched tensors
for the model, the fp32 main weights and both moments), filled by ``checkpoint_convert.read`` +
``torch_dist_state`` as ``launcher/rank/checkpoint/store.py`` does; prints JSON: the peak RSS growth during the
conversion (VmHWM reset through /proc/self/clear_refs), the checkpoint's size, and the elements checked equal.
"""
from __future__ import annotations

import json
import sys
from pathlib import Path

LAYERS, HIDDEN, FFN = 8, 1024, 1024
SHAPES = {"mlp.linear_fc1.weight": (2 * FFN, HIDDEN), "mlp.linear_fc2.weight": (HIDDEN, FFN)}
KINDS = ("model", "exp_avg", "exp_avg_sq")


def _value(kind: str, layer: int, short: str):
    import torch

    seed = 1000 * KINDS.index(kind) + 10 * layer + list(SHAPES).index(short)
    return torch.randn(SHAPES[short], generator=torch.Generator().manual_seed(seed))


def write(path: Path) -> None:
    import torch.distributed.checkpoint as dcp

    state: dict = {"step": 3, "consumed_samples": 24}
    for kind in KINDS:
        for layer in range(LAYERS):
            for short in SHAPES:
                name = f"decoder.layers.{layer}.{short}"
                value = _value(kind, layer, short)
                parts = {"_w": value[:FFN], "_v": value[FFN:]} if "fc1" in short else {"": value}
                for half, part in parts.items():
                    key = (f"model.module.{name}{half}" if kind == "model" else
                           f"optimizer.state.module.module.{name}{half}.{kind}")
                    state[key] = part.clone()
    dcp.save(state, storage_writer=dcp.FileSystemWriter(str(path)), no_dist=True)
    (path / "launcher.json").write_text(json.dumps({"format": "fsdp_dtensor"}))


def _kb(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    raise KeyError(field)


def convert(path: Path) -> None:
    import gc

    import torch
    from megatron.core.dist_checkpointing.mapping import ShardedTensor

    from _rank_harness import single_process_group
    from launcher.rank.checkpoint import convert as checkpoint_convert

    single_process_group()  # the ranks' parallel state (TP = PP = DP = 1): whose RNG streams the template takes
    prefixes = {"model": "", "main": "optimizer.state.param.", "exp_avg": "optimizer.state.exp_avg.",
                "exp_avg_sq": "optimizer.state.exp_avg_sq."}
    template: dict = {}
    for kind, prefix in prefixes.items():
        for layer in range(LAYERS):
            for short, shape in SHAPES.items():
                live = torch.full(shape, -1.0)  # touched: a live tensor of the rank, resident before the load
                template[f"{prefix}{layer}.{short}"] = ShardedTensor.from_rank_offsets(
                    f"{prefix}decoder.layers.{short}", live, (0, layer, LAYERS), replica_id=0, prepend_axis_num=1)
    gc.collect()
    Path("/proc/self/clear_refs").write_text("5")  # peak RSS := current RSS (Linux >= 4.0)
    before = _kb("VmRSS")
    source = checkpoint_convert.read(path, checkpoint_convert.FSDP, [])
    state = checkpoint_convert.torch_dist_state(template, source, {})
    peak = _kb("VmHWM")
    checked = 0
    for kind, prefix in prefixes.items():
        for layer in range(LAYERS):
            for short in SHAPES:
                got = state[f"{prefix}{layer}.{short}"]
                assert torch.equal(got, _value("model" if kind == "main" else kind, layer, short)), (kind, layer)
                checked += got.numel()
    assert (state["step"], state["consumed_samples"]) == (3, 24), state
    size = sum(p.stat().st_size for p in path.iterdir() if p.is_file())
    print(json.dumps({"grown_bytes": (peak - before) * 1024, "checkpoint_bytes": size, "checked": checked}))


if __name__ == "__main__":
    {"write": write, "convert": convert}[sys.argv[1]](Path(sys.argv[2]))
