"""Resource budgets (issue #12, item 5): streams and buffered bytes per peer and in
total, overall deadlines with a minimum rate, and upload slots that no idle or
trickling client can hold.

The budget module alone (sans-IO, a fake clock), then the node over real
py-libp2p on 127.0.0.1: floods from one peer and from many, a trickled frame,
a node process whose memory is read from /proc, and the blob server's side
channel against a trickled hello.
"""

from __future__ import annotations

import os
import socket
import struct
import threading
import time
from collections.abc import AsyncIterator
from contextlib import AsyncExitStack, asynccontextmanager
from pathlib import Path

import libp2p
import multiaddr
import pytest
import trio
from conftest import TEST_CAPS
from libp2p.peer.peerinfo import PeerInfo, info_from_p2p_addr

from pcp_p2p.blob import protocol as P
from pcp_p2p.blob.routing import MemoryRouting
from pcp_p2p.blob.service import BlobConfig, BlobService
from pcp_p2p.blob.sidechannel import (
    HEADER,
    KIND_HELLO,
    TAG_LEN,
    RecordCipher,
    derive_key,
    hello_plaintext,
    recv_exact_into,
    send_record,
    transcript,
)
from pcp_p2p.blob.store import BlobStore
from pcp_p2p.core.cid import cid_of
from pcp_p2p.core.errors import ConfigError, OverBudget, PeerTimeout
from pcp_p2p.core.identity import Identity
from pcp_p2p.net.budget import (
    BYTES_PER_PEER,
    BYTES_TOTAL,
    RATE_PER_PEER,
    RATE_TOTAL,
    STREAMS_PER_PEER,
    STREAMS_TOTAL,
    Budget,
    Limits,
    Pace,
    Rate,
    RateLimits,
    Usage,
)
from pcp_p2p.node.messaging import MSG_PROTOCOL
from pcp_p2p.node.node import Node, NodeConfig, open_node
from pcp_p2p.testing import flood_node, flood_streams
from pcp_p2p.wire import HARD_MAX_SIZE, Message, wire_message

pytestmark = pytest.mark.timeout(180)
MIB = 1024 * 1024


@wire_message("test.budget.note", max_size=HARD_MAX_SIZE)
class Note(Message):
    text: str
    payload: bytes = b""


# --- the budget module alone ------------------------------------------------------


def limits(**kw: int) -> Limits:
    return Limits(**{"streams_per_peer": 2, "streams_total": 3, "bytes_per_peer": 100, "bytes_total": 150, **kw})


def test_a_peer_gets_its_share_of_streams_and_no_more() -> None:
    b = Budget(limits())
    first, second = b.open("p"), b.open("p")
    with pytest.raises(OverBudget) as err:
        b.open("p")
    assert err.value.reason == STREAMS_PER_PEER and b.refusals[STREAMS_PER_PEER] == 1
    assert b.usage("p") == Usage(2, 0)
    first.close()
    first.close()  # twice is harmless
    b.open("p").close()  # the freed slot can be taken again
    second.close()
    assert b.usage() == Usage(0, 0) and b.snapshot()["peers"] == 0


def test_many_identities_meet_the_total() -> None:
    b = Budget(limits())
    held = [b.open(f"peer{i}") for i in range(3)]  # each inside its own share
    with pytest.raises(OverBudget) as err:
        b.open("peer3")
    assert err.value.reason == STREAMS_TOTAL
    for r in held:
        r.close()
    assert b.peak.streams == 3 and b.usage() == Usage(0, 0)


def test_bytes_are_reserved_per_peer_and_in_total_and_a_refusal_holds_nothing_more() -> None:
    b = Budget(limits())
    with b.open("p") as r:
        r.reserve(60)
        with pytest.raises(OverBudget) as err:
            r.reserve(41)  # 101 > 100 for p
        assert err.value.reason == BYTES_PER_PEER
        assert r.bytes == 60 and b.usage("p") == Usage(1, 60)
        with b.open("q") as other:
            other.reserve(90)
            with b.open("s") as third, pytest.raises(OverBudget) as err:
                third.reserve(1)  # 151 > 150 in total, though s holds nothing
            assert err.value.reason == BYTES_TOTAL
    assert b.usage() == Usage(0, 0)
    assert dict(b.refusals) == {BYTES_PER_PEER: 1, BYTES_TOTAL: 1}
    assert b.snapshot()["peak_bytes"] == 150


