"""NCCL's rules on CPU ranks (test support): device discipline and the p2p issue order.

Gloo accepts a CPU tensor in any collective and buffers every send; NCCL does neither. Two emulations, both
installed into a process by :func:`install` (tests/_nccl_site/sitecustomize.py calls it in every rank that
torchrun starts when ``LAUNCHER_NCCL_EMULATION`` is set):

* **Device discipline.** A tensor made by a torch factory (``torch.tensor``, ``zeros``, ``empty``, ...) without
  ``device=``, or with ``device="cpu"`` written out, is a host tensor on a GPU rank; so is ``t.cpu()``, ``t.to("cpu")``,
  and ``torch.*_like(t)`` / ``t.new_*()`` of a host tensor. Such tensors are tagged; ``.to(device)`` yields an untagged
  tensor (a GPU rank's copy), ``.to(dtype)`` keeps the tag. Any collective or p2p op that receives a tagged tensor
  raises what NCCL would ("No backend type associated with device type cpu"), unless its group was created
  explicitly for gloo (Megatron's CPU-side ``*_gloo`` groups). The tag is not propagated through arithmetic:
  the check catches a factory tensor that reaches a collective directly, the way ``checkpoint_bytes`` did;
  the static scan in tests/test_nccl_semantics.py covers the rank wing's factory calls.
* **P2P trace.** Every isend/irecv/send/recv/batch_isend_irecv, every wait on their requests and every
  collective on a group of more than one rank is recorded as a ``launcher.core.pipeline.p2p`` event; a rank writes
  ``rank-<r>.json`` into ``LAUNCHER_P2P_TRACE`` at exit, for ``launcher.core.pipeline.p2p.replay``.
"""
from __future__ import annotations

import atexit
import functools
import json
import os
import sys
import weakref

import torch
import torch.distributed as dist
from torch.distributed import distributed_c10d as c10d

TAG = "_launcher_host_tensor"
FACTORIES = ("tensor", "zeros", "ones", "empty", "full", "arange", "as_tensor", "from_numpy", "rand", "randn",
             "randint", "linspace", "eye")
COLLECTIVES = ("all_reduce", "broadcast", "reduce", "all_gather", "all_gather_into_tensor", "reduce_scatter",
               "reduce_scatter_tensor", "all_to_all", "all_to_all_single", "gather", "scatter", "_all_gather_base",
               "_reduce_scatter_base", "barrier", "all_gather_object", "broadcast_object_list", "gather_object",
               "scatter_object_list")
P2P = ("isend", "irecv", "send", "recv")

_gloo_groups: "weakref.WeakSet" = weakref.WeakSet()
_state = {"installed": False, "rank_pid": None, "events": [], "items": 0, "in_batch": False, "fake": None}


class NcclDeviceError(RuntimeError):
    pass


# ------------------------------------------------------------------------------------------- device tags
def is_host(t) -> bool:
    return isinstance(t, torch.Tensor) and getattr(t, TAG, False)


def _tag(t):
    if isinstance(t, torch.Tensor):
        try:
            setattr(t, TAG, True)
        except (AttributeError, RuntimeError):
            pass
    return t


OWN_CODE = ("launcher.", "models.", "data.", "__main__")
"""Modules whose ``"cpu"`` means the host: the project's own code. Megatron's ``"cpu"`` strings are the CPU bridge's
stand-in for the CUDA device (models/cpu_compat.py maps ``torch.cuda.current_device()`` and ``device="cuda"`` to
``"cpu"``), the compute device a GPU rank would use, so they are not host tensors."""


def _names_host(device, depth: int = 2) -> bool:
    """A device argument that means the host on a GPU rank too: ``"cpu"`` written out by the project's own code (the
    caller ``depth`` frames up). A ``torch.device`` object is what ``compute_device()`` or ``tensor.device`` returns:
    left to the tensor's tag; ``torch.device("cpu")`` spelled out is the static scan's
    (tests/test_nccl_semantics.py)."""
    if not (isinstance(device, str) and device.split(":")[0] == "cpu"):
        return False
    caller = sys._getframe(depth).f_globals.get("__name__", "")
    return caller != "models.cpu_compat" and (caller.startswith(OWN_CODE) or caller in OWN_CODE)


def _factory(name, orig):
    @functools.wraps(orig)
    def make(*args, **kwargs):
        out = orig(*args, **kwargs)
        from_tensor = bool(args) and isinstance(args[0], torch.Tensor) and name in ("tensor", "as_tensor")
        device = kwargs.get("device")
        if "out" not in kwargs and ((device is None and not from_tensor) or _names_host(device)):
            _tag(out)
        return out
    return make


LIKE = ("zeros_like", "ones_like", "empty_like", "full_like", "rand_like", "randn_like", "randint_like")
NEW = ("new_zeros", "new_ones", "new_empty", "new_full", "new_tensor")


