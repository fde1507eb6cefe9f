"""The sans-IO lookup machines of pcp_p2p.dht.lookup, the one-round-trip KAD RPC, the record cache."""

from __future__ import annotations

import dataclasses

import pytest
import trio
from libp2p.peer.id import ID

from pcp_p2p.core.errors import ExpiredRecord, PeerGone, VerificationError
from pcp_p2p.core.identity import Identity
from pcp_p2p.dht import records as records_mod
from pcp_p2p.dht import rpc
from pcp_p2p.dht.lookup import ClosestWalk, StoreFanout, ValueLookup
from pcp_p2p.dht.records import sign_record, verify_record
from pcp_p2p.node.record_kinds import RECORD_KINDS
from pcp_p2p.wire import encode


def by_number(p: int) -> int:
    """Peers are ints; distance to the key is the int itself (0 is closest)."""
    return p


def newer(a: bytes, b: bytes) -> bool:
    return a > b  # values are b"v1" < b"v2": a higher version is newer


def lookup(**kw: object) -> ValueLookup[int]:
    return ValueLookup(by_number, newer, **kw)  # type: ignore[arg-type]


# -- ValueLookup ----------------------------------------------------------------------


def test_get_asks_the_closest_peer_first_and_hedges_one_more_per_interval() -> None:
    lk = lookup(started_at=100.0, hedge_s=0.02, alpha=3)
    lk.add_candidates([5, 1, 3, 9])
    assert lk.next_queries(100.0) == [1]
    assert lk.next_queries(100.01) == []  # the first is still within its hedge interval
    assert lk.next_wakeup(100.01) == pytest.approx(100.02)
    assert lk.next_queries(100.021) == [3]
    assert lk.next_queries(100.5) == [5]  # alpha reached: no more however long it waits
    assert lk.next_queries(101.0) == []
    assert lk.next_wakeup(101.0) == float("inf")


def test_get_stops_at_the_first_valid_answer() -> None:
    lk = lookup(started_at=0.0)
    lk.add_candidates([1, 2, 3])
    assert lk.next_queries(0.0) == [1]
    lk.on_answer(1, b"v1")
    assert lk.done and lk.best == b"v1"
    assert lk.next_queries(10.0) == []


def test_a_failed_or_empty_answer_frees_its_slot_at_once() -> None:
    lk = lookup(started_at=0.0, hedge_s=1.0)
    lk.add_candidates([1, 2, 3])
    assert lk.next_queries(0.0) == [1]
    lk.on_failure(1)
    assert lk.next_queries(0.001) == [2]  # no wait for the hedge timer
    lk.on_answer(2, None)
    assert lk.next_queries(0.002) == [3]
    lk.on_answer(3, None)
    assert lk.done and lk.best is None  # nobody left: converged without a value


def test_with_a_quorum_the_newest_value_wins_and_stale_replicas_are_named() -> None:
    lk = lookup(started_at=0.0, quorum=3, hedge_s=0.0)
    lk.add_candidates([1, 2, 3, 4])
    assert lk.next_queries(0.0) == [1, 2, 3]
    lk.on_answer(1, b"v1")
    lk.on_answer(2, b"v2")
    assert not lk.done
    lk.on_answer(3, b"v1")
    assert lk.done and lk.best == b"v2"
    assert sorted(lk.stale_peers()) == [1, 3]


def test_closer_peers_from_answers_are_asked_before_farther_ones() -> None:
    lk = lookup(started_at=0.0, hedge_s=0.0, alpha=1, k=2)
    lk.add_candidates([10, 20, 30])
    assert lk.next_queries(0.0) == [10]
    lk.on_answer(10, None, closer=[2, 40])
    assert lk.next_queries(0.0) == [2]
    lk.on_answer(2, None, closer=[1])
    assert lk.next_queries(0.0) == [1]
    lk.on_answer(1, None)
    # The two closest (1, 2) answered; every candidate left (20, 30, 40) is farther than 10.
    assert lk.done and lk.next_queries(0.0) == []


def test_a_lookup_never_exceeds_its_query_budget() -> None:
    lk = lookup(started_at=0.0, hedge_s=0.0, alpha=2, max_queries=3)
    lk.add_candidates(range(100, 200))
    asked: list[int] = []
    for _ in range(10):
        for p in lk.next_queries(0.0):
            asked.append(p)
            lk.on_answer(p, None, closer=[p - 100])  # always someone closer
    assert len(asked) == 3 and lk.done


# -- StoreFanout ----------------------------------------------------------------------