def test_a_rate_refills_per_peer_and_bounds_many_identities_together() -> None:
    r = Rate(RateLimits(per_peer_s=2.0, per_peer_burst=3.0, total_s=2.0, total_burst=5.0, peers=2))
    for _ in range(3):
        r.take("p", 0.0)
    with pytest.raises(OverBudget) as err:
        r.take("p", 0.0)
    assert err.value.reason == RATE_PER_PEER
    r.take("p", 0.5)  # half a second refills one token at 2/s
    r.take("q", 0.5)  # the total had 5 - 3 + 0.5 s * 2/s = 3 before p's; q and s take the last two
    r.take("s", 0.5)
    with pytest.raises(OverBudget) as err:
        r.take("t", 0.5)  # t's own bucket is full, the node's is empty
    assert err.value.reason == RATE_TOTAL
    assert dict(r.refusals) == {RATE_PER_PEER: 1, RATE_TOTAL: 1}
    assert r.snapshot()["peers"] == 2  # only the two most recent peers are remembered
    with pytest.raises(ConfigError):
        RateLimits(per_peer_s=5.0, per_peer_burst=1.0, total_s=4.0, total_burst=5.0)


def test_a_reservation_is_given_back_on_every_exit_path() -> None:
    b = Budget(limits())
    with pytest.raises(RuntimeError):
        with b.open("p") as r:
            r.reserve(50)
            raise RuntimeError("a handler's bug")
    assert b.usage() == Usage(0, 0)
    with b.open("p") as r:
        r.reserve(50)
        r.release_bytes()  # the buffer is gone; the slot stays
        assert b.usage("p") == Usage(1, 0)
    with pytest.raises(RuntimeError):
        r.reserve(1)  # closed


def test_limits_and_pace_refuse_nonsense() -> None:
    with pytest.raises(ConfigError):
        limits(streams_per_peer=4)  # a share above the total
    with pytest.raises(ConfigError):
        limits(bytes_total=0)
    with pytest.raises(ConfigError):
        Pace(grace_s=1.0, min_rate=0)


def test_pace_is_an_overall_deadline_with_a_minimum_rate() -> None:
    pace = Pace(grace_s=10.0, min_rate=1 * MIB)
    assert pace.deadline(100.0, 8 * MIB) == pytest.approx(118.0)
    assert pace.remaining(100.0, 8 * MIB, now=117.5) == pytest.approx(0.5)
    assert pace.remaining(100.0, 0, now=111.0) < 0  # nothing declared: the grace is all there is


def test_a_trickled_read_meets_its_deadline_not_a_stall_timer() -> None:
    """Bytes keep coming (no stall), yet the deadline on the injected clock ends the read."""
    a, b = socket.socketpair()
    try:
        a.settimeout(5.0)
        b.sendall(b"x" * 10)
        now = iter([0.0, 0.5, 2.0])  # the clock passes the deadline (1.0) after the first recv
        buf = bytearray(20)
        with pytest.raises(PeerTimeout, match="deadline"):
            recv_exact_into(a, memoryview(buf), deadline=1.0, clock=lambda: next(now))
        assert bytes(buf[:10]) == b"x" * 10 and a.gettimeout() == 5.0  # the stall timeout is restored
    finally:
        a.close()
        b.close()


# --- the node over real libp2p -----------------------------------------------------


@asynccontextmanager
async def target_and_honest(tmp: Path, **target_cfg: object) -> AsyncIterator[tuple[Node, Node, list[Note]]]:
    """A target node taking Notes, and an honest node connected to it."""
    def cfg(name: str, **kw: object) -> NodeConfig:
        return NodeConfig(tmp / name, listen=("/ip4/127.0.0.1/tcp/0",), capabilities=TEST_CAPS,  # type: ignore[arg-type]
                          **{"op_timeout": 5.0, **kw})

    async with AsyncExitStack() as stack:
        target = await stack.enter_async_context(open_node(cfg("target", **target_cfg)))
        honest = await stack.enter_async_context(open_node(cfg("honest")))
        got: list[Note] = []

        async def on_note(sender: str, msg: Message) -> None:
            assert isinstance(msg, Note)
            got.append(msg)

        target.messenger.register((Note,), on_note)
        await honest.host.connect(info_from_p2p_addr(multiaddr.Multiaddr(target.addrs()[0])))
        yield target, honest, got


