"""Each rank runs as a child of a thin supervisor, so that one rank's death is not the group's.

Measured with the mpich wheel's Hydra (``mpiexec -disable-auto-cleanup``): when a
rank process dies *by a signal* (SIGKILL, a segfault) the launcher signals every
other rank's process group with SIGUSR1, and a rank process that was talking to
the dead one does not survive it, whatever Python handler it installs; when the
process the launcher started *exits* (with any code), the others live on. So
the process the launcher starts is this supervisor: it starts the real rank as
its child (same argv, every fd inherited: ``PMI_FD`` is how the rank reaches
the launcher) in a process group of its own, forwards SIGTERM/SIGINT/SIGHUP
and the launcher's SIGUSR1 to it (exactly once: the launcher signals the
supervisor's group, which the rank is not in), and exits with the child's code,
a signal death turned into an ordinary exit code 128+N. The rank is signalled
if the supervisor itself dies (``PR_SET_PDEATHSIG``), so it is never orphaned.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from collections.abc import Sequence

RANK_CHILD_ENV = "PCP_RANK_CHILD"
"""Set in the supervised child: it is the rank itself and must not supervise again."""


def is_rank_child() -> bool:
    return os.environ.get(RANK_CHILD_ENV) == "1"


def supervise(argv: Sequence[str], *, lead: bool) -> int:
    """Run ``argv`` as the rank; its exit code (128+N for a death by signal N).

    If this supervisor dies (the launcher was SIGKILLed), rank 0 gets SIGTERM (the node
    leaves its run cleanly) and any other rank SIGKILL (it ignores SIGTERM and holds nothing).
    """
    env = dict(os.environ)
    env[RANK_CHILD_ENV] = "1"
    death = signal.SIGTERM if lead else signal.SIGKILL
    child = subprocess.Popen(list(argv), env=env, close_fds=False, process_group=0,
                             preexec_fn=lambda: _die_with_parent(death))

    def forward(signum: int, frame: object) -> None:
        try:
            child.send_signal(signum)
        except ProcessLookupError:
            pass

    for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGUSR1):
        signal.signal(sig, forward)
    while True:
        try:
            code = child.wait()
            break
        except InterruptedError:  # pragma: no cover - PEP 475 retries; kept for clarity
            continue
    # The rank is done. The launcher takes an exit without MPI_Finalize (group.py never calls it)
    # as a failure and signals the other ranks with SIGUSR1; a supervisor on its way out must
    # not die of it (Python's exit puts its own handlers back to the default, which kills).
    for sig in (signal.SIGUSR1, signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
        signal.signal(sig, signal.SIG_IGN)
    return 128 - code if code < 0 else code


def _die_with_parent(signum: int) -> None:
    """In the child before exec: ``signum`` when the supervisor dies (Linux; elsewhere nothing)."""
    try:
        import ctypes

        ctypes.CDLL(None, use_errno=True).prctl(1, int(signum))  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass


def rank_argv() -> list[str]:
    """This process's own command line, to start it again as the supervised rank."""
    return [sys.executable, *sys.orig_argv[1:]] if hasattr(sys, "orig_argv") else [sys.executable, *sys.argv]
