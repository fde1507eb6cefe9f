"""Bytes a node moves: everything on its libp2p connections, plus blob side channels.

Why count here and not in each protocol: the operator's question is "how much
is this node sending and receiving", and most of it is not PCP's own messages
(Kademlia, gossipsub heartbeats, Noise and yamux framing). py-libp2p 0.8.1 has
no per-host byte counter, so the counting sits under the security upgrade:
every raw connection a host upgrades (dialled or accepted) gets its byte
stream wrapped, before Noise, so the figures are bytes on the wire. Bulk blob
data bypasses libp2p on an AES-GCM side socket (``pcp_p2p.blob``), which
reports its records into a part of the whole (``Traffic(parent=...)``), so
status tells bulk data from control traffic.

The counters are plain ints bumped from trio tasks and from blob worker
threads; an increment of a Python int attribute is not atomic across threads
in theory, so each side holds a lock (cheap next to a socket call).
"""

from __future__ import annotations

import threading
from typing import Any

from libp2p.abc import IHost


class Traffic:
    """Monotonic byte counters (both directions) of one node, or of one part of its traffic.

    A part (``parent`` given: the blob side channels) counts into the whole as well, so the
    whole is every byte and the part says how much of it was bulk data; the rest is control
    (messages, heartbeats, the DHT, membership), which is what grows with the swarm."""

    def __init__(self, parent: Traffic | None = None) -> None:
        self._lock = threading.Lock()
        self.parent = parent
        self.bytes_in = 0
        self.bytes_out = 0

    def received(self, n: int) -> None:
        with self._lock:
            self.bytes_in += n
        if self.parent is not None:
            self.parent.received(n)

    def sent(self, n: int) -> None:
        with self._lock:
            self.bytes_out += n
        if self.parent is not None:
            self.parent.sent(n)

    def snapshot(self) -> dict[str, int]:
        with self._lock:
            return {"bytes_in": self.bytes_in, "bytes_out": self.bytes_out}


class _CountingStream:
    """A raw connection's byte stream that reports what passes through it."""

    def __init__(self, inner: Any, traffic: Traffic) -> None:
        self._inner = inner
        self._traffic = traffic

    async def read(self, n: int | None = None) -> bytes:
        data: bytes = await self._inner.read(n)
        self._traffic.received(len(data))
        return data

    async def write(self, data: bytes) -> None:
        await self._inner.write(data)
        self._traffic.sent(len(data))

    def __getattr__(self, name: str) -> Any:  # close, get_remote_address, ...
        return getattr(self._inner, name)


def count_host_traffic(host: IHost, traffic: Traffic) -> None:
    """Count every connection ``host`` upgrades from now on into ``traffic``.

    Patches this host's upgrader instance only (other hosts in the process,
    as in tests, keep their own counts). A raw connection without a ``stream``
    attribute (a transport other than py-libp2p's TCP) is left uncounted.
    """
    # py-libp2p's INetwork does not declare the upgrader its Swarm has.
    upgrader = host.get_network().upgrader  # type: ignore[attr-defined]
    original = upgrader.upgrade_security

    async def upgrade_security(raw_conn: Any, is_initiator: bool, peer_id: Any = None) -> Any:
        stream = getattr(raw_conn, "stream", None)
        if stream is not None and not isinstance(stream, _CountingStream):
            raw_conn.stream = _CountingStream(stream, traffic)
        return await original(raw_conn, is_initiator, peer_id)

    upgrader.upgrade_security = upgrade_security