async def test_a_flood_from_one_peer_is_refused_beyond_its_share_and_an_honest_peer_gets_through(
    tmp_path: Path,
) -> None:
    async with target_and_honest(tmp_path) as (target, honest, got):
        budget = target.messenger.budget
        per_peer = target.config.msg_bytes_per_peer // (HARD_MAX_SIZE - 1)  # frames one peer may buffer
        pressure, stop = trio.Event(), trio.Event()
        tallies = []
        async with trio.open_nursery() as nursery:

            async def attack() -> None:
                tallies.append(await flood_streams(target.addrs()[0], streams_per_peer=48, hold_s=60,
                                                   at_full_pressure=pressure, stop=stop))

            nursery.start_soon(attack)
            with trio.fail_after(60):
                await pressure.wait()
            # At full pressure (every flood stream refused or holding its body):
            assert budget.usage().streams == per_peer and budget.usage().bytes <= target.config.msg_bytes_per_peer
            big = Note("honest", os.urandom(HARD_MAX_SIZE - 1024))  # a full-size submission still fits
            with trio.fail_after(30):
                await honest.messenger.send(target.peer_id, big, timeout=30)
            stop.set()
        (tally,) = tallies
        assert got == [big]
        assert tally.accepted == per_peer and tally.refused == 48 - per_peer
        assert budget.peak.bytes <= target.config.msg_bytes_per_peer + HARD_MAX_SIZE
        assert sum(budget.refusals.values()) == 48 - per_peer
        assert target.rejected["message:OverBudget"] == 48 - per_peer
        # the held streams end with the flood; everything goes back
        await target.wait_until(lambda: budget.usage() == Usage(0, 0), timeout=10)


async def test_many_identities_stay_inside_the_total(tmp_path: Path) -> None:
    """8 fresh identities x 8 streams of 1 MiB: each inside its own share (4 MiB),
    together far above the total (12 MiB, 1 MiB of it kept for small frames)."""
    async with target_and_honest(
        tmp_path, msg_streams_per_peer=8, msg_streams_total=64,
        msg_bytes_per_peer=4 * MIB, msg_bytes_total=12 * MIB, msg_small_reserve=MIB,
    ) as (target, honest, got):
        budget = target.messenger.budget
        pressure, stop = trio.Event(), trio.Event()
        tallies = []
        async with trio.open_nursery() as nursery:

            async def attack() -> None:
                tallies.append(await flood_streams(target.addrs()[0], peers=8, streams_per_peer=8,
                                                   frame_size=MIB, hold_s=60, at_full_pressure=pressure,
                                                   stop=stop))

            nursery.start_soon(attack)
            with trio.fail_after(90):
                await pressure.wait()
            assert budget.usage() == Usage(11, 11 * MIB)  # the total binds, not 8 peers x 4 frames
            with trio.fail_after(30):  # a control message still fits, in the reserve
                await honest.messenger.send(target.peer_id, Note("small"), timeout=30)
            stop.set()
        (tally,) = tallies
        assert got == [Note("small")]
        assert tally.accepted == 11 and tally.refused == 64 - 11
        assert budget.peak.bytes <= 11 * MIB + 4096
        assert sum(budget.refusals.values()) == 64 - 11 and budget.refusals[BYTES_TOTAL] > 0


