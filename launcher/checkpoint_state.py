"""``python -m launcher.checkpoint_state CKPT``: a checkpoint's step and consumed samples, read from its common
state (a torch.distributed.checkpoint entry: torch_dist keeps them under ``common_state/``, fsdp_dtensor at the
top). A tool of its own process (it imports torch): the login node's ``checkpoint-info`` (launcher/resume_plan.py)
starts it by module name for a checkpoint without our manifest, or when asked. Prints one JSON line.
"""
from __future__ import annotations

import json
import sys


def read(path: str) -> dict:
    import warnings

    warnings.filterwarnings("ignore", message="torch.distributed is disabled")  # no process group: on purpose
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.metadata import BytesStorageMetadata

    reader = dcp.FileSystemReader(path)
    meta = reader.read_metadata().state_dict_metadata
    keys = [k for k, m in meta.items() if isinstance(m, BytesStorageMetadata)
            and (k.startswith("common_state") or k in ("step", "consumed_samples"))]
    state = {k: None for k in keys}
    dcp.load(state, storage_reader=reader, no_dist=True)
    common = next((v for k, v in state.items() if k.startswith("common_state")), None)
    common = common[0] if isinstance(common, list) else common or state
    return {"step": int(common["step"]), "consumed_samples": int(common["consumed_samples"])}


def main(argv) -> int:
    if len(argv) != 1:
        print("usage: python -m launcher.checkpoint_state CKPT", file=sys.stderr)
        return 2
    try:
        print(json.dumps(read(argv[0])))
    except Exception as exc:  # noqa: BLE001 - one line for the caller, whatever the reader raised
        print(f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"[:300], file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
