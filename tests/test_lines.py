"""Lines (``/pcp/line/1.0.0``, ``Messenger.post``): one kept stream per peer for small, frequent
messages (heartbeats), over real libp2p on 127.0.0.1, and what a stranger's lines are refused."""

from __future__ import annotations

import struct
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

import multiaddr
import trio
from libp2p import new_host
from libp2p.abc import INetStream
from libp2p.peer.peerinfo import info_from_p2p_addr

from pcp_p2p.core.errors import PeerTimeout
from pcp_p2p.core.identity import Identity
from pcp_p2p.net.budget import RATE_TOTAL, Rate, RateLimits
from pcp_p2p.node.messaging import LINE_PROTOCOL
from pcp_p2p.wire import Message, encode, wire_message


@wire_message("test.line.ping", max_size=256)
class LinePing(Message):
    seq: int


@wire_message("test.line.other", max_size=256)
class NotForLines(Message):
    seq: int


def frame(msg: Message) -> bytes:
    data = encode(msg)
    return struct.pack(">I", len(data)) + data


@asynccontextmanager
async def stranger_line(target_addr: str) -> AsyncIterator[INetStream]:
    """A line from a fresh key, opened by hand (no Messenger: it writes whatever the test says)."""
    info = info_from_p2p_addr(multiaddr.Multiaddr(target_addr))
    host = new_host(key_pair=Identity.generate().key_pair)
    async with host.run(listen_addrs=[]):
        await host.connect(info)
        yield await host.new_stream(info.peer_id, [LINE_PROTOCOL])


async def ended(stream: INetStream) -> None:
    """Return once the node has closed or reset ``stream`` (it never writes on a line)."""
    with trio.fail_after(10):
        while True:
            try:
                if not await stream.read(1024):
                    return
            except Exception:
                return


class Inbox(list[tuple[str, Message]]):
    """What a node's handler got, with a wait on the count (an event per arrival, no polling)."""

    def __init__(self, node) -> None:
        super().__init__()
        self._arrived = trio.Event()
        node.messenger.register((LinePing,), self.handler, line=True)
        node.messenger.register((NotForLines,), self.handler)  # a direct message only

    async def handler(self, sender: str, msg: Message) -> None:
        self.append((sender, msg))
        self._arrived.set()
        self._arrived = trio.Event()

    async def wait_for(self, n: int, timeout: float = 10) -> None:
        with trio.fail_after(timeout):
            while len(self) < n:
                await self._arrived.wait()


async def test_posts_arrive_in_order_on_one_kept_stream(swarm3) -> None:
    _boot, a, b = swarm3
    got = Inbox(b)
    # one post at a time per peer: a second one while the first is in flight is dropped, not queued
    outcomes: list[str] = []

    async def one(seq: int) -> None:
        try:
            await a.messenger.post(b.peer_id, LinePing(seq=seq))
            outcomes.append("posted")
        except PeerTimeout:
            outcomes.append("dropped")

    async with trio.open_nursery() as nursery:
        nursery.start_soon(one, -1)
        nursery.start_soon(one, -2)
    assert sorted(outcomes) == ["dropped", "posted"]
    await got.wait_for(1)
    got.clear()
    for seq in range(30):
        await a.messenger.post(b.peer_id, LinePing(seq=seq))
    await got.wait_for(30)
    assert [m.seq for _, m in got] == list(range(30))  # type: ignore[attr-defined]
    assert {s for s, _ in got} == {a.peer_id}
    # one stream carried all thirty, both ends say so
    assert b.status().network["protocol_bytes"][LINE_PROTOCOL]["streams"] == 1
    assert a.status().network["protocol_bytes"][LINE_PROTOCOL]["streams"] == 1