def test_put_waits_for_quorum_then_hands_the_rest_to_the_background() -> None:
    fan: StoreFanout[int] = StoreFanout(quorum=1)
    fan.add_targets([1, 2, 3, 4])
    assert fan.next_urgent() == [1]
    assert fan.next_urgent() == []  # one in flight is enough for a quorum of one
    fan.on_result(1, False)
    assert not fan.satisfied
    assert fan.next_urgent() == [2]  # a failure hands out the next closest
    fan.on_result(2, True)
    assert fan.satisfied
    assert fan.rest() == [3, 4]
    assert fan.add_targets([3, 5]) == [5]  # a walk's finds: only new peers
    assert fan.rest() == [5]


def test_put_with_nobody_to_ask_is_satisfied_at_once() -> None:
    fan: StoreFanout[int] = StoreFanout(quorum=2)
    assert fan.satisfied and fan.next_urgent() == []


def test_put_whose_targets_all_fail_is_satisfied_when_all_answered() -> None:
    fan: StoreFanout[int] = StoreFanout(quorum=2)
    fan.add_targets([1, 2])
    assert fan.next_urgent() == [1, 2]
    fan.on_result(1, False)
    assert not fan.satisfied
    fan.on_result(2, False)
    assert fan.satisfied and fan.acked == 0


# -- ClosestWalk ----------------------------------------------------------------------


def test_walk_reports_peers_that_enter_the_k_closest_and_stops_without_progress() -> None:
    walk: ClosestWalk[int] = ClosestWalk(by_number, alpha=1, k=3)
    walk.add([10, 20, 30])
    assert walk.next_queries() == [10]
    assert walk.on_answer(10, [5, 40]) == [5]  # 40 is not among the 3 closest
    assert walk.next_queries() == [5]
    assert walk.on_answer(5, [10, 20]) == []  # nothing new: no progress
    assert walk.done


# -- records: the verification cache --------------------------------------------------


def _member(identity: Identity, ttl_s: float = 60.0, now: float = 1000.0) -> bytes:
    from pcp_p2p.net.membership import MemberRecord
    from tests.conftest import TEST_CAPS

    rec = MemberRecord(identity.peer_id, ("/ip4/127.0.0.1/tcp/1",), "worker", 0.0, TEST_CAPS)
    return encode(sign_record(identity, "member", identity.peer_id, rec, ttl_s=ttl_s, now=now))


def test_a_record_is_signature_checked_once_but_its_window_and_key_every_time(monkeypatch) -> None:
    ident = Identity.generate()
    data = _member(ident)
    key = f"/pcp/member/{ident.peer_id}"
    calls = []
    real = records_mod.verify_signature
    monkeypatch.setattr(records_mod, "verify_signature", lambda *a: (calls.append(1), real(*a))[1])
    assert verify_record(data, key=key, now=1001.0, kinds=RECORD_KINDS).name == ident.peer_id
    assert verify_record(data, key=key, now=1002.0, kinds=RECORD_KINDS).name == ident.peer_id
    assert len(calls) == 1
    with pytest.raises(ExpiredRecord):
        verify_record(data, key=key, now=1061.0, kinds=RECORD_KINDS)  # expired: the cache does not hide it
    with pytest.raises(VerificationError):
        verify_record(data, key="/pcp/member/someone-else", now=1001.0, kinds=RECORD_KINDS)


def test_a_forged_copy_of_a_cached_record_is_still_refused() -> None:
    from pcp_p2p.core.errors import BadSignature
    from pcp_p2p.dht.records import SignedRecord
    from pcp_p2p.wire import decode

    ident = Identity.generate()
    data = _member(ident)
    verify_record(data, now=1001.0, kinds=RECORD_KINDS)
    forged = encode(dataclasses.replace(decode(data, SignedRecord), expires_at=1050.0))
    with pytest.raises(BadSignature):
        verify_record(forged, now=1001.0, kinds=RECORD_KINDS)


# -- rpc: one round trip against py-libp2p's own KAD server ---------------------------


async def test_pipelined_kad_requests_are_understood_by_the_library_server(swarm3) -> None:
    import time

    from pcp_p2p.dht.records import SignedRecord
    from pcp_p2p.wire import decode

    boot, a, b = swarm3
    # Newer than the member record a has already stored at b (an equal or older one is refused).
    signed = decode(_member(a.identity, now=time.time() + 1), SignedRecord)
    key = signed.key.encode()
    assert await rpc.put_value(a.host, b.host.get_id(), key, encode(signed))
    stored = b.dht.value_store.get(key)
    assert stored is not None and stored.value == encode(signed)
    record, closer = await rpc.get_value(a.host, b.host.get_id(), key)
    assert record is not None and record.value == encode(signed)
    assert boot.host.get_id() in closer  # b names the peers it knows (not a, who asked)


