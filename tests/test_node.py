"""A node over real py-libp2p on 127.0.0.1, in one process: status, DHT, and bad input."""

from __future__ import annotations

import dataclasses
import gc
import struct
from pathlib import Path

import multiaddr
import pytest
import trio
from libp2p import new_host
from libp2p.custom_types import TProtocol
from libp2p.peer.peerinfo import info_from_p2p_addr

from pcp_p2p.core.errors import PeerGone, PeerTimeout
from pcp_p2p.core.identity import Identity
from pcp_p2p.dht.records import sign_record
from pcp_p2p.net.budget import RATE_PER_PEER
from pcp_p2p.net.membership import SWIM_PROTOCOL, Gossip, MemberRecord, SwimPacket, boot_ms
from pcp_p2p.net.swarm_key import read_swarm_key, write_swarm_key
from pcp_p2p.net.traffic import ProtocolTraffic
from pcp_p2p.node.node import NodeConfig, open_node
from pcp_p2p.node.status import STATUS_PROTOCOL, fetch_status, to_json
from pcp_p2p.wire import encode

pytestmark = pytest.mark.timeout(120)


async def raw_stream(target_addr: str):  # -> (host context, stream)
    info = info_from_p2p_addr(multiaddr.Multiaddr(target_addr))
    host = new_host(key_pair=Identity.generate().key_pair)
    return host, info


async def open_raw(target_addr: str, payload: bytes | None, protocol: str = STATUS_PROTOCOL) -> bytes:
    """Open a stream, write ``payload`` (or nothing), return what comes back before it closes."""
    host, info = await raw_stream(target_addr)
    async with host.run(listen_addrs=[]):
        await host.connect(info)
        stream = await host.new_stream(info.peer_id, [TProtocol(protocol)])
        if payload is not None:
            await stream.write(payload)
        got = b""
        with trio.fail_after(10):
            while True:
                try:
                    chunk = await stream.read(65536)
                except Exception:
                    break
                if not chunk:
                    break
                got += chunk
        return got


async def test_status_json_lists_every_member(swarm3) -> None:
    _boot, a, b = swarm3
    obj = to_json(await fetch_status(a.addrs()[0], timeout=10))
    assert obj["peer_id"] == a.peer_id
    assert {"peer_id", "addrs", "version", "uptime_s", "capabilities", "members"} <= obj.keys()
    assert {m["peer_id"] for m in obj["members"]} == {a.peer_id, b.peer_id}
    for m in obj["members"]:
        assert {"peer_id", "addrs", "capabilities", "last_seen_s"} <= m.keys()
        assert m["addrs"] and m["capabilities"]["backends"] == ["local-task"]


async def test_dht_records_travel_between_nodes(swarm3) -> None:
    _boot, a, b = swarm3
    await a.put_record(a._signed_member_record())
    record = await b.get_record("member", a.peer_id)
    assert isinstance(record, MemberRecord) and record.peer_id == a.peer_id
    assert a.dht.get_routing_table_size() >= 2 and b.dht.get_routing_table_size() >= 2


async def test_forged_record_is_not_stored_by_a_remote_dht(swarm3) -> None:
    _boot, a, b = swarm3
    mallory = Identity.generate()
    rec = MemberRecord(a.peer_id, ("/ip4/6.6.6.6/tcp/1",), "worker", 0.0, a.capabilities)
    forged = dataclasses.replace(sign_record(mallory, "member", a.peer_id, rec, ttl_s=60))
    # Deliver the forged value straight to b's DHT handler, bypassing a local validator.
    from libp2p.kad_dht.kad_dht import DHTMode, KadDHT
    from libp2p.records.validator import BlankValidator, NamespacedValidator

    host = new_host(key_pair=mallory.key_pair)
    async with host.run(listen_addrs=[multiaddr.Multiaddr("/ip4/127.0.0.1/tcp/0")]):
        dht = KadDHT(host, DHTMode.CLIENT, validator=NamespacedValidator({"pcp": BlankValidator()}),
                     validator_changed=True)
        await host.connect(info_from_p2p_addr(multiaddr.Multiaddr(b.addrs()[0])))
        await dht.add_peer(b.host.get_id())
        with trio.fail_after(10):
            await dht.value_store._store_at_peer(b.host.get_id(), forged.key.encode(), encode(forged))
    stored = b.dht.value_store.get(forged.key.encode())
    assert stored is None or stored.value != encode(forged)
    assert (await fetch_status(b.addrs()[0])).peer_id == b.peer_id


