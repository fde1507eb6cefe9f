"""Signed DHT records and the ``pcp`` namespace validator."""

from __future__ import annotations

import dataclasses
import time

import pytest
from libp2p.records.utils import InvalidRecordType
from libp2p.records.validator import NamespacedValidator

from pcp_p2p.core.errors import (
    BadSignature,
    ExpiredRecord,
    MalformedMessage,
    OversizedMessage,
    VerificationError,
)
from pcp_p2p.core.identity import Identity
from pcp_p2p.dht.records import SignedRecord, record_key, sign_record, verify_record
from pcp_p2p.dht.validator import PcpRecordValidator
from pcp_p2p.net.capabilities import Capabilities
from pcp_p2p.net.membership import MemberRecord
from pcp_p2p.node.record_kinds import RECORD_KINDS
from pcp_p2p.wire import encode, signing_bytes

CAPS = Capabilities(("local-task",), "cpu", "x86_64", ("avx2",), 2, 1 << 30, (), 10.0, {"pcp": "0"}, False)
ALICE, BOB = Identity.generate(), Identity.generate()


def member(ident: Identity, peer_id: str | None = None) -> MemberRecord:
    return MemberRecord(peer_id or ident.peer_id, ("/ip4/127.0.0.1/tcp/1",), "worker", 0.0, CAPS)


def signed(ident: Identity = ALICE, **kw: object) -> SignedRecord:
    return sign_record(ident, "member", ident.peer_id, member(ident), ttl_s=60, **kw)  # type: ignore[arg-type]


def test_valid_record_is_accepted() -> None:
    rec = signed()
    out = verify_record(encode(rec), key=rec.key, kinds=RECORD_KINDS)
    assert out.payload == member(ALICE)


def test_unsigned_record_is_refused() -> None:
    rec = dataclasses.replace(signed(), signature=b"")
    with pytest.raises(BadSignature):
        verify_record(encode(rec), kinds=RECORD_KINDS)


def test_wrongly_signed_record_is_refused() -> None:
    rec = signed()
    forged = dataclasses.replace(rec, signature=BOB.sign(signing_bytes(rec)))
    with pytest.raises(BadSignature):
        verify_record(encode(forged), kinds=RECORD_KINDS)


def test_tampered_payload_is_refused() -> None:
    rec = signed()
    tampered = dataclasses.replace(rec, payload=encode(dataclasses.replace(member(ALICE), role="bootstrap")))
    with pytest.raises(BadSignature):
        verify_record(encode(tampered), kinds=RECORD_KINDS)


def test_expired_and_future_records_are_refused() -> None:
    old = signed(now=time.time() - 3600)
    with pytest.raises(ExpiredRecord):
        verify_record(encode(old), kinds=RECORD_KINDS)
    future = signed(now=time.time() + 3600)
    with pytest.raises(ExpiredRecord):
        verify_record(encode(future), kinds=RECORD_KINDS)


def test_record_claiming_another_peers_identity_is_refused() -> None:
    # Bob signs a record under Alice's key name.
    rec = sign_record(BOB, "member", ALICE.peer_id, member(ALICE), ttl_s=60)
    with pytest.raises(BadSignature):
        verify_record(encode(rec), kinds=RECORD_KINDS)
    # Bob signs a record under his own key whose payload claims to be Alice.
    rec = sign_record(BOB, "member", BOB.peer_id, member(BOB, ALICE.peer_id), ttl_s=60)
    with pytest.raises(BadSignature):
        verify_record(encode(rec), kinds=RECORD_KINDS)


def test_record_stored_under_another_key_is_refused() -> None:
    rec = signed()
    with pytest.raises(VerificationError):
        verify_record(encode(rec), key=record_key("member", BOB.peer_id), kinds=RECORD_KINDS)


def test_unknown_kind_and_bad_keys_are_refused() -> None:
    with pytest.raises(MalformedMessage):
        verify_record(encode(sign_record(ALICE, "nosuchkind", "x", member(ALICE), ttl_s=60)), kinds=RECORD_KINDS)
    rec = dataclasses.replace(signed(), key="/other/member/x")
    with pytest.raises(MalformedMessage):
        verify_record(encode(rec), kinds=RECORD_KINDS)


def test_oversized_record_is_refused() -> None:
    with pytest.raises(OversizedMessage):
        verify_record(b"\x00" * (64 * 1024), kinds=RECORD_KINDS)


def test_validator_select_prefers_newest_and_ignores_invalid() -> None:
    v = PcpRecordValidator(RECORD_KINDS)
    t = time.time()
    older = encode(signed(now=t - 10, seq=5))
    newer = encode(signed(now=t, seq=1))
    same_time_higher_seq = encode(signed(now=t, seq=2))
    invalid = encode(dataclasses.replace(signed(now=t + 5), signature=b"\x00" * 64))
    key = record_key("member", ALICE.peer_id)
    assert v.select(key, [older, newer]) == 1
    assert v.select(key, [newer, older]) == 0
    assert v.select(key, [newer, same_time_higher_seq]) == 1
    assert v.select(key, [invalid, older]) == 1
    with pytest.raises(ValueError):
        v.select(key, [invalid])


def test_strict_namespace_refuses_other_namespaces() -> None:
    ns = NamespacedValidator({"pcp": PcpRecordValidator(RECORD_KINDS)}, strict_validation=True)
    rec = signed()
    ns.validate(rec.key, encode(rec))
    with pytest.raises(InvalidRecordType):
        ns.validate("/other/key", b"anything")
    with pytest.raises(InvalidRecordType):
        ns.validate("plain-key", b"anything")


def test_kinds_ordered_by_seq_let_the_higher_term_win_whatever_the_clock() -> None:
    from pcp_p2p.diloco.protocol.election import Lease
    from pcp_p2p.diloco.protocol.messages import sign

    v = PcpRecordValidator(RECORD_KINDS)
    t = time.time()

    def lease(ident: Identity, term: int, issued: float) -> bytes:
        body = sign(Lease("run", term, ident.peer_id, issued, issued, issued + 30, 0, "", ""), ident)
        return encode(sign_record(ident, "lease", "run", body, ttl_s=60, seq=term, now=issued))

    deposed_renewing = lease(ALICE, 3, t)  # issued later...
    newer_term = lease(BOB, 4, t - 5)  # ...than the next term's lease (clock skew)
    assert v.select(record_key("lease", "run"), [deposed_renewing, newer_term]) == 1