async def test_a_strangers_bad_lines_are_refused_and_the_node_goes_on(swarm3) -> None:
    _boot, a, b = swarm3
    got = Inbox(b)
    addr = b.addrs()[0]
    # a frame that is not msgpack: the line ends, the sender's rejection is counted
    async with stranger_line(addr) as line:
        await line.write(struct.pack(">I", 5) + b"\xc1junk")
        await ended(line)
    await b.wait_until(lambda: b.rejected["line:MalformedMessage"] == 1, timeout=10)
    # a declared length above the largest line type's: refused before any body is read
    async with stranger_line(addr) as line:
        await line.write(struct.pack(">I", 1 << 20))
        await ended(line)
    await b.wait_until(lambda: b.rejected["line:OversizedMessage"] == 1, timeout=10)
    # a type the node takes as a direct message but not on a line
    async with stranger_line(addr) as line:
        await line.write(frame(NotForLines(seq=1)))
        await ended(line)
    await b.wait_until(lambda: b.rejected["line:UnknownMessageType"] == 1, timeout=10)
    # faster than the pace allows: the first burst is taken, the rest ends the line
    burst = int(b.config.line_rate.per_peer_burst)
    async with stranger_line(addr) as line:
        await line.write(b"".join(frame(LinePing(seq=i)) for i in range(burst + 20)))
        await ended(line)
    await b.wait_until(lambda: b.rejected["line:OverBudget"] == 1, timeout=10)
    assert burst <= len(got) < burst + 20
    # none of it cost the node its lines to others
    before = len(got)
    await a.messenger.post(b.peer_id, LinePing(seq=99))
    await got.wait_for(before + 1)
    assert got[-1][0] == a.peer_id


async def test_a_peers_newer_line_replaces_its_older_and_an_idle_line_is_closed(swarm3) -> None:
    _boot, _a, b = swarm3
    got = Inbox(b)
    info = info_from_p2p_addr(multiaddr.Multiaddr(b.addrs()[0]))
    host = new_host(key_pair=Identity.generate().key_pair)
    async with host.run(listen_addrs=[]):
        await host.connect(info)
        first = await host.new_stream(info.peer_id, [LINE_PROTOCOL])
        await first.write(frame(LinePing(seq=1)))
        await got.wait_for(1)
        second = await host.new_stream(info.peer_id, [LINE_PROTOCOL])
        await second.write(frame(LinePing(seq=2)))
        await ended(first)  # one line per peer: the older one went
        await got.wait_for(2)
        # a line that carries nothing for line_idle_s is closed
        b.config.line_idle_s = 0.2
        await second.write(frame(LinePing(seq=3)))  # (the next wait for a frame takes the new idle limit)
        await ended(second)
    assert [m.seq for _, m in got] == [1, 2, 3]  # type: ignore[attr-defined]
    assert not [k for k in b.rejected if k.startswith("line:")]  # neither is the peer's fault


async def test_lines_over_the_total_pace_drop_frames_but_keep_an_honest_line(swarm3) -> None:
    """Strangers that stay within their own pace can still fill the total one together: a frame
    over the total is dropped, but the line it came on stays open and is not counted against its
    sender (ending it cut a shepherd's heartbeats off until it noticed and reopened)."""
    _boot, a, b = swarm3
    got = Inbox(b)
    # one stranger's burst is the whole total, and the buckets hardly refill during the test
    limits = RateLimits(per_peer_s=0.001, per_peer_burst=40.0, total_s=0.001, total_burst=40.0)
    b.messenger.line_rate = Rate(limits, name="line")
    await a.messenger.post(b.peer_id, LinePing(seq=1))  # a's line is open
    await got.wait_for(1)
    async with stranger_line(b.addrs()[0]) as line:
        await line.write(b"".join(frame(LinePing(seq=100 + i)) for i in range(39)))  # within its own burst
        await got.wait_for(40)
        await a.messenger.post(b.peer_id, LinePing(seq=2))  # over the total: dropped
        await b.wait_until(lambda: b.messenger.line_rate.refusals[RATE_TOTAL] == 1, timeout=10)
    b.messenger.line_rate = Rate(limits, name="line")  # (full buckets again, as time would give)
    await a.messenger.post(b.peer_id, LinePing(seq=3))
    await got.wait_for(41)
    assert [m.seq for s, m in got if s == a.peer_id] == [1, 3]  # type: ignore[attr-defined]
    assert a.status().network["protocol_bytes"][LINE_PROTOCOL]["streams"] == 1  # the same line throughout
    assert not [k for k in b.rejected if k.startswith("line:")]  # nobody's fault
