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

Which protocol the control bytes belong to (:class:`ProtocolTraffic`) is
counted one layer up, on each libp2p stream: the payload each protocol's
streams carry (its multistream negotiation included) and how many streams it
opened. Noise and yamux framing sit below the streams, so the connections'
total minus the protocols' sum is the framing.

The counters are plain ints bumped from trio tasks and from blob worker
threads; an increment of a Python int attribute is not atomic across threads
in theory, so each side holds a lock (cheap next to a socket call).
"""

from __future__ import annotations

import threading
import weakref
from typing import Any

from libp2p.abc import IHost, INetConn, INetStream, INetwork, INotifee
from multiaddr import Multiaddr


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
        self.protocols: ProtocolTraffic | None = None  # the whole's split by stream protocol, when counted

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
    """Count every connection ``host`` upgrades from now on into ``traffic``, and split its
    streams' bytes by protocol into ``traffic.protocols``.

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
    traffic.protocols = ProtocolTraffic()
    host.get_network().register_notifee(traffic.protocols)


UNNEGOTIATED = "(unnegotiated)"
"""The bucket of a stream that closed before any protocol was agreed on it."""


class _StreamCount:
    """One stream's bytes: held back until its protocol is known, then counted into that protocol's.

    It holds no reference to its stream (the stream is passed in): it is the value of a
    weak-keyed map whose key is the stream, and a value that held its key would keep both."""

    def __init__(self, owner: ProtocolTraffic) -> None:
        self.owner = owner
        self.pending = [0, 0]  # bytes in / out before the protocol was known
        self.bucket: list[int] | None = None

    def settle(self, stream: INetStream) -> list[int] | None:
        if self.bucket is None and (protocol := stream.get_protocol()) is not None:
            self.bucket = self.owner.add(str(protocol), 1, *self.pending)
        return self.bucket

    def count(self, stream: INetStream, n_in: int, n_out: int) -> None:
        bucket = self.settle(stream)
        if bucket is None:
            self.pending[0] += n_in
            self.pending[1] += n_out
        else:
            bucket[1] += n_in
            bucket[2] += n_out


class ProtocolTraffic(INotifee):
    """Stream payload bytes (both directions) and streams opened, per libp2p protocol id.

    Why: "control traffic grows with the round's length" does not say which of
    the DHT, gossipsub, membership, leases, heartbeats or the round's messages
    to make cheaper (issue #15's shepherd bytes). A network notifee sees every
    stream of the host (dialled or accepted, PCP's own and libp2p's) as it is
    opened, before its protocol is negotiated, and counts what passes through
    that stream's ``read``/``write``. The bytes go to the stream's protocol once
    one is set; the negotiation's, exchanged before that, are added to it then
    (or to :data:`UNNEGOTIATED` if the stream closes without one). Only trio
    tasks on the host's loop touch it."""

    def __init__(self) -> None:
        self.counts: dict[str, list[int]] = {}  # protocol -> [streams, bytes_in, bytes_out]
        self._open: weakref.WeakKeyDictionary[INetStream, _StreamCount] = weakref.WeakKeyDictionary()

    def add(self, protocol: str, streams: int, n_in: int, n_out: int) -> list[int]:
        bucket = self.counts.setdefault(protocol, [0, 0, 0])
        bucket[0] += streams
        bucket[1] += n_in
        bucket[2] += n_out
        return bucket

    async def opened_stream(self, network: INetwork, stream: INetStream) -> None:
        counted = self._open[stream] = _StreamCount(self)
        read, write = stream.read, stream.write

        # (These closures refer to the stream and live on it: a cycle the collector frees with it.)
        async def counting_read(n: int | None = None) -> bytes:
            data = await read(n)
            counted.count(stream, len(data), 0)
            return data

        async def counting_write(data: bytes) -> None:
            await write(data)
            counted.count(stream, 0, len(data))

        # Instance attributes shadow NetStream's methods, for this stream alone.
        stream.read = counting_read  # type: ignore[method-assign]
        stream.write = counting_write  # type: ignore[method-assign]

    async def closed_stream(self, network: INetwork, stream: INetStream) -> None:
        counted = self._open.pop(stream, None)
        if counted is not None and counted.settle(stream) is None and any(counted.pending):
            self.add(UNNEGOTIATED, 1, *counted.pending)

    async def connected(self, network: INetwork, conn: INetConn) -> None:
        pass

    async def disconnected(self, network: INetwork, conn: INetConn) -> None:
        pass

    async def listen(self, network: INetwork, multiaddr: Multiaddr) -> None:
        pass

    async def listen_close(self, network: INetwork, multiaddr: Multiaddr) -> None:
        pass

    def snapshot(self) -> dict[str, dict[str, int]]:
        """``{protocol: {"streams", "bytes_in", "bytes_out"}}``, as status reports it."""
        return {p: {"streams": c[0], "bytes_in": c[1], "bytes_out": c[2]} for p, c in sorted(self.counts.items())}