async def test_a_trickled_frame_is_cut_at_its_overall_deadline(tmp_path: Path) -> None:
    """One byte every 0.2 s never trips a per-read timeout; the overall deadline
    (grace 1 s + 64 KiB at 64 KiB/s = 2 s) ends it and the reservation is returned."""
    async with target_and_honest(tmp_path, op_timeout=1.0, msg_min_rate=64 * 1024) as (target, honest, got):
        budget = target.messenger.budget
        host = libp2p.new_host(key_pair=Identity.generate().key_pair)
        info = info_from_p2p_addr(multiaddr.Multiaddr(target.addrs()[0]))
        async with host.run(listen_addrs=[]):
            await host.connect(info)
            stream = await host.new_stream(info.peer_id, [MSG_PROTOCOL])
            await stream.write(struct.pack(">I", 64 * 1024))
            t0 = trio.current_time()
            ended = None
            with trio.fail_after(20):
                while True:
                    try:
                        await stream.write(b"x")
                    except Exception:
                        ended = trio.current_time() - t0
                        break
                    if target.boundary.dropped["message:PeerTimeout"]:
                        ended = trio.current_time() - t0
                        break
                    await trio.sleep(0.2)  # the attacker's pace, not synchronisation
            assert ended is not None and ended < 10  # a per-read timeout would never have fired
            await target.wait_until(lambda: target.boundary.dropped["message:PeerTimeout"] == 1, timeout=10)
            await target.wait_until(lambda: budget.usage() == Usage(0, 0), timeout=10)
            assert budget.peak.bytes == 64 * 1024
            await honest.messenger.send(target.peer_id, Note("after"), timeout=10)
            assert got == [Note("after")]


async def test_a_node_process_flooded_by_one_peer_grows_less_than_64_mib(tmp_path: Path) -> None:
    """The attack from issue #12 against a real ``pcp node join`` process (main: +430 MiB)."""
    result = await flood_node(streams_per_peer=48, hold_s=8, root=tmp_path)
    print("flood, one peer:", result.as_dict())
    frames = NodeConfig(tmp_path).msg_bytes_per_peer // (HARD_MAX_SIZE - 1)
    assert result.accepted == frames and result.refused == 48 - frames
    assert result.node_rejected.get("message:OverBudget") == 48 - frames
    assert result.growth_mib < 64


@pytest.mark.slow
async def test_a_node_process_flooded_by_many_identities_stays_inside_the_total(tmp_path: Path) -> None:
    result = await flood_node(peers=8, streams_per_peer=8, hold_s=15, root=tmp_path)
    print("flood, 8 x 8:", result.as_dict())
    cfg = NodeConfig(tmp_path)
    frames = cfg.msg_bytes_total // (HARD_MAX_SIZE - 1)
    assert result.accepted <= frames and result.refused >= 64 - frames
    assert result.node_extra["msg_budget"]["peak_bytes"] <= cfg.msg_bytes_total
    assert result.growth_mib < cfg.msg_bytes_total / MIB + 32


# --- the blob server's upload slots --------------------------------------------------

CS = 64 * 1024


async def blob_node(stack: AsyncExitStack, tmp: Path, routing: MemoryRouting, name: str, **cfg: object) -> BlobService:
    ident = Identity.generate()
    host = libp2p.new_host(key_pair=ident.key_pair)
    await stack.enter_async_context(host.run(listen_addrs=[multiaddr.Multiaddr("/ip4/127.0.0.1/tcp/0")]))
    info = PeerInfo(host.get_id(), host.get_addrs())
    config = BlobConfig(**{"stall_timeout": 2.0, "request_timeout": 6.0, **cfg})  # type: ignore[arg-type]
    svc = BlobService(host, BlobStore(tmp / name, 1 << 30, chunk_size=CS), routing.for_peer(info), ident, config)
    svc.register()
    return svc


def peer_info(svc: BlobService) -> PeerInfo:
    return PeerInfo(svc.host.get_id(), svc.host.get_addrs())


