"""A directory lock that cannot have two holders: ``LOCK`` appears only with its owner already in it.

Taking it (``take``):

1. The owner record is written to a private temporary file beside ``LOCK`` and flushed to disk.
2. ``os.link(tmp, LOCK)`` publishes it: link(2) creates the name atomically and fails with EEXIST when it exists,
   on local file systems and on NFS alike (the classic NFS-safe lock; O_EXCL was not atomic on NFSv2). So
   ``LOCK`` never exists empty or half-written, and of any number of simultaneous contenders exactly one link
   succeeds.
3. Whoever finds ``LOCK`` taken reads its owner. Replacing a stale one (its owner is gone, by the caller's rule)
   is the only step that removes somebody else's ``LOCK``; it runs under an ``fcntl.lockf`` lock on
   ``LOCK.guard`` (the owner is re-read under it, so two contenders that both judged the same ``LOCK`` stale
   cannot both remove it: the second one re-reads the first one's fresh ``LOCK``). Releasing takes the guard too.
   The kernel drops the guard when its process dies, so the guard itself is never stale.

Failure modes, by file system:

- Local file systems, NFSv3 with lockd and NFSv4: both steps are atomic; exactly one holder.
- A file system without hard links (some FUSE and SMB mounts): ``O_CREAT | O_EXCL`` with the record written
  straight after; a reader that finds it empty or unreadable treats it as held while it is younger than
  ``young_s`` (its writer may be between the create and the write), so it is still never taken twice, but a
  writer killed in that instant leaves a ``LOCK`` that blocks the directory for ``young_s`` seconds.
- A file system where ``lockf`` is refused (Lustre mounted ``noflock``; ENOLCK, ENOSYS, EOPNOTSUPP): the stale
  ``LOCK`` is renamed to a private name (rename is atomic: one contender wins it), checked to be the very file
  judged stale (same inode), and put back if it was not. Two holders remain possible only if a third run takes
  the directory in the microseconds between a rename and its check. Lustre mounted ``localflock`` makes the
  guard node-local: contenders on different nodes are then protected only by the ``LOCK`` file's own atomicity.

Standard library only (both wings may read it); rank 0 of a run holds the checkpoint directory's lock
(``launcher.rank.checkpoint.store.DirLock``), taken before the model is built.
"""
from __future__ import annotations

import errno
import json
import os
import socket
import time
import uuid
from contextlib import contextmanager
from pathlib import Path
from typing import Callable, Optional

GUARD_SUFFIX = ".guard"
_NO_LOCKF = (errno.ENOLCK, errno.ENOSYS, errno.EOPNOTSUPP, errno.EINVAL, errno.EBADF)
_NO_LINK = (errno.EPERM, errno.ENOTSUP, errno.EOPNOTSUPP, errno.EXDEV, errno.EMLINK)


