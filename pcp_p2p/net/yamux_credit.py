"""Yamux receive credit the way go-yamux grants it: once half the window is used, not on every read.

py-libp2p 0.8.1's ``YamuxStream._auto_tune_and_send_window_update`` sends a
WINDOW_UPDATE frame after almost every ``read``, however small (its "partial
slack" and "release on read" branches). Its own varint readers read one
byte at a time, so a KAD request/response cost ~16 window-update frames on top
of ~8 data frames: each one Noise-encrypted, written, and a wake-up of the
other process. On a loaded 2-core machine those frames were most of a DHT
operation's cost (measured: 27 -> 9 frames and ~45% less CPU per KAD RPC).

:func:`install` replaces that method with go-yamux's rule (``sendWindowUpdate``
with its GrowTo hysteresis): grant credit when the window has room for at
least half of its target again, then top it up to the target (and let the
library's auto-tuning double the target as before). Flow control stays
correct: a sender blocked on a full window is unblocked as soon as the reader
has consumed half of it, exactly as against a Go peer. The wire format is
unchanged, so patched and unpatched peers interoperate.
"""

from __future__ import annotations

from libp2p.stream_muxer.yamux.yamux import YamuxStream

_ORIGINAL = YamuxStream._auto_tune_and_send_window_update


async def _grant_credit_in_halves(self: YamuxStream, *, bytes_read: int = 0) -> None:
    """go-yamux ``sendWindowUpdate``: no frame until the missing credit reaches half the target."""
    increment = 0
    async with self.window_lock:
        buffered = len(self.conn.stream_buffers.get(self.stream_id, b""))
        missing = self.target_recv_window - (self.recv_window + buffered)
        if missing > 0 and missing >= self._grow_threshold():
            increment = self._grow_to_delta(buffered) + self._apply_autotune_epoch(buffered)
            self._pending_recv_release = 0
    if increment > 0:
        await self.send_window_update(increment, skip_lock=True)


def install() -> None:
    """Use go-yamux's credit rule in this process (idempotent)."""
    # A deliberate monkey-patch of py-libp2p's method: mypy forbids assigning to methods.
    YamuxStream._auto_tune_and_send_window_update = _grant_credit_in_halves  # type: ignore[method-assign]


def uninstall() -> None:
    """Back to py-libp2p's own rule (for tests comparing the two)."""
    YamuxStream._auto_tune_and_send_window_update = _ORIGINAL  # type: ignore[method-assign]  # see install()


def installed() -> bool:
    return YamuxStream._auto_tune_and_send_window_update is _grant_credit_in_halves
