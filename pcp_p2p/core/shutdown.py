"""How a ``pcp`` process stops: on SIGINT or SIGTERM, gracefully, within a bound, and at once when asked twice.

A node that was asked to stop once kept running for minutes: its trio nursery
waited for a task stuck in a non-cancellable thread (a compile, a blocking
library call), and the signal receiver that had taken the first signal kept
swallowing every later SIGINT and SIGTERM until SIGKILL. A nursery always waits
for its children, so no amount of cancelling from inside trio can bound that
wait. The bound therefore lives outside trio, in a watchdog thread:

- the **first** SIGINT or SIGTERM runs the *farewells* registered with
  :func:`add_farewell` (a node announcing its departure to its runs, so that
  rounds do not wait for it), together at most :data:`FAREWELL_S` seconds, while
  everything still runs; then it cancels the command's work (a graceful stop:
  ``finally`` blocks run, the node leaves the swarm) and wakes the watchdog;
- if the process has not exited ``grace_s`` seconds later (default
  :data:`STOP_GRACE_S`), the watchdog ends it with ``os._exit``: it is meant
  for commands that exit once it returns;
- a **second** signal ends it at once, whatever it was doing;
- a process started with :data:`PARENT_ENV` set stops as on SIGTERM once its
  parent is gone (a harness killed before its cleanup).

:func:`run_until_signal` is ``trio.run`` with that policy; the graceful case
surfaces as :class:`Interrupted`, a ``KeyboardInterrupt`` that carries the
signal, which the CLI turns into exit status 128 + signal number (130, 143).

The signal handlers are plain Python handlers, not ``trio.open_signal_receiver``:
they run on the main thread between two bytecodes even while trio's scheduler
is busy, and they only do signal-safe things (write a byte to a pipe, call
:meth:`trio.lowlevel.TrioToken.run_sync_soon`, ``os._exit``).
"""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import threading
import time
from collections.abc import Awaitable, Callable, Iterator
from types import FrameType
from typing import Any, TypeVar

import trio

log = logging.getLogger("pcp.shutdown")

STOP_GRACE_S = 10.0  # a graceful stop may take this long; then the process exits anyway
FAREWELL_S = 2.0  # farewells get this long together, out of STOP_GRACE_S
STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM)
PARENT_ENV = "PCP_STOP_WITH_PARENT"
"""Set to a process id that is its parent when it starts, a ``pcp`` process stops (as on
SIGTERM) once that process is no longer its parent: a test harness or ``pcp swarm`` killed
without its cleanup (SIGKILL, a CI timeout) must not leave nodes running. Not
``PR_SET_PDEATHSIG``: that fires when the *thread* that forked exits, and trio starts
processes from worker threads that come and go."""
ORPHAN_POLL_S = 1.0  # how often the parent is looked at

T = TypeVar("T")

_FAREWELLS: trio.lowlevel.RunVar[list[Callable[[], Awaitable[None]]]] = trio.lowlevel.RunVar("pcp_farewells")


def add_farewell(fn: Callable[[], Awaitable[None]]) -> Callable[[], None]:
    """Run ``fn`` when this process is asked to stop, before its work is cancelled; returns its remover.

    Why before: once the stop cancels the command's work, the node's network
    tasks are cancelled with it and nothing can be sent any more. Farewells run
    concurrently and are cancelled after :data:`FAREWELL_S` seconds, so a peer
    that does not answer never delays the exit by more than that. Call it inside
    :func:`run_until_signal` (outside one, e.g. in tests, nothing ever runs it).
    """
    try:
        farewells = _FAREWELLS.get()
    except LookupError:
        farewells = []
        _FAREWELLS.set(farewells)
    farewells.append(fn)

    def remove() -> None:
        if fn in farewells:
            farewells.remove(fn)

    return remove


async def _say_farewells() -> None:
    try:
        farewells = list(_FAREWELLS.get())
    except LookupError:
        return
    with trio.move_on_after(FAREWELL_S):
        async with trio.open_nursery() as nursery:
            for fn in farewells:
                nursery.start_soon(_farewell, fn)


async def _farewell(fn: Callable[[], Awaitable[None]]) -> None:
    try:
        await fn()
    except Exception:  # a farewell that failed must not keep the process from stopping
        log.debug("a farewell failed", exc_info=True)


class Interrupted(KeyboardInterrupt):
    """The command was stopped by a signal (after a graceful stop). ``signum`` says which."""

    def __init__(self, signum: int) -> None:
        super().__init__(signal.Signals(signum).name)
        self.signum = signum


def exit_status(signum: int) -> int:
    """The shell's convention for a process ended by ``signum``: 128 + its number."""
    return 128 + int(signum)