async def test_a_peer_that_refuses_the_value_answers_with_peer_gone(swarm3) -> None:
    _boot, a, b = swarm3
    mallory = Identity.generate()
    forged = sign_record(mallory, "member", a.peer_id, a._signed_member_record(), ttl_s=60)
    with trio.fail_after(10), pytest.raises(PeerGone):
        await rpc.put_value(a.host, b.host.get_id(), forged.key.encode(), encode(forged))
    assert b.dht.value_store.get(forged.key.encode()) is None


async def test_a_kad_request_to_a_peer_without_kad_fails_cleanly_and_the_peer_lives(swarm3) -> None:
    """A client host (no KAD handler) is asked through py-libp2p's own negotiation, never pipelined:
    pipelined bytes after an ``na`` would take a py-libp2p listener's host down."""
    import multiaddr
    from libp2p import new_host
    from libp2p.peer.peerinfo import info_from_p2p_addr

    from pcp_p2p.node.status import fetch_status

    _boot, a, _b = swarm3
    client = new_host(key_pair=Identity.generate().key_pair)
    async with client.run(listen_addrs=[multiaddr.Multiaddr("/ip4/127.0.0.1/tcp/0")]):
        await client.connect(info_from_p2p_addr(multiaddr.Multiaddr(a.addrs()[0])))
        with trio.fail_after(10):
            # identify has not reported the client's protocols yet (py-libp2p's peerstore has no event)
            while not a.host.get_peerstore().get_protocols(client.get_id()):  # noqa: ASYNC110
                await trio.sleep(0.05)
        assert not rpc.speaks_kad(a.host, client.get_id())
        from libp2p.kad_dht.pb.kademlia_pb2 import Message as KadMessage

        # A request whose bytes end in a newline and are not UTF-8: what py-libp2p's
        # listener, after its "na", would take for a proposal and fail to decode.
        nasty = KadMessage(type=KadMessage.MessageType.GET_VALUE, key=b"/pcp/member/\xd5\n")
        assert nasty.SerializeToString().endswith(b"\xd5\n")
        with trio.fail_after(10), pytest.raises(PeerGone):
            await rpc.kad_request(a.host, client.get_id(), nasty)
        # Had the request been pipelined, the client's host would have died with a
        # UnicodeDecodeError, failing this block; it runs on, and a still answers.
        await trio.sleep(0.2)
        assert (await fetch_status(a.addrs()[0])).peer_id == a.peer_id



async def tables_hold_everyone(*nodes) -> None:  # type: ignore[no-untyped-def]
    """Each node's routing table holds every other node (the fixture waits for views only, and
    a table fills in its own time): added here where missing, as the node itself would."""
    for n in nodes:
        for m in nodes:
            if m is not n and not n.dht.routing_table.peer_in_table(m.host.get_id()):
                await n.dht.routing_table.add_peer(m.host.get_id())
            assert m is n or n.dht.routing_table.peer_in_table(m.host.get_id())

async def test_provide_tells_the_tables_closest_peers_without_walking_the_network(swarm3, monkeypatch) -> None:
    """PcpKadDHT.provide announces a CID where a put would store it (the routing table's closest
    peers), with no FIND_NODE walk first: the walk's answers (up to 20 signed peer records each)
    were most of a shepherd's DHT bytes that were not lease puts (issue #15). The library's own
    server takes the announcement, and a lookup from another node finds the provider."""
    from pcp_p2p.dht import table

    boot, a, b = swarm3
    monkeypatch.setattr(table, "MIN_START_PEERS", 1)  # three nodes: not thin for this test

    async def no_walk(*_: object) -> list:
        raise AssertionError("provide walked the network")

    monkeypatch.setattr(a.dht.peer_routing, "find_closest_peers_network", no_walk)
    await tables_hold_everyone(boot, a, b)  # (provide announces at the table's peers: no walk finds others)
    cid = await a.blobs.publish(b"provided without a walk")
    key = table._encode_key(cid)
    with trio.fail_after(10):
        await a.dht.wait_idle()  # (the background part: the table's other peers, the walk)
    for other in (boot, b):
        assert a.host.get_id() in [p.peer_id for p in other.dht.provider_store.get_providers(key)]
    with trio.fail_after(10):
        found = await b.dht.find_providers(cid)
    assert a.host.get_id() in [p.peer_id for p in found]


