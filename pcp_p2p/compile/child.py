"""The child processes a compile runs (``iree-compile``, the JAX lowering), stoppable at once.

A compile runs in a worker thread, and nothing outside can stop a thread; what
it waits on, though, can be a process, and a process can be killed. So every
expensive step of a build runs as a child: the compiler always did, and the
JAX lowering does when the build can be cancelled (a node's shepherd set-up).
The lowering gains twice from it: a node that lost the election no longer
traces a training step for seconds after the loss, and tracing (pure Python,
holding the GIL) no longer starves the trio thread that renews leases and
answers probes while it runs.

Children run at low priority (``nice``: :mod:`pcp_p2p.core.priority` says why),
read their input from stdin in one piece, and are killed on every way out:
error, timeout, cancel.
"""

from __future__ import annotations

import subprocess
import threading

from pcp_p2p.core.errors import CompileCancelled, CompileError
from pcp_p2p.core.priority import COMPILE_NICENESS, low_priority

CANCEL_POLL_S = 0.2  # how often a running child's cancel flag is looked at


def run_child(
    cmd: list[str], data: bytes, *, what: str, timeout: float,
    cancel: threading.Event | None = None, env: dict[str, str] | None = None,
) -> tuple[int, bytes, bytes]:
    """Run ``cmd`` at low priority with ``data`` on stdin; ``(returncode, stdout, stderr)``.

    :class:`CompileCancelled` once ``cancel`` is set (the child killed within
    :data:`CANCEL_POLL_S`), :class:`CompileError` if it cannot start or runs past
    ``timeout``. ``what`` names the child in those errors.
    """
    try:
        proc = subprocess.Popen([*low_priority(COMPILE_NICENESS), *cmd], stdin=subprocess.PIPE,
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env)
    except OSError as exc:
        raise CompileError(f"cannot run {what}: {exc}") from exc
    finished = threading.Event()

    def kill_when_cancelled() -> None:
        # communicate() must get the input in one call (a retry after a timeout
        # would not send the rest), so the cancel flag is watched from here
        assert cancel is not None
        while not finished.wait(CANCEL_POLL_S):
            if cancel.is_set():
                proc.kill()
                return

    if cancel is not None:
        threading.Thread(target=kill_when_cancelled, name=f"{what}-cancel", daemon=True).start()
    try:
        out, err = proc.communicate(data, timeout=timeout)
    except subprocess.TimeoutExpired:
        raise CompileError(f"{what} timed out after {timeout:.0f} s") from None
    finally:
        finished.set()
        if proc.returncode is None:
            proc.kill()
            proc.wait()
    if cancel is not None and cancel.is_set():
        raise CompileCancelled(f"{what} stopped: the compile is not needed any more")
    return proc.returncode, out, err
