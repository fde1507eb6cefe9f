"""The membership state machine, driven on trio's MockClock."""

from __future__ import annotations

import dataclasses

import pytest
import trio
import trio.testing

from pcp_p2p.dht.records import sign_record
from pcp_p2p.errors import BadSignature, MalformedMessage, StaleMessage
from pcp_p2p.node.capabilities import Capabilities
from pcp_p2p.node.identity import Identity
from pcp_p2p.node.membership import Heartbeat, MemberJoined, MemberLeft, MemberRecord, Membership, MemberUpdated
from pcp_p2p.wire import encode

CAPS = Capabilities(("local-task",), "cpu", "x86_64", (), 2, 1 << 30, (), 10.0, {}, False)
SELF, A, B = Identity.generate(), Identity.generate(), Identity.generate()


def heartbeat(ident: Identity, seq: int, *, boot: int = 1000, role: str = "worker", claim: str | None = None) -> bytes:
    rec = MemberRecord(ident.peer_id, ("/ip4/127.0.0.1/tcp/1",), role, 0.0, CAPS)
    signed = sign_record(ident, "member", ident.peer_id, rec, ttl_s=600)
    return encode(Heartbeat(claim or ident.peer_id, boot, seq, encode(signed)))


async def test_join_then_leave_after_timeout(autojump_clock: trio.testing.MockClock) -> None:
    m = Membership(SELF.peer_id, timeout=5.0)
    assert m.receive_heartbeat(heartbeat(A, 1), sender=A.peer_id, now=trio.current_time()) == [MemberJoined(A.peer_id)]
    await trio.sleep(5.0)
    assert m.tick(trio.current_time()) == []  # exactly at the timeout: still a member
    await trio.sleep(0.01)
    events = m.tick(trio.current_time())
    assert len(events) == 1 and isinstance(events[0], MemberLeft) and events[0].peer_id == A.peer_id
    assert A.peer_id not in m


async def test_dropped_heartbeats_are_tolerated(autojump_clock: trio.testing.MockClock) -> None:
    """Gossipsub may drop up to four heartbeats in a row without the member leaving."""
    m = Membership(SELF.peer_id, timeout=5.0)
    m.receive_heartbeat(heartbeat(A, 1), sender=A.peer_id, now=trio.current_time())
    for seq in (6, 11, 16):  # seqs 2-5, 7-10, ... dropped
        await trio.sleep(4.9)
        assert m.tick(trio.current_time()) == []
        assert m.receive_heartbeat(heartbeat(A, seq), sender=A.peer_id, now=trio.current_time()) == []
    assert A.peer_id in m


async def test_replayed_heartbeat_is_refused_and_does_not_refresh(autojump_clock: trio.testing.MockClock) -> None:
    m = Membership(SELF.peer_id, timeout=5.0)
    old = heartbeat(A, 1)
    m.receive_heartbeat(old, sender=A.peer_id, now=trio.current_time())
    m.receive_heartbeat(heartbeat(A, 2), sender=A.peer_id, now=trio.current_time())
    await trio.sleep(4.0)
    with pytest.raises(StaleMessage):
        m.receive_heartbeat(old, sender=A.peer_id, now=trio.current_time())
    await trio.sleep(1.5)
    assert [type(e) for e in m.tick(trio.current_time())] == [MemberLeft]


async def test_restart_with_later_boot_is_not_a_replay(autojump_clock: trio.testing.MockClock) -> None:
    m = Membership(SELF.peer_id)
    m.receive_heartbeat(heartbeat(A, 50, boot=1000), sender=A.peer_id, now=trio.current_time())
    m.receive_heartbeat(heartbeat(A, 1, boot=2000), sender=A.peer_id, now=trio.current_time())
    with pytest.raises(StaleMessage):
        m.receive_heartbeat(heartbeat(A, 99, boot=1000), sender=A.peer_id, now=trio.current_time())


async def test_record_change_is_an_update(autojump_clock: trio.testing.MockClock) -> None:
    m = Membership(SELF.peer_id)
    m.receive_heartbeat(heartbeat(A, 1), sender=A.peer_id, now=0.0)
    assert m.receive_heartbeat(heartbeat(A, 2, role="bootstrap"), sender=A.peer_id, now=0.5) == [MemberUpdated(A.peer_id)]
    member = m.get(A.peer_id)
    assert member is not None and member.record.role == "bootstrap"


def test_heartbeat_claiming_another_sender_is_refused() -> None:
    m = Membership(SELF.peer_id)
    with pytest.raises(BadSignature):
        m.receive_heartbeat(heartbeat(A, 1), sender=B.peer_id, now=0.0)
    # B relays A's signed record inside a heartbeat claiming to be B.
    with pytest.raises(BadSignature):
        m.receive_heartbeat(heartbeat(A, 1, claim=B.peer_id), sender=B.peer_id, now=0.0)
    assert len(m) == 0


def test_heartbeat_with_forged_record_is_refused() -> None:
    m = Membership(SELF.peer_id)
    rec = MemberRecord(A.peer_id, (), "worker", 0.0, CAPS)
    signed = sign_record(A, "member", A.peer_id, rec, ttl_s=600)
    forged = dataclasses.replace(signed, signature=B.sign(b"x"))
    with pytest.raises(BadSignature):
        m.receive_heartbeat(encode(Heartbeat(A.peer_id, 1, 1, encode(forged))), sender=A.peer_id, now=0.0)


def test_exact_duplicate_from_gossip_is_dropped_silently() -> None:
    m = Membership(SELF.peer_id)
    hb = heartbeat(A, 3)
    m.receive_heartbeat(hb, sender=A.peer_id, now=0.0)
    assert m.receive_heartbeat(hb, sender=A.peer_id, now=0.5) == []


def test_garbage_heartbeat_is_refused() -> None:
    m = Membership(SELF.peer_id)
    with pytest.raises(MalformedMessage):
        m.receive_heartbeat(b"\x93\x01", sender=A.peer_id, now=0.0)


async def test_many_members_expire_independently(autojump_clock: trio.testing.MockClock) -> None:
    m = Membership(SELF.peer_id, timeout=5.0)
    m.receive_heartbeat(heartbeat(A, 1), sender=A.peer_id, now=trio.current_time())
    await trio.sleep(3.0)
    m.receive_heartbeat(heartbeat(B, 1), sender=B.peer_id, now=trio.current_time())
    await trio.sleep(2.5)
    assert [e.peer_id for e in m.tick(trio.current_time())] == [A.peer_id]
    assert B.peer_id in m
