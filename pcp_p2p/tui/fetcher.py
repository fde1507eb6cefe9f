"""Polling a node's status once a second, in a thread of its own.

Why a thread with its own ``trio.run`` rather than urwid's trio event loop:
``fetch_status`` opens a throwaway libp2p host per call (a Noise handshake,
~0.3 s of mostly CPU on a 2-core machine), and py-libp2p does blocking work in
places; on the UI thread that would freeze key handling. In a thread, the UI
stays responsive whatever the network does, urwid keeps its simple default
loop, and the only shared state is one result handed over through
``on_result`` (the app wakes urwid with a pipe write).

Failures back off (1, 2, 4, 5, 5... seconds) and are reported, never raised:
the screen says "disconnected, retrying" and the loop goes on until
:meth:`StatusFetcher.stop`.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

import trio

from pcp_p2p.core.errors import PcpError

log = logging.getLogger("pcp.tui")

MAX_BACKOFF_S = 5.0


@dataclass(frozen=True)
class FetchResult:
    status: dict[str, Any] | None  # the status JSON, or None on failure
    error: str | None  # what went wrong, for the screen
    at: float  # time.monotonic() when the attempt ended
    retry_in_s: float  # when the next attempt starts


FetchFn = Callable[[str], Awaitable[dict[str, Any]]]


def default_fetch(timeout: float, swarm_key: str | None) -> FetchFn:
    """The real fetch: ``/pcp/status/1.0.0`` over libp2p, as the JSON ``pcp status --json`` prints."""
    from pcp_p2p.node.status import fetch_status, to_json

    async def fetch(addr: str) -> dict[str, Any]:
        return to_json(await fetch_status(addr, timeout=timeout, swarm_key=swarm_key))

    return fetch


def backoff(failures: int, interval: float) -> float:
    """Seconds before the next attempt after ``failures`` failures in a row."""
    if failures <= 0:
        return interval
    # The exponent is capped: 2 ** 1024 as an int overflows the float product, and a
    # dashboard left watching a stopped node counts that many failures in a few hours.
    return min(MAX_BACKOFF_S, interval * 2.0 ** min(failures - 1, 64))


class StatusFetcher:
    """Calls ``fetch(addr_fn())`` every ``interval`` seconds and hands each outcome to ``on_result``.

    ``addr_fn`` is called before every attempt, so a node found through its
    data dir's ``node.addr`` is found again after it restarts on a new port.
    ``on_result`` runs on the fetcher's thread.
    """

    def __init__(
        self,
        addr_fn: Callable[[], str],
        fetch: FetchFn,
        on_result: Callable[[FetchResult], None],
        *,
        interval: float = 1.0,
    ) -> None:
        self.addr_fn = addr_fn
        self.fetch = fetch
        self.on_result = on_result
        self.interval = interval
        self._thread: threading.Thread | None = None
        self._token: trio.lowlevel.TrioToken | None = None
        self._cancel: trio.CancelScope | None = None
        self._stop = threading.Event()
        self._started = threading.Event()

    def start(self) -> None:
        self._thread = threading.Thread(target=self._run, name="pcp-status-fetcher", daemon=True)
        self._thread.start()
        self._started.wait(timeout=5)

    def stop(self, timeout: float = 5.0) -> None:
        """Cancel the poll loop (an attempt in flight included) and wait for the thread."""
        self._stop.set()
        if self._token is not None and self._cancel is not None:
            try:
                trio.from_thread.run_sync(self._cancel.cancel, trio_token=self._token)
            except trio.RunFinishedError:
                pass
        if self._thread is not None:
            self._thread.join(timeout)

    def _run(self) -> None:
        try:
            trio.run(self._main)
        except BaseException as exc:  # the thread must never die with a traceback on the screen
            log.debug("status fetcher ended: %r", exc)
        finally:
            self._started.set()

    async def _main(self) -> None:
        self._token = trio.lowlevel.current_trio_token()
        with trio.CancelScope() as scope:
            self._cancel = scope
            self._started.set()
            failures = 0
            while not self._stop.is_set():
                t0 = trio.current_time()
                status: dict[str, Any] | None = None
                error: str | None = None
                try:
                    status = await self.fetch(self.addr_fn())
                    failures = 0
                except PcpError as exc:
                    error = str(exc) or type(exc).__name__
                except Exception as exc:  # anything else is a bug, but still not a traceback on screen
                    error = f"{type(exc).__name__}: {exc}"
                if error is not None:
                    failures += 1
                wait = backoff(failures, self.interval)
                retry_in = max(0.0, t0 + wait - trio.current_time())
                self.on_result(FetchResult(status, error, time.monotonic(), retry_in))
                await trio.sleep_until(t0 + wait)