def _like(orig):
    """``torch.*_like(t)`` and ``t.new_*()``: on the device of ``t`` unless ``device=`` says otherwise, so the copy
    of a host tensor is a host tensor, and ``device="cpu"`` makes one from any tensor."""
    @functools.wraps(orig)
    def make(source, *args, **kwargs):
        out = orig(source, *args, **kwargs)
        device = kwargs.get("device")
        if (device is None and is_host(source)) or _names_host(device):
            _tag(out)
        return out
    return make


def _patched_cpu(orig):
    """``t.cpu()`` is a host tensor on a GPU rank whatever ``t`` was."""
    @functools.wraps(orig)
    def cpu(self, *args, **kwargs):
        out = orig(self, *args, **kwargs)
        return _tag(out.view_as(out) if out is self else out)
    return cpu


def _device_requested(args, kwargs) -> bool:
    if kwargs.get("device") is not None:
        return True
    return bool(args) and isinstance(args[0], (torch.device, str, int, torch.Tensor))


def _patched_to(orig):
    @functools.wraps(orig)
    def to(self, *args, **kwargs):
        out = orig(self, *args, **kwargs)
        host = False
        for arg in (*args, kwargs.get("device")):  # a loop, not a generator: _names_host reads its caller's frame
            host = host or _names_host(arg)
        if host:  # .to("cpu"): a host tensor on a GPU rank
            return _tag(out.view_as(out) if out is self else out)
        if not is_host(self):
            return out
        if _device_requested(args, kwargs):
            if out is self:  # on a GPU this would be a new tensor on the device; the original stays on the host
                out = out.view_as(out) if not (out.is_leaf and out.requires_grad) else out
                if out is self:
                    setattr(self, TAG, False)
            return out
        return _tag(out) if out is not self else out
    return to


def _tensors(args, kwargs):
    for value in list(args) + list(kwargs.values()):
        if isinstance(value, torch.Tensor):
            yield value
        elif isinstance(value, (list, tuple)):
            for v in value:
                if isinstance(v, torch.Tensor):
                    yield v
                elif hasattr(v, "tensor") and hasattr(v, "peer"):  # a P2POp
                    yield v.tensor


def _group_of(args, kwargs, name):
    group = kwargs.get("group")
    if group is None:
        for value in args:
            if isinstance(value, dist.ProcessGroup):
                return value
        if name == "batch_isend_irecv" and args and args[0]:
            return args[0][0].group
    return group


def _check_device(name, args, kwargs) -> None:
    group = _group_of(args, kwargs, name)
    if isinstance(group, dist.ProcessGroup) and group in _gloo_groups:
        return
    for t in _tensors(args, kwargs):
        if is_host(t):
            raise NcclDeviceError(
                f"NCCL emulation: torch.distributed.{name} got a tensor of shape {tuple(t.shape)} created without "
                "device= (a host tensor on a GPU rank); NCCL raises 'No backend type associated with device type "
                "cpu'. Create it with device=models.backend.compute_device().")


# ------------------------------------------------------------------------------------------- p2p trace
def _channel(group) -> str:
    if _state["fake"] is not None:
        return _state["fake"]["channel"](group)
    if group is None or group is c10d.GroupMember.WORLD:
        return "world"
    return "g" + "-".join(str(r) for r in dist.get_process_group_ranks(group))


def _ranks(group):
    if group is None or group is c10d.GroupMember.WORLD:
        return list(range(dist.get_world_size()))
    return dist.get_process_group_ranks(group)


def _record(event) -> None:
    if _state["fake"] is not None or _state["rank_pid"] == os.getpid():
        _state["events"].append(event)


class _Work:
    """A request whose wait is recorded."""

    def __init__(self, work, item):
        self._work, self._item = work, item

    def wait(self, *args, **kwargs):
        _record(("wait", self._item))
        return self._work.wait(*args, **kwargs) if self._work is not None else True

    def __getattr__(self, name):
        return getattr(self._work, name)


def _new_item():
    _state["items"] += 1
    return _state["items"]


def _p2p_op(name, tensor, peer, group) -> tuple:
    kind = "send" if name in ("isend", "send") else "recv"
    return (kind, int(peer), _channel(group), int(tensor.numel()))


def _wrap_p2p(name, orig):
    @functools.wraps(orig)
    def call(tensor, *args, **kwargs):
        _check_device(name, (tensor, *args), kwargs)
        if _state["in_batch"]:
            return orig(tensor, *args, **kwargs)
        peer = kwargs.get("dst", kwargs.get("src", args[0] if args else None))
        group = kwargs.get("group", args[1] if len(args) > 1 else None)
        item = _new_item()
        _record(("post", item, [_p2p_op(name, tensor, peer, group)], "pair"))
        fake = _state["fake"]
        if fake is not None:
            fake["recv"](tensor) if name in ("irecv", "recv") else None
            work = _Work(None, item)
        else:
            work = _Work(orig(tensor, *args, **kwargs), item)
        if name in ("send", "recv"):
            work.wait()
            return None
        return work
    return call


