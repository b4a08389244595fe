"""``import-hf``'s streaming pieces: HF safetensors read one tensor at a time, a torch_dist write that makes each
tensor just before it is written, and the free memory / disk it needs.

Reading. A safetensors file is an 8-byte little-endian header length, a JSON header (name -> dtype, shape, byte
offsets) and the raw bytes (safetensors' README, "Format"). Each tensor is read with one ``pread`` into a buffer of
its own, which is freed when the tensor is dropped. ``safe_open`` is not used for the bytes: it maps the whole file,
and the pages a read touches stay mapped (and counted in the process's resident memory) as long as the handle is
open, so reading every tensor of a model through it would show as the whole model resident.

Writing. Megatron-Core's ``dist_checkpointing.save`` (torch_dist) plans the checkpoint from the sharded state dict's
shapes and dtypes alone, then ``FileSystemWriterAsync`` resolves every write item to its tensor up front
(``prepare_write_data``) and writes them one by one (``write_preloaded_data``; one file with the default
``thread_count=1``). The model here lives on the ``meta`` device, so planning, metadata and file layout are exactly
Megatron-Core's, and :class:`StreamingWriter` hands the writer each tensor only when its turn comes: a lazy list that
turns the meta view into the real bytes (:class:`Materializer`) as it is iterated, and drops it after the write.
"""
from __future__ import annotations

import contextlib
import ctypes
import json
import os
import shutil
import struct
from pathlib import Path
from typing import Callable, Dict, Iterator, List, Optional, Tuple

import torch

SAFETENSORS_DTYPES = {"F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
                      "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8,
                      "BOOL": torch.bool}


class SafetensorsReader:
    """The tensors of an HF model's ``*.safetensors`` files: names, shapes and dtypes from the headers; bytes on
    request, one tensor at a time."""

    def __init__(self, root: Path, files: List[str]):
        self.entries: Dict[str, Tuple[Path, torch.dtype, tuple, int, int]] = {}
        for f in files:
            path = root / f
            with open(path, "rb") as fh:
                (n,) = struct.unpack("<Q", fh.read(8))
                header = json.loads(fh.read(n))
            for name, e in header.items():
                if name == "__metadata__":
                    continue
                start, end = e["data_offsets"]
                self.entries[name] = (path, SAFETENSORS_DTYPES[e["dtype"]], tuple(e["shape"]), 8 + n + start,
                                      end - start)

    def shape(self, name: str) -> tuple:
        return self.entries[name][2]

    def dtype(self, name: str) -> torch.dtype:
        return self.entries[name][1]

    def nbytes(self, name: str) -> int:
        return self.entries[name][4]

    def get(self, name: str) -> torch.Tensor:
        path, dtype, shape, offset, length = self.entries[name]
        buf = torch.empty(length, dtype=torch.uint8)
        # a ctypes view of the buffer, not .numpy(): a storage shared with numpy can no longer be resized, and the
        # writer frees each tensor by resizing its storage to 0 (Materializer.release)
        with open(path, "rb", buffering=0) as fh:
            view, done = memoryview((ctypes.c_char * length).from_address(buf.data_ptr())).cast("B"), 0
            while done < length:  # pread may return less than asked for (large reads, signals)
                got = os.preadv(fh.fileno(), [view[done:]], offset + done)
                if got <= 0:
                    raise OSError(f"{path}: {name} is cut short ({done} of {length} bytes)")
                done += got
        return buf.view(dtype).reshape(shape)


def storage_key(t: torch.Tensor) -> int:
    """Which tensor's storage ``t`` views: the identity torch.save uses for storages (``storage._cdata``); views,
    ``.data`` and detach share it, and meta tensors have one too."""
    return t.untyped_storage()._cdata


class Materializer:
    """A meta view of a model parameter -> the same view of the real tensor, computed from the HF tensors.

    ``producers`` maps a parameter's storage to a function making the whole parameter (contiguous, its shape and
    dtype). The last parameter made is kept, because a gated fc1 is written as two halves one after the other."""

    def __init__(self, producers: Dict[int, Callable[[], torch.Tensor]]):
        self._producers = producers
        self._key, self._full = None, None

    def __call__(self, meta: torch.Tensor) -> torch.Tensor:
        key = storage_key(meta)
        if key != self._key:
            self.release()  # the previous parameter is freed before the next is made
            if key not in self._producers:
                raise RuntimeError(f"import-hf: a write item of shape {tuple(meta.shape)} views no mapped parameter")
            self._full, self._key = self._producers[key](), key
        view = self._full.as_strided(meta.size(), meta.stride(), meta.storage_offset())
        # as FileSystemWriterAsync does with a CPU tensor that views a larger storage: clone it, else torch.save
        # would write the whole storage (the bytes on disk are then the same as when the model was built for real)
        return view.clone() if view.numel() != self._full.numel() else view

    def written(self, tensor: torch.Tensor) -> None:
        """``tensor`` (a chunk this made) is on disk: a clone's memory goes back now."""
        if self._full is None or storage_key(tensor) != storage_key(self._full):
            _free(tensor)

    def release(self) -> None:
        """Free the parameter kept: its storage is emptied, since the writer's loop variable still holds a view
        of it until that variable is rebound, which happens only after the next tensor has been made."""
        if self._full is not None:
            _free(self._full)
        self._key, self._full = None, None


