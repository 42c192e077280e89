"""Child processes that may start a local Ray (the Daft peer, the Spark SQL modes): run in a
session of their own, so a timeout ends the child and everything it started.

Killing the child alone (what ``subprocess.run(timeout=...)`` does) left its Ray's GCS,
raylet and workers running, re-parented to PID 1, holding cores and shared memory for the
rest of the suite. Ray starts them in its driver's process group (no ``setsid``), so a
``killpg`` of the child's own group reaches them.
"""

from __future__ import annotations

import os
import signal
import subprocess
from typing import Any

# How long to wait, after killing a timed-out group, for the child's pipes to close.
KILL_WAIT_S = 30.0


def run_own_group(cmd: list[str], timeout: float, **popen: Any
                  ) -> subprocess.CompletedProcess:
    """``subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, **popen)``,
    with the child in a new session. Past ``timeout`` (or on any interruption, e.g.
    Ctrl-C) the child's whole process group is killed and waited for (at most
    ``KILL_WAIT_S``), then ``subprocess.TimeoutExpired`` (or the interruption) is raised."""
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            start_new_session=True, **popen)
    try:
        stdout, stderr = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        stdout, stderr = _kill_group(proc)
        raise subprocess.TimeoutExpired(cmd, timeout, stdout, stderr) from None
    except BaseException:
        _kill_group(proc)
        raise
    return subprocess.CompletedProcess(cmd, proc.returncode, stdout, stderr)


def _kill_group(proc: subprocess.Popen) -> tuple[str | None, str | None]:
    """SIGKILL the group ``proc`` leads (its pgid is its pid: ``start_new_session``), then
    collect what it wrote; bounded, as a process that left the group may hold the pipes."""
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:  # the group is gone already
        pass
    try:
        return proc.communicate(timeout=KILL_WAIT_S)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()
        for pipe in (proc.stdout, proc.stderr):
            if pipe is not None:
                pipe.close()
        return None, None
