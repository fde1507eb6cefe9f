"""Signed, expiring records in the DHT's ``pcp`` namespace.

Every value PCP puts in the DHT is a :class:`SignedRecord` envelope: the DHT
key it is for, who signed it, when, until when it is valid, a sequence number,
and the payload (another wire message). The key is inside the signed bytes, so
a record cannot be replayed under another key; the signer's peer id embeds its
Ed25519 public key, so a record is checked with no key lookup.

Why our own envelope rather than py-libp2p's record signatures: libp2p's
record TTL is a fixed 24 h and its signatures are optional on the wire; PCP
needs expiry in minutes (membership, leases), a "newest wins" order that
survives a restart (``issued_at``, then ``seq``), and per-kind rules about who
may sign which key. Keys carry the kind: ``/pcp/<kind>/<name>``.

What each kind may hold and who may sign it is a :class:`KindRule`, declared
next to its payload type by the module that owns the kind; every check here
takes the table of kinds it accepts (``kinds``) as an argument. The node's table,
every kind of the protocol, is :data:`pcp_p2p.node.record_kinds.RECORD_KINDS`: one static
table, so no kind depends on which modules happen to have been imported.
"""

from __future__ import annotations

import hashlib
import time
from collections import OrderedDict
from collections.abc import Callable, Mapping
from dataclasses import dataclass

from pcp_p2p.core.errors import (
    BadSignature,
    ExpiredRecord,
    MalformedMessage,
    OversizedMessage,
    VerificationError,
)
from pcp_p2p.core.identity import Identity, verify_signature
from pcp_p2p.wire import Message, decode, encode, signing_bytes, wire_message

NAMESPACE = "pcp"
MAX_RECORD_SIZE = 16 * 1024
MAX_TTL_S = 7 * 24 * 3600.0
CLOCK_SKEW_S = 120.0  # a signer's clock may run this far ahead of ours
VERIFIED_CACHE_SIZE = 4096  # records whose signature and shape were checked, by content digest


@wire_message("dht.record", max_size=MAX_RECORD_SIZE)
class SignedRecord(Message):
    key: str
    signer: str
    issued_at: float
    expires_at: float
    seq: int
    payload: bytes
    signature: bytes = b""


def signer_is_name(name: str, signer: str, payload: Message) -> None:
    """The default rule: only the peer named in the key may sign it (and the payload may not name another)."""
    if name != signer:
        raise BadSignature(f"record for {name!r:.60} signed by someone else ({signer})")
    if getattr(payload, "peer_id", signer) != signer:
        raise BadSignature("record payload claims another peer's identity")


@dataclass(frozen=True)
class KindRule:
    """What a record kind must satisfy beyond a valid signature and expiry."""

    payload_type: type[Message]
    # Given (name part of the key, signer, decoded payload): raise if not allowed.
    check: Callable[[str, str, Message], None] = signer_is_name
    # Which of two valid records wins: "time" = newest issued (then seq);
    # "seq" = highest seq (then newest), for kinds whose seq is a term (a deposed
    # shepherd that keeps renewing must not shadow a newer term, whatever the clocks say).
    order: str = "time"

    def __post_init__(self) -> None:
        if self.order not in ("time", "seq"):
            raise ValueError("order is 'time' or 'seq'")


def record_key(kind: str, name: str) -> str:
    return f"/{NAMESPACE}/{kind}/{name}"


def split_record_key(key: str) -> tuple[str, str]:
    parts = key.split("/", 3)
    if len(parts) != 4 or parts[0] != "" or parts[1] != NAMESPACE or not parts[2] or not parts[3]:
        raise MalformedMessage(f"not a /{NAMESPACE}/<kind>/<name> key: {key!r:.80}")
    return parts[2], parts[3]


