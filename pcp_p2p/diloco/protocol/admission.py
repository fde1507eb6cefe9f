"""Run admission: who may contribute to a run, and who may lead it (sans-IO).

Every peer is a stranger. The run owner says in the signed spec who may take
part (``[admission]``: ``mode = "open"`` or ``"allowlist"``, and ``shepherds``,
the peers that may be elected shepherd) and may amend the list later with an
:class:`AllowlistUpdate` it signs. :class:`Admission` holds the result and
answers two questions for the shepherd, the election and the runtime:
:meth:`Admission.admits` (may this peer join and submit?) and
:meth:`Admission.may_lead` (may it be a shepherd candidate?). It also consults
this node's reputation ledger (:mod:`pcp_p2p.diloco.run.reputation`): a peer banned
on audit evidence is refused whatever the lists say.

Why an update states the *whole* amendment rather than a change to the previous
update: the DHT keeps one value per key (the highest ``seq`` wins), and a node
that starts late or missed a direct message sees only that value. If update
``n`` said "add B" relative to update ``n-1``, a node seeing only ``n`` would
miss every earlier change. So update ``n`` says, relative to the signed spec,
which peers are added and which removed, and the newest update alone defines
the list; ``pcp run admit`` merges the owner's new ``--add``/``--remove`` into
the latest update it finds (:func:`amend`).

Who is admitted::

    open:       everyone                                   − remove − banned
    allowlist:  ({owner} ∪ spec.allowlist ∪ add)           − remove − banned
    may lead:   admitted, and in spec.shepherds when that list is not empty

(``remove`` in an open run is the owner's deny list; the owner is admitted to
its own allowlist run unless it removes itself.)

What :meth:`Admission.apply` refuses, checked in this order:

=====================================  ========================================
update                                 error
=====================================  ========================================
for another run id                     :class:`~pcp_p2p.core.errors.VerificationError`
naming another owner than the run's    :class:`~pcp_p2p.core.errors.BadSignature`
signature not by the owner (forged)    :class:`~pcp_p2p.core.errors.BadSignature`
issued further ahead than the skew     :class:`~pcp_p2p.core.errors.ExpiredRecord`
``seq`` not above the applied one      :class:`~pcp_p2p.core.errors.StaleMessage`
(a replay, or an older update)
=====================================  ========================================

Where updates are kept: the DHT record ``/pcp/allowlist/<run id>.<owner>``
(:data:`ALLOWLIST_KIND`). The owner's peer id is part of the key, and the kind's
rule refuses any signer but that owner and any payload whose run id or owner
disagree with the key, so a stranger can neither write under the owner's key
nor make readers look at a key of its own. Records are ordered by ``seq``.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable
from typing import Protocol, TypeVar

from pcp_p2p.core.errors import BadSignature, ExpiredRecord, StaleMessage, VerificationError
from pcp_p2p.core.identity import Identity
from pcp_p2p.dht.records import CLOCK_SKEW_S, MAX_TTL_S, KindRule, SignedRecord, sign_record
from pcp_p2p.diloco.protocol.messages import sign, verify
from pcp_p2p.diloco.protocol.spec import AdmissionPolicy, SignedRunSpec, run_id_of, verify_spec
from pcp_p2p.wire import Message, wire_message

ALLOWLIST_KIND = "allowlist"
MAX_AMENDED = 200
"""Peers an update may add and remove, together. A peer id is 52 characters, so
200 of them keep the signed update inside one 16 KiB DHT record."""
MAX_PEER_ID_CHARS = 128


@wire_message("diloco.allowlist", max_size=14 * 1024)
class AllowlistUpdate(Message):
    """The owner's amendment to a run's admission list, relative to the signed spec.

    ``seq`` grows with every update; the newest alone is the amendment in
    force (see the module docstring for why it is cumulative). ``issued`` is
    the owner's clock, for the record only: order is by ``seq``.
    """

    run_id: str
    owner: str
    seq: int
    add: tuple[str, ...]
    remove: tuple[str, ...]
    issued: float
    signature: bytes = b""

    def __post_init__(self) -> None:
        if self.seq < 1:
            raise ValueError("an allowlist update's seq starts at 1")
        if len(self.add) + len(self.remove) > MAX_AMENDED:
            raise ValueError(f"an allowlist update names at most {MAX_AMENDED} peers")
        for peers in (self.add, self.remove):
            if len(set(peers)) != len(peers):
                raise ValueError("an allowlist update names a peer twice")
            if not all(0 < len(p) <= MAX_PEER_ID_CHARS for p in peers):
                raise ValueError("an allowlist update names an empty or overlong peer id")
        if set(self.add) & set(self.remove):
            raise ValueError("an allowlist update both adds and removes a peer")
        if not math.isfinite(self.issued):
            raise ValueError("an allowlist update's issue time is not a number")


def sign_update(
    identity: Identity,
    run_id: str,
    seq: int,
    *,
    add: Iterable[str] = (),
    remove: Iterable[str] = (),
    now: float,
) -> AllowlistUpdate:
    """An update signed by ``identity`` (it must be the run's owner to count).

    Raises ``ValueError`` for bad bounds (a local caller's mistake; the CLI turns
    it into a :class:`~pcp_p2p.core.errors.ConfigError`).
    """
    update = AllowlistUpdate(
        run_id=run_id, owner=identity.peer_id, seq=seq,
        add=tuple(sorted(set(add))), remove=tuple(sorted(set(remove))), issued=now,
    )
    return sign(update, identity)


def verify_update(update: AllowlistUpdate) -> None:
    """Raise :class:`~pcp_p2p.core.errors.BadSignature` unless the named owner signed ``update``."""
    verify(update, update.owner)


def amend(
    prev: AllowlistUpdate | None,
    identity: Identity,
    run_id: str,
    *,
    add: Iterable[str] = (),
    remove: Iterable[str] = (),
    now: float,
) -> AllowlistUpdate:
    """The next update: ``prev``'s amendment with ``add``/``remove`` applied on top.

    A peer both added and removed in the same call is a ``ValueError``; a peer
    removed earlier and added now is re-admitted (and vice versa).
    """
    add, remove = set(add), set(remove)
    if add & remove:
        raise ValueError(f"peers both added and removed: {', '.join(sorted(add & remove))}")
    old_add = set(prev.add) if prev is not None else set()
    old_remove = set(prev.remove) if prev is not None else set()
    seq = prev.seq + 1 if prev is not None else 1
    return sign_update(
        identity, run_id, seq, add=(old_add - remove) | add, remove=(old_remove - add) | remove, now=now
    )


# --- the DHT record -------------------------------------------------------------


def owner_record_name(run_id: str, owner: str) -> str:
    """The name ``<run id>.<owner>`` of a record a run's owner stores (allowlist, stop):
    the owner's peer id is part of the key, so no one else can take the key first."""
    return f"{run_id}.{owner}"


allowlist_name = owner_record_name


class OwnerSigned(Protocol):
    """A payload the run's owner signs (an allowlist update, a stop order)."""

    @property
    def run_id(self) -> str: ...
    @property
    def owner(self) -> str: ...


OS = TypeVar("OS", bound=OwnerSigned)


def owner_signed_rule(what: str, payload_type: type[OS], verify_payload: Callable[[OS], None]
                      ) -> Callable[[str, str, Message], None]:
    """The DHT rule of a record only a run's owner may store: under its own
    ``<run id>.<owner>`` name, signed by the owner the payload names, and the
    payload's own signature checked by ``verify_payload``."""

    def check(name: str, signer: str, payload: object) -> None:  # the kind rule passes a Message
        assert isinstance(payload, payload_type)
        if name != owner_record_name(payload.run_id, payload.owner):
            raise VerificationError(f"{what} stored under another run's or owner's key")
        if signer != payload.owner:
            raise BadSignature(f"a {what} record must be stored by the owner it names")
        verify_payload(payload)

    return check


ALLOWLIST_RULE = KindRule(AllowlistUpdate, owner_signed_rule("allowlist update", AllowlistUpdate, verify_update),
                          order="seq")


def update_record(update: AllowlistUpdate, identity: Identity, *, now: float) -> SignedRecord:
    """The DHT record for ``update``, with the record's ``seq`` = the update's (the highest wins)."""
    return sign_record(
        identity, ALLOWLIST_KIND, allowlist_name(update.run_id, update.owner), update,
        ttl_s=MAX_TTL_S, seq=update.seq, now=now,
    )


# --- the admission state -----------------------------------------------------------


class BanSource(Protocol):
    """Where bans come from (the node's :class:`~pcp_p2p.diloco.run.reputation.ReputationLedger`)."""

    def ban_reason(self, peer: str) -> str | None:
        """Why ``peer`` is banned from the run, or None if it is not."""
        ...


class Admission:
    """Who may contribute to one run and who may lead it, as this node knows it.

    Pure: fed verified specs and updates with the time, asked questions; it never
    reads the clock or the network. The bans it consults live in the ledger.
    """

    def __init__(self, run_id: str, owner: str, policy: AdmissionPolicy, bans: BanSource | None = None) -> None:
        self.run_id = run_id
        self.owner = owner
        self.policy = policy
        self.bans = bans
        self.latest: AllowlistUpdate | None = None
        self._listed = frozenset({owner, *policy.allowlist})
        self._shepherds = frozenset(policy.shepherds)
        self._added: frozenset[str] = frozenset()
        self._removed: frozenset[str] = frozenset()

    @classmethod
    def for_run(cls, signed: SignedRunSpec, bans: BanSource | None = None) -> Admission:
        """Admission for a signed spec (verified here: its rules are only as good as its signature)."""
        spec = verify_spec(signed)
        return cls(run_id_of(signed), signed.owner, spec.admission, bans)

    @property
    def seq(self) -> int:
        """The ``seq`` of the update in force (0: the spec's lists as signed)."""
        return self.latest.seq if self.latest is not None else 0

    def apply(self, update: AllowlistUpdate, now: float) -> None:
        """Put ``update`` in force, or raise (see the module's table); nothing changes on a refusal."""
        if update.run_id != self.run_id:
            raise VerificationError(f"allowlist update for another run {update.run_id:.20}")
        if update.owner != self.owner:
            raise BadSignature(f"allowlist update by {update.owner:.16}…, not the run's owner")
        verify_update(update)
        if update.issued > now + CLOCK_SKEW_S:
            raise ExpiredRecord(f"allowlist update issued {update.issued - now:.0f} s in the future")
        if update.seq <= self.seq:
            raise StaleMessage(f"allowlist update #{update.seq}; #{self.seq} is already in force")
        self.latest = update
        self._added = frozenset(update.add)
        self._removed = frozenset(update.remove)

    def why_not(self, peer: str, *, lead: bool = False, local_bans: bool = True) -> str | None:
        """None if ``peer`` is admitted (and, with ``lead``, may be shepherd); else a one-line reason.

        Shaped to be the shepherd's ``admit`` callable: ``Shepherd(admit=admission.why_not)``.
        ``local_bans=False`` answers from the owner's signed lists alone, which
        every node of the run holds alike (bans are each node's own): what a
        rule that all nodes must compute the same way, such as the election's
        candidate ranking, should use.
        """
        reason = self.bans.ban_reason(peer) if self.bans is not None and local_bans else None
        if reason is not None:
            return f"banned from this run: {reason}"
        if peer in self._removed:
            return f"removed by the owner's allowlist update #{self.seq}"
        if self.policy.mode == "allowlist" and peer not in self._listed and peer not in self._added:
            return "not on the run's allowlist"
        if lead and self._shepherds and peer not in self._shepherds:
            return "not among the run's shepherds"
        return None

    def admits(self, peer: str) -> bool:
        """May ``peer`` join the run and submit?"""
        return self.why_not(peer) is None

    def may_lead(self, peer: str, *, local_bans: bool = True) -> bool:
        """May ``peer`` be a shepherd candidate (admitted, and listed in ``shepherds`` if any are)?"""
        return self.why_not(peer, lead=True, local_bans=local_bans) is None

    def members(self) -> frozenset[str] | None:
        """The admitted peers before bans, for an allowlist run; None for an open one."""
        if self.policy.mode != "allowlist":
            return None
        return (self._listed | self._added) - self._removed

