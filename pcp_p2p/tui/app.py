"""``pcp status`` on a terminal: the view, the fetcher and urwid's main loop.

The fetcher thread hands each result over through a one-slot box and wakes
urwid with a write to a pipe urwid watches (``MainLoop.watch_pipe``): the view
is only ever touched on urwid's thread. A one-second alarm redraws the
countdowns (round deadline, lease, "stale for") between results.
"""

from __future__ import annotations

import logging
import os
import threading
import warnings
from collections.abc import Callable

import urwid

from pcp_p2p.tui.fetcher import FetchFn, FetchResult, StatusFetcher, default_fetch
from pcp_p2p.tui.fmt import Style
from pcp_p2p.tui.view import PALETTE, StatusView

TICK_S = 1.0


class _Latest:
    """The newest fetch result, handed from the fetcher thread to urwid's."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._value: FetchResult | None = None

    def put(self, value: FetchResult) -> None:
        with self._lock:
            self._value = value

    def take(self) -> FetchResult | None:
        with self._lock:
            value, self._value = self._value, None
            return value


def apply_result(view: StatusView, result: FetchResult) -> None:
    if result.status is not None:
        view.apply_status(result.status, at=result.at)
    else:
        view.apply_error(result.error or "unknown error", retry_in_s=result.retry_in_s, at=result.at)


def run_tui(
    addr_fn: Callable[[], str],
    *,
    target: str,
    timeout: float = 5.0,
    swarm_key: str | None = None,
    fetch: FetchFn | None = None,
    style: Style | None = None,
) -> int:
    """Run the dashboard until ``q``; returns the exit code (0)."""
    style = style or Style.detect(encoding=urwid.util.get_encoding())
    view = StatusView(target, style)
    screen = urwid.display.raw.Screen()
    screen.set_terminal_properties(colors=style.colors)
    loop = urwid.MainLoop(view, palette=PALETTE, screen=screen, handle_mouse=False)
    latest = _Latest()

    def on_wake(_data: bytes) -> bool:
        result = latest.take()
        if result is not None:
            apply_result(view, result)
        return True

    wake_fd = loop.watch_pipe(on_wake)

    def on_result(result: FetchResult) -> None:  # fetcher thread
        latest.put(result)
        try:
            os.write(wake_fd, b".")
        except OSError:
            pass  # the loop has ended and closed the pipe

    def tick(main_loop: urwid.MainLoop, _user_data: object) -> None:
        view.refresh()
        main_loop.set_alarm_in(TICK_S, tick)

    fetcher = StatusFetcher(addr_fn, fetch or default_fetch(timeout, swarm_key), on_result, interval=1.0)
    loop.set_alarm_in(TICK_S, tick)
    # stderr is the same terminal urwid draws on: a log line or a warning printed
    # there would tear the screen, so both are off while it is up.
    logging.disable(logging.CRITICAL)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        fetcher.start()
        try:
            loop.run()
        except KeyboardInterrupt:
            pass
        finally:
            fetcher.stop()
            loop.remove_watch_pipe(wake_fd)
            logging.disable(logging.NOTSET)
    return 0