def sign_record(
    identity: Identity,
    kind: str,
    name: str,
    payload: Message,
    *,
    ttl_s: float,
    seq: int = 0,
    now: float | None = None,
) -> SignedRecord:
    issued = time.time() if now is None else now
    rec = SignedRecord(
        key=record_key(kind, name),
        signer=identity.peer_id,
        issued_at=issued,
        expires_at=issued + ttl_s,
        seq=seq,
        payload=encode(payload),
    )
    return _with_signature(rec, identity)


def _with_signature(rec: SignedRecord, identity: Identity) -> SignedRecord:
    from dataclasses import replace

    return replace(rec, signature=identity.sign(signing_bytes(rec)))


@dataclass(frozen=True)
class VerifiedRecord:
    record: SignedRecord
    kind: str
    name: str
    payload: Message


_verified: OrderedDict[bytes, tuple[VerifiedRecord, KindRule]] = OrderedDict()


def verify_record(
    data: bytes, *, kinds: Mapping[str, KindRule], key: str | None = None, now: float | None = None
) -> VerifiedRecord:
    """Decode and check a record of one of ``kinds``; raise a typed error on any problem.

    Checks, in order: size and shape, the key it is stored under, the kind's
    payload type, the signature by the claimed signer, the validity window, and
    the kind's rule about who may sign the key.

    The checks that depend on nothing but the bytes (shape, signature, payload,
    the kind's rule) are remembered by content digest: one record is checked by
    the DHT validator when it arrives, again when a lookup selects it and when
    ``get_record`` hands it out, and every replica of it is the same bytes. The
    key and the validity window are checked on every call.
    """
    if len(data) > MAX_RECORD_SIZE:
        raise OversizedMessage(f"record of {len(data)} bytes > {MAX_RECORD_SIZE}")
    digest = hashlib.blake2b(data, digest_size=32).digest()
    hit = _verified.get(digest)
    if hit is not None and kinds.get(hit[0].kind) is hit[1]:
        _verified.move_to_end(digest)
        verified = hit[0]
    else:
        verified, rule = _verify_content(data, kinds)
        _verified[digest] = (verified, rule)
        if len(_verified) > VERIFIED_CACHE_SIZE:
            _verified.popitem(last=False)
    rec = verified.record
    if key is not None and rec.key != key:
        raise VerificationError(f"record for {rec.key!r:.80} stored under {key!r:.80}")
    t = time.time() if now is None else now
    if rec.expires_at <= t:
        raise ExpiredRecord(f"record {rec.key} expired {t - rec.expires_at:.0f} s ago")
    if rec.issued_at > t + CLOCK_SKEW_S:
        raise ExpiredRecord(f"record {rec.key} issued {rec.issued_at - t:.0f} s in the future")
    return verified


def _verify_content(data: bytes, kinds: Mapping[str, KindRule]) -> tuple[VerifiedRecord, KindRule]:
    """The checks of :func:`verify_record` that depend on the bytes alone."""
    rec = decode(data, SignedRecord)
    kind, name = split_record_key(rec.key)
    rule = kinds.get(kind)
    if rule is None:
        raise MalformedMessage(f"unknown record kind {kind!r:.40}")
    verify_signature(rec.signer, signing_bytes(rec), rec.signature)
    if not (rec.expires_at > rec.issued_at and rec.expires_at - rec.issued_at <= MAX_TTL_S):
        raise ExpiredRecord("record validity window is empty or too long")
    payload = decode(rec.payload, rule.payload_type)
    rule.check(name, rec.signer, payload)
    return VerifiedRecord(rec, kind, name, payload), rule


def newer(a: SignedRecord, b: SignedRecord, kinds: Mapping[str, KindRule]) -> bool:
    """True if ``a`` supersedes ``b``: newest wins (issued_at, then seq), or for
    kinds ordered by seq, highest seq (then issued_at)."""
    try:
        rule = kinds.get(split_record_key(a.key)[0])
    except MalformedMessage:
        rule = None
    if rule is not None and rule.order == "seq":
        return (a.seq, a.issued_at) > (b.seq, b.issued_at)
    return (a.issued_at, a.seq) > (b.issued_at, b.seq)