class _Stopper:
    """Signal handlers plus the watchdog thread for one :func:`run_until_signal` call."""

    def __init__(self, token: trio.lowlevel.TrioToken, asked: trio.Event, grace_s: float,
                 stopping: str, on_force: Callable[[], None] | None) -> None:
        self.token = token
        self.asked = asked
        self.grace_s = grace_s
        self.stopping = stopping
        self.on_force = on_force
        self.signum: int | None = None
        self._wake_r = self._wake_w = -1

    # -- signal context: only signal-safe calls below ------------------------------

    def _on_signal(self, signum: int, frame: FrameType | None) -> None:
        if self.signum is None:
            self.signum = signum
            os.write(self._wake_w, b"!")  # starts the watchdog's clock
            with contextlib.suppress(trio.RunFinishedError):  # trio already ending: nothing to cancel
                self.token.run_sync_soon(self._begin_stop)
            return
        name = signal.Signals(signum).name
        self._force(signum, f"pcp: {name} again: exiting now, without a clean stop\n")

    def _force(self, signum: int, message: str) -> None:
        try:
            os.write(2, message.encode())
            if self.on_force is not None:
                self.on_force()
        finally:
            os._exit(exit_status(signum))

    # -- trio context -----------------------------------------------------------------

    def _begin_stop(self) -> None:
        assert self.signum is not None
        log.info("%s: %s (send it again to exit at once; forced exit after %.0f s)",
                 signal.Signals(self.signum).name, self.stopping, self.grace_s)
        self.asked.set()  # _stop_when_asked: farewells, then the command's work is cancelled

    # -- the watchdog thread ------------------------------------------------------------

    def _watch(self) -> None:
        try:
            woken = os.read(self._wake_r, 1)
        finally:
            os.close(self._wake_r)
        if not woken:
            return  # finished without a signal
        time.sleep(self.grace_s)  # a daemon thread: a process that exits sooner just ends it
        assert self.signum is not None
        self._force(self.signum, f"pcp: error: still stopping {self.grace_s:.0f} s after "
                                 f"{signal.Signals(self.signum).name}; exiting anyway\n")

    @contextlib.contextmanager
    def installed(self) -> Iterator[None]:
        if threading.current_thread() is not threading.main_thread():
            yield  # signal handlers can only be set on the main thread
            return
        # Also when the parent set them to be ignored: a non-interactive shell starts
        # background jobs (`pcp node join &`) with SIGINT ignored, and a node that
        # keeps running after its script was Ctrl+C'ed, or after `kill -INT`, is
        # exactly the node that "cannot be stopped".
        previous = {s: signal.getsignal(s) for s in STOP_SIGNALS}
        self._wake_r, self._wake_w = os.pipe()
        threading.Thread(target=self._watch, name="pcp-stop-watchdog", daemon=True).start()
        parent = watched_parent(os.environ.pop(PARENT_ENV, None), os.getppid())  # (its children do not inherit it)
        if parent is not None:
            threading.Thread(target=_stop_when_orphaned, args=(parent,), name="pcp-parent-watch",
                             daemon=True).start()
        for s in previous:
            signal.signal(s, self._on_signal)
        try:
            yield
        finally:
            for s, handler in previous.items():
                signal.signal(s, handler if handler is not None else signal.SIG_DFL)
            # A watchdog still waiting for a signal reads EOF and ends; one that was
            # woken keeps counting until the process is gone, so that what comes after
            # trio (threads joined at exit, atexit hooks) is bounded too.
            os.close(self._wake_w)


def watched_parent(value: str | None, ppid: int) -> int | None:
    """The parent to stop with, from :data:`PARENT_ENV`'s ``value``: only the process that is this
    one's parent now. A launcher in between (``mpiexec``, which passes the environment on to
    its ranks) turns it off, or every rank would take itself for an orphan and stop at once."""
    return ppid if value is not None and value.isdigit() and int(value) == ppid else None


def _stop_when_orphaned(parent: int) -> None:
    """SIGTERM to this process (a graceful, bounded stop) once ``parent`` is not its parent."""
    while os.getppid() == parent:
        time.sleep(ORPHAN_POLL_S)
    log.warning("the process that started this one (%d) is gone: stopping", parent)
    os.kill(os.getpid(), signal.SIGTERM)


async def _supervise(
    async_fn: Callable[..., Awaitable[T]], args: tuple[Any, ...], grace_s: float, stopping: str,
    on_force: Callable[[], None] | None,
) -> T:
    scope = trio.CancelScope()
    asked = trio.Event()
    stopper = _Stopper(trio.lowlevel.current_trio_token(), asked, grace_s, stopping, on_force)
    with stopper.installed():
        try:
            # A system task, not a nursery: what async_fn raises must reach the caller as it is
            # (not wrapped in an ExceptionGroup), and trio cancels the task when the run ends.
            trio.lowlevel.spawn_system_task(_stop_when_asked, asked, scope)
            with scope:
                return await async_fn(*args)
        except BaseException:
            if stopper.signum is None:
                raise
            # Asked to stop: what broke while stopping is not the user's news.
            log.debug("error while stopping after %s", signal.Signals(stopper.signum).name, exc_info=True)
    assert stopper.signum is not None  # only a signal cancels ``scope``
    raise Interrupted(stopper.signum)


async def _stop_when_asked(asked: trio.Event, scope: trio.CancelScope) -> None:
    await asked.wait()
    await _say_farewells()
    scope.cancel()


def run_until_signal(
    async_fn: Callable[..., Awaitable[T]],
    *args: Any,
    grace_s: float = STOP_GRACE_S,
    stopping: str = "stopping",
    on_force: Callable[[], None] | None = None,
) -> T:
    """``trio.run(async_fn, *args)``, stopped gracefully by SIGINT/SIGTERM within ``grace_s``.

    Returns what ``async_fn`` returns. After a signal, ``async_fn`` is cancelled
    and :class:`Interrupted` is raised once it has unwound; a second signal, or
    ``grace_s`` seconds after the first without the process having exited, ends
    the process with status 128 + signal after calling ``on_force`` (keep it tiny: it runs in a signal handler
    or the watchdog thread, e.g. removing an address file). ``stopping`` is the
    log line's verb ("leaving the swarm").
    """

    async def supervised() -> T:  # a closure, so the type checker infers T (it cannot through trio.run's *args)
        return await _supervise(async_fn, args, grace_s, stopping, on_force)

    return trio.run(supervised)