async def test_malformed_status_request_is_rejected_and_node_keeps_running(swarm3) -> None:
    _boot, a, _b = swarm3
    garbage = b"\xde\xad\xbe\xef" * 4
    assert await open_raw(a.addrs()[0], struct.pack(">I", len(garbage)) + garbage) == b""
    await a.wait_until(lambda: a.rejected["status:MalformedMessage"] >= 1, timeout=10)
    assert (await fetch_status(a.addrs()[0])).peer_id == a.peer_id


async def test_oversized_status_request_is_rejected(swarm3) -> None:
    _boot, a, _b = swarm3
    assert await open_raw(a.addrs()[0], struct.pack(">I", 50_000_000)) == b""
    await a.wait_until(lambda: a.rejected["status:OversizedMessage"] >= 1, timeout=10)
    assert (await fetch_status(a.addrs()[0])).peer_id == a.peer_id


async def test_peer_that_never_writes_costs_one_timeout(swarm3) -> None:
    _boot, a, _b = swarm3
    assert await open_raw(a.addrs()[0], None) == b""  # the node resets the idle stream (op_timeout 2 s)
    assert a.boundary.dropped["status:PeerTimeout"] == 1  # dropped, not counted against the peer
    assert not any(k.endswith("PeerTimeout") for k in a.rejected)
    assert (await fetch_status(a.addrs()[0])).peer_id == a.peer_id


async def test_bad_swim_packets_are_refused_counted_and_change_nothing(swarm3) -> None:
    _boot, a, b = swarm3
    mallory = Identity.generate()
    frame = lambda data: struct.pack(">I", len(data)) + data  # noqa: E731
    # garbage; a ping meant for another node; a sync whose record b signed for mallory's key;
    # a replay of b's first record (older than what a holds: dropped, nothing changes).
    rec = b.member_record()
    forged = sign_record(b.identity, "member", mallory.peer_id, dataclasses.replace(rec, peer_id=mallory.peer_id),
                         ttl_s=60)
    first = sign_record(b.identity, "member", b.peer_id, rec, ttl_s=60, seq=0)
    bad = [
        b"garbage",
        b"garbage",
        encode(SwimPacket("ping", 1, b.peer_id)),
        encode(SwimPacket("sync", updates=(Gossip("alive", mallory.peer_id, boot_ms(rec), 0, encode(forged)),))),
    ]
    for data in bad:
        await open_raw(a.addrs()[0], frame(data), SWIM_PROTOCOL)
    stale_before = a.membership.stats.stale
    await open_raw(a.addrs()[0], frame(encode(SwimPacket("sync", updates=(
        Gossip("alive", b.peer_id, boot_ms(rec), 0, encode(first)),)))), SWIM_PROTOCOL)
    await a.wait_until(
        lambda: a.rejected["swim:MalformedMessage"] >= 3 and a.rejected["swim:BadSignature"] >= 1,
        timeout=20,
    )
    assert a.membership.stats.stale > stale_before
    assert b.peer_id in a.membership and mallory.peer_id not in a.membership
    assert a.membership.get(b.peer_id).signed.seq > 0  # type: ignore[union-attr]
    assert (await fetch_status(a.addrs()[0])).peer_id == a.peer_id