async def test_add_provider_is_acknowledged_by_the_library_server_and_refused_for_a_bad_key(swarm3) -> None:
    _boot, a, b = swarm3
    key = b"\x12\x20" + bytes(32)  # a sha2-256 multihash
    assert await rpc.add_provider(a.host, b.host.get_id(), key)
    assert a.host.get_id() in [p.peer_id for p in b.dht.provider_store.get_providers(key)]
    with trio.fail_after(10), pytest.raises(PeerGone):  # over 80 bytes: the server resets the stream
        await rpc.add_provider(a.host, b.host.get_id(), bytes(81))


async def test_a_put_with_fewer_replicas_and_no_checkup_stores_at_the_closest_only(swarm3, monkeypatch) -> None:
    """A record its author replaces every few seconds (the shepherd's lease: ``LEASE_REPLICAS``) is
    stored at the routing table's closest peers only, with no walk after: k stores and a walk a
    put cost the holder O(N) a put (issue #15). The full put still reaches every peer."""
    from pcp_p2p.dht import rpc, table

    boot, a, b = swarm3
    monkeypatch.setattr(table, "MIN_START_PEERS", 1)  # three nodes: not thin for this test
    walked: list[object] = []
    real_get_value = rpc.get_value

    async def counting_get_value(*args: object, **kw: object) -> object:
        walked.append(args[1])
        return await real_get_value(*args, **kw)  # type: ignore[arg-type]

    monkeypatch.setattr(rpc, "get_value", counting_get_value)
    signed = a._signed_member_record()
    key = signed.key.encode()
    start, _thin = a.dht._start_peers(key)
    with trio.fail_after(10):
        await a.put_record(signed, replicas=1, checkup=False)
        await a.dht.wait_idle()
    holders = [n for n in (boot, b) if n.dht.value_store.get(key) is not None]
    assert [n.host.get_id() for n in holders] == start[:1] and walked == []
    with trio.fail_after(10):
        await a.put_record(signed)  # the default: every peer the table holds, then the check-up walk
        await a.dht.wait_idle()
    assert all(n.dht.value_store.get(key) is not None for n in (boot, b)) and walked


async def test_providers_announced_at_the_closest_are_found_by_one_lookup_without_a_walk(swarm3, monkeypatch) -> None:
    """A provider record goes to the table's closest peers only (``REFRESHED_REPLICAS``: every
    holder announces its own copy each round, issue #15); a node that holds no record finds it
    with GET_PROVIDERS at the key's closest peers, not py-libp2p's FIND_NODE walk first."""
    from pcp_p2p.dht import table

    boot, a, b = swarm3
    monkeypatch.setattr(table, "MIN_START_PEERS", 1)  # three nodes: not thin for this test

    async def no_walk(*_: object) -> list:
        raise AssertionError("find_providers walked the network")

    for node in (a, b, boot):
        monkeypatch.setattr(node.dht.peer_routing, "find_closest_peers_network", no_walk)
    await tables_hold_everyone(boot, a, b)
    cid = a.blobs.store.put_bytes(b"announced at one peer")
    key = table._encode_key(cid)
    with trio.fail_after(10):
        assert await a.dht.provide(cid, replicas=1)
        await a.dht.wait_idle()
    holders = [n for n in (boot, b) if n.dht.provider_store.get_providers(key)]
    assert len(holders) == 1  # the closest of the two, and only it
    (other,) = [n for n in (boot, b) if n not in holders]
    with trio.fail_after(10):
        found = await other.dht.find_providers(cid)
    assert [p.peer_id for p in found] == [a.host.get_id()] and found[0].addrs
    with trio.fail_after(10):  # a CID nobody provides: every peer asked, nothing found, no walk
        assert await other.dht.find_providers(table._encode_key(cid)[::-1].hex()) == []


async def test_background_work_asked_of_a_stopping_dht_runs_in_the_callers_task(swarm3) -> None:
    """The DHT's nursery is not its callers': a node task (a member record's put) or a KAD
    stream handler may ask for background work while the DHT service stops. trio refuses a
    closed nursery with a RuntimeError, which would take the caller, and the node, down on the
    way out; the work runs in the caller's task instead, and a deferred table check is skipped."""
    _boot, a, _b = swarm3
    table = a.dht.routing_table
    async with trio.open_nursery() as closed:
        pass
    running, table._nursery = table._nursery, closed
    try:
        ran: list[str] = []

        async def work() -> None:
            ran.append("here")

        await a.dht._off_path(work)
        assert ran == ["here"] and a.dht._background == 0
        table._check_later(ID.from_base58(Identity.generate().peer_id))
        assert not table._pending
    finally:
        table._nursery = running