async def test_trickled_hellos_are_cut_at_the_handshake_deadline_and_an_honest_fetch_gets_a_slot(
    tmp_path: Path,
) -> None:
    """Two throwaway identities take all four upload slots and trickle their
    hellos a byte at a time (each byte well inside the stall timeout). The
    handshake deadline cuts them, the slots go back, and an honest fetch that
    queued behind them succeeds."""
    data = os.urandom(4 * CS)
    routing = MemoryRouting()
    stop = threading.Event()
    async with AsyncExitStack() as stack:
        server = await blob_node(stack, tmp_path, routing, "server", handshake_timeout=1.5,
                                 max_uploads=4, max_uploads_per_peer=2)
        cid = await server.publish(data)
        mcid = cid_of(server.store.manifest_bytes(cid))
        hogs = [await blob_node(stack, tmp_path, routing, f"hog{i}") for i in range(2)]
        honest = await blob_node(stack, tmp_path, routing, "honest")
        cut_after: list[float] = []

        def trickle(port: int, hello_len: int) -> None:
            # A well-formed header (so nothing is refused on its content), then
            # one byte every 0.3 s: the hello would take well over a minute.
            start = time.monotonic()
            record = HEADER.pack(KIND_HELLO, hello_len) + bytes(hello_len)
            try:
                with socket.create_connection(("127.0.0.1", port), timeout=5) as s:
                    s.settimeout(0.3)
                    for byte in record:
                        if stop.is_set():
                            break
                        s.sendall(bytes([byte]))
                        try:
                            if s.recv(1) == b"":  # the server closed it
                                break
                        except TimeoutError:
                            continue
            except OSError:
                pass  # reset by the server
            cut_after.append(time.monotonic() - start)

        with trio.fail_after(30):
            ports = []
            for hog in hogs:
                hello_len = len(hello_plaintext(transcript(hog.peer_id, server.peer_id, cid, mcid, 0, 1))) + TAG_LEN
                for _ in range(2):
                    reply, _ip = await hog._request(
                        peer_info(server), P.BlobRequest("data", cid, os.urandom(P.NONCE_LEN), mcid, 0, 1))
                    ports.append((reply.port, hello_len))
            assert server._uploads.held == 4  # every slot is a hog's
            threads = [threading.Thread(target=trickle, args=p, daemon=True) for p in ports]
            for t in threads:
                t.start()
            try:
                got = await honest.fetch_into(cid, providers=[peer_info(server)])
                assert bytes(got) == data
                for t in threads:
                    await trio.to_thread.run_sync(t.join, 10)
            finally:
                stop.set()
        assert len(cut_after) == 4 and max(cut_after) < 10  # cut by the server, long before a hello could finish
        assert server._uploads.peak == 4  # never above the total
        with trio.fail_after(10):  # the honest upload's thread hands its slot back after the client closed
            await server._uploads.wait_idle()


async def test_a_client_reading_below_the_minimum_rate_is_cut_and_its_slot_freed(tmp_path: Path) -> None:
    """A client that reads its chunks steadily but slowly (128 KiB/s, never a
    stall) holds its upload slot only until the paced deadline: chunk k is due
    by grace + (k+1) MiB / min_rate."""
    chunk = MIB
    routing = MemoryRouting()
    async with AsyncExitStack() as stack:
        server = await blob_node(stack, tmp_path, routing, "server", min_rate=1 * MIB)
        server.store = BlobStore(tmp_path / "big", 1 << 30, chunk_size=chunk)
        cid = await server.publish(os.urandom(24 * chunk))
        mcid = cid_of(server.store.manifest_bytes(cid))
        client = await blob_node(stack, tmp_path, routing, "client")
        nonce = os.urandom(P.NONCE_LEN)
        reply, _ip = await client._request(peer_info(server), P.BlobRequest("data", cid, nonce, mcid, 0, 24))
        info_bytes = transcript(client.peer_id, server.peer_id, cid, mcid, 0, 24)
        key = derive_key(reply.secret, nonce, reply.nonce, info_bytes)

        done = threading.Event()

        def slow_reader() -> int:
            s = socket.socket()
            s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 64 * 1024)
            s.settimeout(5)
            s.connect(("127.0.0.1", reply.port))
            send_record(s, RecordCipher.for_direction(key, client_to_server=True), KIND_HELLO,
                        hello_plaintext(info_bytes))
            got = 0
            try:
                while not done.is_set():
                    data = s.recv(16 * 1024)
                    if not data:
                        break
                    got += len(data)
                    time.sleep(0.125)  # 128 KiB/s: steady, far inside the 2 s stall timeout
            except OSError:
                pass  # reset by the server
            finally:
                s.close()
            return got

        received: list[int] = []

        async def read_slowly() -> None:
            received.append(await trio.to_thread.run_sync(slow_reader))

        async with trio.open_nursery() as nursery:
            nursery.start_soon(read_slowly)
            start = trio.current_time()
            with trio.fail_after(60):
                await server._uploads.wait_idle(releases=1)  # its upload started, was cut, gave the slot back
            released_after = trio.current_time() - start
            done.set()
        # At 128 KiB/s the 24 MiB would have held the slot over three minutes; the
        # server's kernel buffer (a few MiB, still drained by the reader) holds no slot.
        assert released_after < 30
        assert received and received[0] < 24 * chunk
