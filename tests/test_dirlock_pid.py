"""launcher.core.checkpoint.dirlock.pid_alive: a killed process that its parent has not reaped yet (a zombie) is gone, so a run
started again at once may take the lock of a run that was just killed."""
from __future__ import annotations

import os
import signal
import socket
import subprocess
import time

from launcher.core.checkpoint import dirlock


def test_a_zombie_is_not_alive_and_a_running_process_is():
    child = subprocess.Popen(["sleep", "60"])
    try:
        assert dirlock.pid_alive(child.pid)
        os.kill(child.pid, signal.SIGKILL)
        for _ in range(200):  # not reaped (no wait()): it stays a zombie; wait until the kernel has made it one
            with open(f"/proc/{child.pid}/stat") as fh:
                if fh.read().rsplit(")", 1)[1].split()[0] == "Z":
                    break
            time.sleep(0.05)
        assert not dirlock.pid_alive(child.pid)
        assert dirlock.owner_gone({"host": socket.gethostname(), "pid": child.pid}, 0.0, stale_s=600)
    finally:
        child.kill()
        child.wait()
    assert not dirlock.pid_alive(child.pid)
    assert dirlock.pid_alive(os.getpid())
