"""The suite's hang detectors wait on progress and say what they were waiting for (issue 25): the rank harness'
``communicate_on_progress`` (every torchrun the tests start) stops a process group that prints nothing, and
returns normally for one that ends."""
from __future__ import annotations

import subprocess
import sys

import pytest

from _rank_harness import communicate_on_progress

SILENT_CHILD = "import subprocess, sys, time; print('started', flush=True); " \
               "subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(600)']); time.sleep(600)"


def test_a_silent_process_group_is_stopped_and_named():
    proc = subprocess.Popen([sys.executable, "-c", SILENT_CHILD], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, start_new_session=True)
    with pytest.raises(AssertionError, match=r"^hang: the silent child printed nothing for 1 s \(last line: "
                                             r"started\)"):
        communicate_on_progress(proc, 1, "the silent child")
    assert proc.returncode == -9  # SIGKILLed (its whole process group, the grandchild too)


def test_a_process_that_ends_returns_its_output():
    proc = subprocess.Popen([sys.executable, "-c", "import sys; print('out'); print('err', file=sys.stderr)"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True)
    assert communicate_on_progress(proc, 600, "a short child") == ("out\n", "err\n")
    assert proc.returncode == 0