async def test_a_peer_that_probes_too_often_is_refused_and_the_view_holds(swarm3) -> None:
    _boot, a, b = swarm3
    host, info = await raw_stream(a.addrs()[0])
    frame = lambda data: struct.pack(">I", len(data)) + data  # noqa: E731
    answered = 0
    async with host.run(listen_addrs=[]):
        await host.connect(info)
        started = trio.current_time()
        for seq in range(60):  # one identity, back to back: far above an honest prober's 1/s
            with trio.fail_after(10):
                try:
                    stream = await host.new_stream(info.peer_id, [TProtocol(SWIM_PROTOCOL)])
                    await stream.write(frame(encode(SwimPacket("ping", seq + 1, a.peer_id))))
                    answered += bool(await stream.read(65536))
                except Exception:
                    pass  # refused: the node reset the stream
        elapsed = trio.current_time() - started
    limits = a.config.swim_rate
    assert answered <= limits.per_peer_burst + limits.per_peer_s * elapsed + 1
    assert a.swim_rate.refusals[RATE_PER_PEER] == 60 - answered > 0
    assert a.rejected["swim:OverBudget"] == 60 - answered
    assert b.peer_id in a.membership and a.membership.get(b.peer_id).suspect_since is None  # type: ignore[union-attr]
    assert (await fetch_status(a.addrs()[0])).peer_id == a.peer_id


async def test_status_of_a_dead_address_is_a_typed_error() -> None:
    dead = f"/ip4/127.0.0.1/tcp/1/p2p/{Identity.generate().peer_id}"
    with pytest.raises((PeerGone, PeerTimeout)):
        await fetch_status(dead, timeout=5)


async def test_private_swarm_refuses_outsiders(tmp_path: Path, caps) -> None:
    write_swarm_key(tmp_path / "swarm.key")
    config = NodeConfig(tmp_path / "n", listen=("/ip4/127.0.0.1/tcp/0",), swarm_key=tmp_path / "swarm.key",
                        capabilities=caps)
    async with open_node(config) as node:
        key = read_swarm_key(tmp_path / "swarm.key")
        assert (await fetch_status(node.addrs()[0], swarm_key=key, timeout=10)).peer_id == node.peer_id
        with pytest.raises((PeerGone, PeerTimeout)):
            await fetch_status(node.addrs()[0], timeout=5)


async def test_restart_keeps_peer_id(tmp_path: Path, caps) -> None:
    config = NodeConfig(tmp_path / "n", listen=("/ip4/127.0.0.1/tcp/0",), capabilities=caps)
    async with open_node(config) as node:
        first = node.peer_id
    async with open_node(config) as node:
        assert node.peer_id == first


async def test_direct_messages_are_delivered_and_bad_ones_refused(swarm3) -> None:
    from pcp_p2p.core.errors import PcpError
    from pcp_p2p.node.messaging import MSG_PROTOCOL
    from pcp_p2p.node.status import StatusRequest

    _boot, a, b = swarm3
    got: list[tuple[str, object]] = []

    async def handler(sender: str, msg: object) -> None:
        got.append((sender, msg))

    b.messenger.register((StatusRequest,), handler)
    await a.messenger.send(b.peer_id, StatusRequest(members=False))
    assert got == [(a.peer_id, StatusRequest(members=False))]
    # A type b does not take is refused, and a is told.
    a.messenger.register((StatusRequest,), handler)
    b.messenger.unregister((StatusRequest,))
    with pytest.raises(PcpError):
        await a.messenger.send(b.peer_id, StatusRequest())
    assert b.rejected["message:ProtocolError"] == 1
    # Garbage on the raw protocol: reset, counted, node fine.
    try:  # the reset can reach the raw client during libp2p's lazy protocol negotiation
        await open_raw(b.addrs()[0], struct.pack(">I", 3) + b"bad", MSG_PROTOCOL)
    except BaseException as exc:
        if isinstance(exc, trio.Cancelled):
            raise
    await b.wait_until(lambda: b.rejected["message:ProtocolError"] + b.rejected["message:MalformedMessage"] >= 2,
                       timeout=10)
    assert (await fetch_status(b.addrs()[0])).peer_id == b.peer_id


