"""Child processes die with their parent: no process of the service outlives the one that started it.

`kill -9` of `memplan serve` used to leave its multiprocessing forkserver, the resource tracker and the
ingest processes running under PID 1 (~250 MiB, holding the forkserver's pipe). Three mechanisms, Linux
only (elsewhere they do nothing):

- `die_with_parent`: the kernel sends SIGKILL to this process when its parent exits (prctl
  PR_SET_PDEATHSIG). Called in each child as it starts: uvicorn's worker processes, the forkserver (through
  `forkserver_context`, which preloads `planner_service.lifeline_forkserver` there) and every process the
  forkserver forks (pool initializers). The signal follows the thread that created the child, so it is
  armed only by children of long-lived threads (the main thread, here).
- `exit_when_gone(pid)`: a daemon thread that ends this process when `pid` exits (a pidfd becomes
  readable), for what the signal cannot express: a pool process's parent is the forkserver, not the API,
  and a parent that died before the child armed its signal.
- The resource tracker needs neither: it exits when the last holder of its pipe (the API and these
  children) is gone.
"""

from __future__ import annotations

import ctypes
import multiprocessing
import os
import select
import signal
import sys
import threading
import time
from multiprocessing.context import ForkServerContext

PR_SET_PDEATHSIG = 1
PARENT_ENV = "MEMPLAN_LIFELINE_PARENT"  # the forkserver's expected parent (set before it is started)
FORKSERVER_PRELOAD = "planner_service.lifeline_forkserver"


def die_with_parent(expected_parent: int | None = None, sig: int = signal.SIGKILL) -> None:
    """Arm the parent-death signal of this process; if the parent is already gone (it is not
    `expected_parent`), exit now."""
    if not sys.platform.startswith("linux"):
        return
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(PR_SET_PDEATHSIG, int(sig), 0, 0, 0) != 0:
        raise OSError(ctypes.get_errno(), "prctl(PR_SET_PDEATHSIG) failed")
    if expected_parent is not None and os.getppid() != expected_parent:
        os._exit(1)


def exit_when_gone(pid: int, poll_s: float = 0.5) -> threading.Thread:
    """Start a daemon thread that exits this process (status 1) when process `pid` ends."""
    try:
        fd = os.pidfd_open(pid)
    except ProcessLookupError:
        os._exit(1)
    except (AttributeError, OSError):  # no pidfd (old kernel, not Linux): look every `poll_s`
        fd = -1

    def watch() -> None:
        if fd >= 0:
            select.select([fd], [], [])  # readable once the process has exited
        else:
            while _alive(pid):
                time.sleep(poll_s)
        os._exit(1)

    thread = threading.Thread(target=watch, name=f"memplan-exit-when-{pid}-exits", daemon=True)
    thread.start()
    return thread


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def forkserver_context() -> ForkServerContext:
    """The forkserver start method, with the forkserver dying with this process: it preloads
    `lifeline_forkserver` (only that: not `__main__`, which is the CLI), which arms its parent-death signal.
    Call from the main thread (see the module docstring) before the first process is started."""
    ctx = multiprocessing.get_context("forkserver")
    os.environ[PARENT_ENV] = str(os.getpid())
    ctx.set_forkserver_preload([FORKSERVER_PRELOAD])
    return ctx


def pool_child_start(owner_pid: int) -> None:
    """Initializer of a pool process forked by the forkserver: dies with the forkserver (its parent) and
    with `owner_pid` (the process that owns the pool)."""
    die_with_parent()
    exit_when_gone(owner_pid)