def _free(tensor: torch.Tensor) -> None:
    storage = tensor.untyped_storage()
    if storage.resizable():  # else (a storage torch cannot resize) it goes when its last reference does
        storage.resize_(0)


class _LazyTensors:
    """A bucket's ``(write item, tensor)`` list whose tensors are made as it is iterated (and dropped after)."""

    def __init__(self, items: list, make: Materializer):
        self._items, self._make = items, make

    def __len__(self) -> int:
        return len(self._items)

    def __iter__(self) -> Iterator[tuple]:
        for item, meta in self._items:
            tensor = self._make(meta)
            yield item, tensor
            # the writer asks for the next item only once this one is written
            self._make.written(tensor)
            del tensor
        self._make.release()


def streaming_writer_class(make: Materializer):
    """Megatron-Core's ``FileSystemWriterAsync`` whose tensors are made at write time (see the module doc)."""
    from megatron.core.dist_checkpointing.strategies.filesystem_async import FileSystemWriterAsync

    class StreamingWriter(FileSystemWriterAsync):
        def prepare_write_data(self, plan, planner) -> None:
            super().prepare_write_data(plan, planner)
            self.write_buckets = [(path, name, (byte_items, _LazyTensors(tensor_items, make)))
                                  for path, name, (byte_items, tensor_items) in self.write_buckets]

        @staticmethod
        def preload_tensors(write_buckets, non_blocking=True):
            return write_buckets  # nothing to stage: every tensor is made on the CPU when it is written

    return StreamingWriter


@contextlib.contextmanager
def streaming_save(make: Materializer):
    """While inside, ``dist_checkpointing.save`` (torch_dist, sync) writes through :func:`streaming_writer_class`.
    Megatron-Core picks its writer class by name at each save (``_import_mcore_async`` in
    dist_checkpointing/strategies/torch.py); that name is swapped for this one save and restored."""
    from megatron.core.dist_checkpointing.strategies import filesystem_async

    original = filesystem_async.FileSystemWriterAsync
    filesystem_async.FileSystemWriterAsync = streaming_writer_class(make)
    try:
        yield
    finally:
        filesystem_async.FileSystemWriterAsync = original


def rss_bytes(field: str = "VmRSS") -> int:
    """This process's resident memory now (VmRSS) or its peak so far (VmHWM), from /proc/self/status."""
    with open("/proc/self/status") as fh:
        for line in fh:
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
    raise OSError(f"/proc/self/status has no {field}")


def available_memory() -> Tuple[int, str]:
    """(bytes, where from): the kernel's MemAvailable, or less where this process's memory cgroup (a Slurm job's
    ``--mem``, a container) leaves less room under its limit."""
    avail, source = None, "MemAvailable in /proc/meminfo"
    with open("/proc/meminfo") as fh:
        for line in fh:
            if line.startswith("MemAvailable:"):
                avail = int(line.split()[1]) * 1024
    room = _cgroup_room()
    if room is not None and (avail is None or room < avail):
        avail, source = room, "room under this process's memory cgroup limit"
    if avail is None:
        raise OSError("/proc/meminfo has no MemAvailable")
    return avail, source


def _cgroup_room() -> Optional[int]:
    """limit - usage of this process's memory cgroup (v2 ``memory.max``, v1 ``memory.limit_in_bytes``), or None."""
    try:
        lines = Path("/proc/self/cgroup").read_text().splitlines()
    except OSError:
        return None
    for line in lines:
        _, controllers, rel = line.split(":", 2)
        if controllers == "":
            base, files = Path("/sys/fs/cgroup") / rel.lstrip("/"), ("memory.max", "memory.current")
        elif "memory" in controllers.split(","):
            base, files = Path("/sys/fs/cgroup/memory") / rel.lstrip("/"), ("memory.limit_in_bytes",
                                                                               "memory.usage_in_bytes")
        else:
            continue
        try:
            limit, usage = ((base / f).read_text().strip() for f in files)
        except OSError:
            continue
        if limit.isdigit() and usage.isdigit() and int(limit) < 2**60:  # v1 writes "no limit" as a huge number
            return int(limit) - int(usage)
    return None


def free_disk_bytes(path: Path) -> int:
    """Free bytes (for an unprivileged user) on the filesystem ``path`` is or would be created on."""
    p = Path(path).resolve()
    while not p.exists():
        p = p.parent
    return shutil.disk_usage(p).free