async def test_status_counts_bytes_on_libp2p_connections_and_blob_side_channels(swarm3) -> None:
    boot, a, b = swarm3
    before_a, before_b = a.status().network, b.status().network
    # every connection since start is counted, Noise handshakes and heartbeats included
    assert before_a["bytes_in"] > 0 and before_a["bytes_out"] > 0
    payload = bytes(range(256)) * 8192  # 2 MiB: travels as one side-channel record
    cid = await a.blobs.publish(payload)
    await b.blobs.fetch(cid, providers=[a.host.get_peerstore().peer_info(a.host.get_id())])
    after_a, after_b = a.status().network, b.status().network
    assert after_a["bytes_out"] - before_a["bytes_out"] >= len(payload)
    assert after_b["bytes_in"] - before_b["bytes_in"] >= len(payload)
    # of which blob data: the payload went on the side channel, and control traffic stays apart
    assert after_a["blob_bytes_out"] - before_a["blob_bytes_out"] >= len(payload)
    assert after_b["blob_bytes_in"] - before_b["blob_bytes_in"] >= len(payload)
    assert after_a["blob_bytes_out"] <= after_a["bytes_out"] and before_a["blob_bytes_out"] < len(payload)
    # the figures are per node, not per process: the bootstrap server moved no blob
    assert boot.status().network["bytes_out"] < len(payload)
    # and what each store holds
    store_a, store_b = a.status().extra["storage"], b.status().extra["storage"]
    assert store_a["blobs"] >= 1 and store_a["used_bytes"] >= len(payload) and store_a["pinned_bytes"] >= len(payload)
    assert store_b["used_bytes"] >= len(payload) and store_b["max_bytes"] == b.blobs.store.max_bytes


async def test_the_protocol_split_forgets_a_stream_nobody_holds_even_if_never_closed() -> None:
    """The per-stream state is weakly keyed by the stream: a stream libp2p dropped without
    telling the notifee (a connection that died) must not stay in it for ever."""
    class FakeStream:
        protocol: str | None = None

        def get_protocol(self) -> str | None:
            return self.protocol

        async def read(self, n: int | None = None) -> bytes:
            return b"abc"

        async def write(self, data: bytes) -> None:
            pass

    split = ProtocolTraffic()
    stream = FakeStream()
    await split.opened_stream(None, stream)  # type: ignore[arg-type]
    await stream.read()  # (before negotiation: held back)
    stream.protocol = "/x/1"
    await stream.write(b"hello")
    assert split.snapshot() == {"/x/1": {"streams": 1, "bytes_in": 3, "bytes_out": 5}}
    assert len(split._open) == 1
    del stream
    gc.collect()
    assert len(split._open) == 0


async def test_status_splits_stream_bytes_by_protocol(swarm3) -> None:
    _boot, _a, b = swarm3
    empty = {"streams": 0, "bytes_in": 0, "bytes_out": 0}
    before = b.status().network["protocol_bytes"].get(STATUS_PROTOCOL, empty)
    reply = await fetch_status(b.addrs()[0])
    net = b.status().network
    after = net["protocol_bytes"][STATUS_PROTOCOL]
    # one more stream of the status protocol, which carried at least the reply's frame out
    assert after["streams"] == before["streams"] + 1
    assert after["bytes_out"] - before["bytes_out"] >= len(encode(reply))
    assert after["bytes_in"] > before["bytes_in"]  # the request (and the negotiation)
    # libp2p's own protocols are counted too, and the streams' payload is part of the connections' bytes
    assert any("kad" in p or "meshsub" in p or "ipfs" in p for p in net["protocol_bytes"])
    assert sum(p["bytes_out"] for p in net["protocol_bytes"].values()) <= net["bytes_out"]
    assert sum(p["bytes_in"] for p in net["protocol_bytes"].values()) <= net["bytes_in"]