def pid_alive(pid: int) -> bool:
    """A running process (same host). A zombie is not: it was killed and only waits for its parent to reap it
    (a rank SIGKILLed with its torchrun is re-parented to init, which may take a second or two to reap it; a run
    started again at once must not read its lock as held)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    try:
        with open(f"/proc/{pid}/stat") as fh:  # "pid (comm) state ...": comm may hold spaces and parentheses
            return fh.read().rsplit(")", 1)[1].split()[0] != "Z"
    except (OSError, IndexError):
        return True  # no /proc (not Linux): kill(pid, 0) answered


def owner_gone(owner: dict, age_s: float, *, stale_s: float) -> bool:
    """A holder that is gone: its process is dead (same host), it is this Slurm job (a requeue or a torchrun
    restart of it), or it was not refreshed for ``stale_s`` seconds (another host: its node died)."""
    if owner.get("job") and owner.get("job") == os.environ.get("SLURM_JOB_ID"):
        return True
    if owner.get("host") == socket.gethostname():
        try:
            pid = int(owner.get("pid", 0))
        except (TypeError, ValueError):
            return age_s > stale_s
        return pid <= 0 or pid == os.getpid() or not pid_alive(pid)
    return age_s > stale_s


def read_owner(path: Path) -> Optional[tuple]:
    """(owner dict or None when unreadable, age in seconds, inode) of ``path``, or None when there is none."""
    try:
        st = os.stat(path)
        with open(path) as fh:
            text = fh.read()
    except FileNotFoundError:
        return None
    try:
        owner = json.loads(text)
        owner = owner if isinstance(owner, dict) else None
    except ValueError:
        owner = None
    return owner, time.time() - st.st_mtime, st.st_ino


@contextmanager
def guard(path: Path):
    """Exclusive ``lockf`` on ``path + '.guard'`` for the block; yields False where the file system refuses it."""
    fd = os.open(f"{path}{GUARD_SUFFIX}", os.O_CREAT | os.O_RDWR, 0o644)
    try:
        import fcntl

        try:
            fcntl.lockf(fd, fcntl.LOCK_EX)
        except OSError as exc:
            if exc.errno not in _NO_LOCKF:
                raise
            yield False
            return
        try:
            yield True
        finally:
            fcntl.lockf(fd, fcntl.LOCK_UN)
    finally:
        os.close(fd)


def _publish(path: Path, text: str) -> bool:
    """Create ``path`` holding ``text`` atomically; False if it exists already."""
    tmp = path.with_name(f".{path.name}.{os.getpid()}.{uuid.uuid4().hex}")
    fd = os.open(tmp, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
    try:
        with os.fdopen(fd, "w") as fh:
            fh.write(text)
            fh.flush()
            os.fsync(fh.fileno())
        try:
            os.link(tmp, path)
            return True
        except FileExistsError:
            return False
        except OSError as exc:
            if exc.errno not in _NO_LINK:
                raise
        return _publish_excl(path, text)
    finally:
        try:
            os.unlink(tmp)
        except FileNotFoundError:
            pass


def _publish_excl(path: Path, text: str) -> bool:
    """The fallback without hard links: O_EXCL, then the record (see the module's failure modes)."""
    try:
        fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
    except FileExistsError:
        return False
    with os.fdopen(fd, "w") as fh:
        fh.write(text)
        fh.flush()
        os.fsync(fh.fileno())
    return True


def _remove_if_same(path: Path, inode: int, guarded: bool) -> None:
    """Remove the stale ``LOCK`` whose inode was judged; without a guard, by an atomic rename and a check."""
    if guarded:
        os.unlink(path)
        return
    aside = path.with_name(f".{path.name}.stale.{os.getpid()}.{uuid.uuid4().hex}")
    try:
        os.rename(path, aside)
    except FileNotFoundError:
        return  # another contender moved it first
    if os.stat(aside).st_ino != inode:  # we moved a newer holder's LOCK: give it back
        try:
            os.link(aside, path)
        except FileExistsError:
            pass
    os.unlink(aside)


def take(path: Path, owner: dict, is_stale: Callable[[dict, float], bool], *, young_s: float = 60.0,
         attempts: int = 5) -> Optional[dict]:
    """Take the lock ``path`` for ``owner``: None when taken, else the record of the live holder ({} when it is
    unreadable and young). ``is_stale(owner, age_s)`` says when a holder is gone."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    text = json.dumps(owner) + "\n"
    holder: dict = {}
    for _ in range(attempts):
        if _publish(path, text):
            return None
        with guard(path) as guarded:
            seen = read_owner(path)
            if seen is None:
                continue  # released meanwhile: publish again
            holder, age, inode = seen
            if holder is None:  # empty or torn: a fallback writer in its first instant, or one killed there
                if age < young_s:
                    return {}
            elif not is_stale(holder, age):
                return holder
            _remove_if_same(path, inode, guarded)
    return holder


def release(path: Path, owner: dict) -> None:
    """Remove ``path`` if it is still ``owner``'s (same host, pid and token)."""
    path = Path(path)
    try:
        with guard(path):
            seen = read_owner(path)
            if seen and seen[0] and all(seen[0].get(k) == owner.get(k) for k in ("host", "pid", "token")):
                os.unlink(path)
    except OSError:
        pass
