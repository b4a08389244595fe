"""Paths in a job: one rule for the login node and the ranks.

A relative path (``output_dir``, ``checkpoint.dir``, ``checkpoint.load``, ``checkpoint.load_hf``, the
``data.blend`` prefixes, ``data.tokenizer``, ``data.cache_dir``) is relative to the directory ``python -m
launcher`` runs in, as any path typed on a command line (``~`` is expanded). The command makes every one of them
absolute right after composing the job (``with_absolute_paths``), so validation, the data pre-flight, the
checkpoint-dir probe, render and the bundle's ``config.yaml`` all see the same absolute path, and the ranks (which
start in ``cluster.workdir``, launch.sh's ``cd``) never resolve one against their own working directory.

With ``cluster.container_image`` a relative path has no right answer: the ranks run inside the image, which does
not see the launcher's working directory unless a mount happens to map it to itself; such a path is refused
(``container_relative``), one line per field.

Standard library only: the rank wing reads the same rule (a hand-written config.yaml with a relative path is
resolved against the rank's working directory by the same ``absolute``).
"""
from __future__ import annotations

import dataclasses
import os
from typing import List, Optional, Tuple

PATH_FIELDS = ("output_dir", "checkpoint.dir", "checkpoint.load", "checkpoint.load_hf", "data.blend",
               "data.tokenizer", "data.cache_dir", "post.eval_blend")
"""Every field of the job that names a file or directory (``data.blend``, ``post.eval_blend``: their prefixes, not
their weights)."""


NAME_MAX = 255
"""Bytes in one file or directory name (Linux's NAME_MAX on ext4, xfs, Lustre, NFS): a longer part of a path makes
every call on it fail with ENAMETOOLONG."""
PATH_MAX = 4096
"""Bytes in a whole path, its terminating NUL included (Linux's PATH_MAX)."""


def length_problem(path: str) -> Optional[str]:
    """Why the file system cannot take ``path`` by its length alone (a name over NAME_MAX bytes, or the whole over
    PATH_MAX), or None."""
    for part in str(path).split("/"):
        size = len(part.encode("utf-8", "surrogateescape"))
        if size > NAME_MAX:
            return f"its part '{part[:20]}...' is {size} bytes, and a file or directory name is at most {NAME_MAX}"
    size = len(str(path).encode("utf-8", "surrogateescape"))
    if size >= PATH_MAX:
        return f"it is {size} bytes, and a path is at most {PATH_MAX - 1}"
    return None


def loop_problem(path: str) -> Optional[str]:
    """Why ``path`` can never name a file: it, or a directory above it, is a symbolic-link loop (every call on it
    fails with ELOOP, ``pathlib.Path.resolve`` raises "Symlink loop"), or None."""
    import errno

    probe = str(path)
    while True:
        try:
            os.stat(probe)
            return None
        except OSError as exc:
            if exc.errno == errno.ELOOP:
                return f"it passes through a symbolic-link loop at {probe} (no file or directory can be reached there)"
        parent = os.path.dirname(probe.rstrip("/")) or "/"
        if parent == probe:
            return None
        probe = parent


def absolute(path: str, base: Optional[str] = None) -> str:
    """``path`` with ``~`` expanded, made absolute against ``base`` (default: this process's working directory)
    and normalised (``..`` removed lexically; symbolic links are kept as they are)."""
    path = os.path.expanduser(str(path))
    return os.path.normpath(os.path.join(base if base is not None else os.getcwd(), path))


def _is_relative(path) -> bool:
    return isinstance(path, str) and bool(path) and not os.path.isabs(os.path.expanduser(path))


def _blend_prefix_slots(blend: list) -> List[int]:
    """Indices of the prefixes in ``[w, p, w, p]`` or ``[p, p]`` (a malformed blend: none; validation says why)."""
    from launcher.core.blend import parse_blend

    try:
        pairs = parse_blend(list(blend))
    except ValueError:
        return []
    return list(range(1, len(blend), 2)) if len(pairs) != len(blend) else list(range(len(blend)))


def path_values(job) -> List[Tuple[str, str]]:
    """(field, value) of every path the job names, in PATH_FIELDS order (null and empty ones left out)."""
    c, d = job.checkpoint, job.data
    out = [("output_dir", job.output_dir), ("checkpoint.dir", c.dir), ("checkpoint.load", c.load),
           ("checkpoint.load_hf", c.load_hf)]
    out += [("data.blend", d.blend[i]) for i in _blend_prefix_slots(d.blend)]
    out += [("data.tokenizer", d.tokenizer), ("data.cache_dir", d.cache_dir)]
    out += [("post.eval_blend", job.post.eval_blend[i]) for i in _blend_prefix_slots(job.post.eval_blend)]
    return [(field, str(value)) for field, value in out if value]


def with_absolute_paths(job, base: Optional[str] = None):
    """The job with every path of PATH_FIELDS absolute (see the module docstring); absolute ones unchanged."""
    def fix(value):
        return absolute(value, base) if isinstance(value, str) and value else value

    def prefixes(blend):
        blend = list(blend)
        for i in _blend_prefix_slots(blend):
            blend[i] = fix(blend[i])
        return blend

    blend = prefixes(job.data.blend)
    post = dataclasses.replace(job.post, eval_blend=prefixes(job.post.eval_blend))
    checkpoint = dataclasses.replace(job.checkpoint, dir=fix(job.checkpoint.dir), load=fix(job.checkpoint.load),
                                     load_hf=fix(job.checkpoint.load_hf))
    data = dataclasses.replace(job.data, blend=blend, tokenizer=fix(job.data.tokenizer),
                               cache_dir=fix(job.data.cache_dir))
    return dataclasses.replace(job, output_dir=fix(job.output_dir), checkpoint=checkpoint, data=data,
                               post=post)


def container_relative(job) -> List[Tuple[str, str, str, str]]:
    """With a container image: (field, value, rule, alternative) for every relative path, else []."""
    if not job.cluster.container_image:
        return []
    dsts = [str(m).split(":")[1].rstrip("/") for m in job.cluster.container_mounts if str(m).count(":") >= 1]
    mount = dsts[0] if dsts and dsts[0] else "/lustre"
    rule = ("a relative path is relative to the directory python -m launcher runs in, which the container "
            "(cluster.container_image) does not see; give an absolute path under a container mount")
    def under_mount(value):
        return f"{mount}/{os.path.normpath(value)}" if _is_relative(value) else value

    blend = "[" + ",".join(str(under_mount(x) if i in _blend_prefix_slots(job.data.blend) else x)
                           for i, x in enumerate(job.data.blend)) + "]"
    return [(field, value, rule, f"{field}={blend if field == 'data.blend' else under_mount(value)}")
            for field, value in path_values(job) if _is_relative(value)]