def _wrap_batch(orig):
    @functools.wraps(orig)
    def call(p2p_op_list):
        _check_device("batch_isend_irecv", (p2p_op_list,), {})
        item = _new_item()
        ops = [_p2p_op("isend" if op.op in (dist.isend, c10d.isend) else "irecv", op.tensor, op.peer, op.group)
               for op in p2p_op_list]
        _record(("post", item, ops, "group"))
        if _state["fake"] is not None:
            for op, desc in zip(p2p_op_list, ops):
                if desc[0] == "recv":
                    _state["fake"]["recv"](op.tensor)
            return [_Work(None, item)]
        _state["in_batch"] = True
        try:
            works = orig(p2p_op_list)
        finally:
            _state["in_batch"] = False
        return [_Work(w, item) for w in works]
    return call


def _wrap_collective(name, orig):
    @functools.wraps(orig)
    def call(*args, **kwargs):
        if name not in ("all_gather_object", "broadcast_object_list", "gather_object", "scatter_object_list",
                        "barrier"):
            _check_device(name, args, kwargs)
        group = _group_of(args, kwargs, name)
        if _state["fake"] is None and dist.is_initialized():
            ranks = _ranks(group)
            if len(ranks) > 1:
                _record(("coll", _channel(group), ranks))
        return orig(*args, **kwargs)
    return call


def _wrap_new_group(orig):
    @functools.wraps(orig)
    def call(*args, **kwargs):
        group = orig(*args, **kwargs)
        backend = kwargs.get("backend", args[2] if len(args) > 2 else None)
        if isinstance(group, dist.ProcessGroup) and str(backend).lower() == "gloo":
            _gloo_groups.add(group)
        return group
    return call


def _wrap_init(orig):
    @functools.wraps(orig)
    def call(*args, **kwargs):
        out = orig(*args, **kwargs)
        _state["rank_pid"] = os.getpid()
        return out
    return call


def _write_trace() -> None:
    out = os.environ.get("LAUNCHER_P2P_TRACE")
    if not out or _state["rank_pid"] != os.getpid():
        return
    os.makedirs(out, exist_ok=True)
    rank = int(os.environ.get("RANK", "0"))
    path = os.path.join(out, f"rank-{rank}.json")
    with open(path + ".tmp", "w") as f:
        json.dump({"rank": rank, "events": _state["events"]}, f)
    os.replace(path + ".tmp", path)


def install() -> None:
    """Patch torch in this process (idempotent)."""
    if _state["installed"]:
        return
    _state["installed"] = True
    for name in FACTORIES:
        setattr(torch, name, _factory(name, getattr(torch, name)))
    torch.Tensor.to = _patched_to(torch.Tensor.to)
    torch.Tensor.cpu = _patched_cpu(torch.Tensor.cpu)
    for name in LIKE:
        setattr(torch, name, _like(getattr(torch, name)))
    for name in NEW:
        setattr(torch.Tensor, name, _like(getattr(torch.Tensor, name)))
    for name in P2P:
        wrapped = _wrap_p2p(name, getattr(c10d, name))
        setattr(dist, name, wrapped)
        setattr(c10d, name, wrapped)  # P2POp checks its op against the module's own isend/irecv
    dist.batch_isend_irecv = _wrap_batch(c10d.batch_isend_irecv)
    for name in COLLECTIVES:
        if hasattr(dist, name):
            setattr(dist, name, _wrap_collective(name, getattr(c10d, name)))
    dist.new_group = _wrap_new_group(c10d.new_group)
    dist.init_process_group = _wrap_init(c10d.init_process_group)
    atexit.register(_write_trace)


def fake_ranks(channel, recv) -> None:
    """Single-process mode for tests/_p2p_fake_rank.py: p2p ops are recorded, not sent; ``recv(tensor)`` fills
    a receive buffer; ``channel(group)`` names a group."""
    install()
    _state["fake"] = {"channel": channel, "recv": recv}
    dist.P2POp = _FakeP2POp  # the real one resolves its group's ranks, which a fake pipeline group has not
    real_backend = dist.get_backend
    # Megatron's unbatched p2p asks the pipeline group's backend (PP=2 puts one direction on WORLD unless UCC)
    dist.get_backend = lambda group=None: real_backend(group) if isinstance(group, dist.ProcessGroup) else "nccl"


class _FakeP2POp:
    def __init__(self, op, tensor, peer=None, group=None, tag=0):
        self.op, self.tensor, self.peer, self.group, self.tag = op, tensor, peer, group, tag


def take_events() -> list:
    """The events recorded so far (and forget them); item ids restart."""
    events, _state["events"], _state["items"] = _state["events"], [], 0
    return events
