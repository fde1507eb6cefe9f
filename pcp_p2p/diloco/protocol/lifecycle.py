"""An owner's run lifecycle: stopping a run, and the phase a run shows (sans-IO).

A run ends by itself after its last round. Its owner may end it earlier with a
:class:`StopOrder` it signs (``pcp run stop``). Every node checks the whole
chain of authority before the stop has any effect: the order must name this
run, name the run's owner (the owner is fixed by the signed run spec, which
hashes to the run id), carry that owner's signature, and not be dated far in
the future. A node that accepts it ends the run for good: its worker stops
training, its shepherd stops announcing, the run's pins are released as on a
normal end (:meth:`~pcp_p2p.diloco.run.pins.RunPins.on_finish`), and the order is
kept in the run's folder so a restarted node does not take the run up again.

What :meth:`StopLatch.apply` refuses, checked in this order:

=====================================  ========================================
stop order                             error
=====================================  ========================================
for another run id                     :class:`~pcp_p2p.core.errors.VerificationError`
naming another owner than the run's    :class:`NotOwner` (a :class:`~pcp_p2p.core.errors.BadSignature`)
signature not by the owner (forged)    :class:`~pcp_p2p.core.errors.BadSignature`
issued further ahead than the skew     :class:`~pcp_p2p.core.errors.ExpiredRecord`
the run is already stopped (a replay)  :class:`~pcp_p2p.core.errors.StaleMessage`
=====================================  ========================================

How it travels, like an allowlist update (:mod:`pcp_p2p.diloco.protocol.admission`):
the owner hands it directly to every live member taking part in the run and
stores it in the DHT under ``/pcp/stop/<run id>.<owner>`` (:data:`STOP_KIND`).
The owner's peer id is part of the key and the kind's rule accepts only that
owner's signature over an order for that run, so a stranger cannot store a
stop where readers look, nor shadow the owner's. Nodes look the record up when
they take up a run and every :data:`STOP_LOOKUP_EVERY_S` after (or, in a run of
more than four members, every 8 s times the members: the whole run looks about
once per 8 s, see ``owner_lookup_every``), so a node that was down when the stop
went out learns it when it comes back, and one that missed it while up soon after.

The phase (:func:`run_phase`) is what ``pcp status``, the dashboard and
``pcp run status`` show for a run. Before the first round is announced every
worker's own machine is idle, which used to show as ``round 0 idle`` while the
shepherd was compiling or the run lacked a quorum; the phase says which.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from pcp_p2p.core.errors import BadSignature, ExpiredRecord, StaleMessage, VerificationError
from pcp_p2p.core.identity import Identity
from pcp_p2p.dht.records import CLOCK_SKEW_S, MAX_TTL_S, KindRule, SignedRecord, sign_record
from pcp_p2p.diloco.protocol.admission import owner_record_name, owner_signed_rule
from pcp_p2p.diloco.protocol.messages import sign, verify
from pcp_p2p.wire import Message, wire_message

STOP_KIND = "stop"
STOP_FILE = "stop.order"
"""Where a node keeps the stop order it accepted, in the run's folder."""
STOP_LOOKUP_EVERY_S = 30.0
MAX_REASON_CHARS = 200

# Phases (the strings every view shows). Others come from the round machines
# (the worker's idle, fetching, training, submitted) and the runtime (starting,
# electing, joining).
FINISHED = "finished"
STOPPED = "stopped"
COMPILING = "compiling"
WAITING_FOR_QUORUM = "waiting for quorum"
SETUP_FAILED = "set-up failed"
ENDED = (FINISHED, STOPPED)


class NotOwner(BadSignature):
    """A stop order (or other owner-only message) signed by someone other than the run's owner."""


@wire_message("diloco.stop", max_size=2 * 1024)
class StopOrder(Message):
    """The owner ends run ``run_id``. ``issued`` is the owner's clock (for the record and the skew check)."""

    run_id: str
    owner: str
    issued: float
    reason: str = ""
    signature: bytes = b""

    def __post_init__(self) -> None:
        if not math.isfinite(self.issued):
            raise ValueError("a stop order's issue time is not a number")
        if len(self.reason) > MAX_REASON_CHARS:
            raise ValueError(f"a stop order's reason is at most {MAX_REASON_CHARS} characters")


def sign_stop(identity: Identity, run_id: str, *, now: float, reason: str = "") -> StopOrder:
    """A stop order signed by ``identity`` (it must be the run's owner to count).

    ``ValueError`` for a reason above :data:`MAX_REASON_CHARS` (the CLI's ConfigError).
    """
    return sign(StopOrder(run_id=run_id, owner=identity.peer_id, issued=now, reason=reason), identity)


def verify_stop(stop: StopOrder) -> None:
    """Raise :class:`~pcp_p2p.core.errors.BadSignature` unless the peer the order names signed it."""
    verify(stop, stop.owner)


class StopLatch:
    """Whether one run is stopped on this node, and by which order. Pure: fed orders and the time."""

    def __init__(self, run_id: str, owner: str) -> None:
        self.run_id = run_id
        self.owner = owner
        self.order: StopOrder | None = None

    @property
    def stopped(self) -> bool:
        return self.order is not None

    def check(self, stop: StopOrder, now: float) -> None:
        """Raise (see the module's table) unless ``stop`` would stop this run now."""
        if stop.run_id != self.run_id:
            raise VerificationError(f"stop order for another run {stop.run_id:.20}")
        if stop.owner != self.owner:
            raise NotOwner(f"stop order by {stop.owner:.16}…, not the run's owner")
        verify_stop(stop)
        if stop.issued > now + CLOCK_SKEW_S:
            raise ExpiredRecord(f"stop order issued {stop.issued - now:.0f} s in the future")
        if self.order is not None:
            raise StaleMessage("the run is already stopped")

    def apply(self, stop: StopOrder, now: float) -> None:
        """Put ``stop`` in force, or raise; nothing changes on a refusal."""
        self.check(stop, now)
        self.order = stop


# --- the DHT record -------------------------------------------------------------


stop_name = owner_record_name


STOP_RULE = KindRule(StopOrder, owner_signed_rule("stop order", StopOrder, verify_stop))


def stop_record(stop: StopOrder, identity: Identity, *, now: float) -> SignedRecord:
    """The DHT record for ``stop`` (kept as long as a run record)."""
    return sign_record(identity, STOP_KIND, stop_name(stop.run_id, stop.owner), stop, ttl_s=MAX_TTL_S, now=now)


# --- the phase a run shows ----------------------------------------------------------


@dataclass(frozen=True)
class PhaseInputs:
    """What one node knows that decides the phase it shows for a run."""

    base: str  # the runtime's own phase (starting, electing, joining, or the worker's)
    ended: bool = False  # finished or stopped: ``base`` says which
    setup_error: str | None = None  # this node, as shepherd, could not set the run up
    compiling: bool = False  # this node is building the run's artifacts to lead a term
    shepherd_state: str | None = None  # what the shepherd's member record says it is doing
    started: bool = False  # a round was announced to this node, or a commit seen
    members: int = 0  # nodes taking part (the shepherd's roster, else the member records)
    quorum: int = 1


def run_phase(p: PhaseInputs) -> str:
    """The phase to show: an end first, then a set-up failure, compiling, and a missing quorum.

    A worker cannot see the shepherd's machine; it reads what the shepherd's
    member record says (``compiling`` or ``set-up failed: ...``) while no round
    has been announced to it.
    """
    if p.ended:
        return p.base
    if p.setup_error is not None:
        return f"{SETUP_FAILED}: {p.setup_error}"
    if p.compiling:
        return COMPILING
    if not p.started:
        state = p.shepherd_state or ""
        if state == COMPILING or state.startswith(SETUP_FAILED):
            return state
        if p.members < p.quorum:
            return f"{WAITING_FOR_QUORUM} ({p.members}/{p.quorum})"
    return p.base


# --- what `pcp run status` shows ------------------------------------------------------

SUMMARY_KEYS = ("run_id", "name", "owner", "phase", "round", "rounds", "shepherd", "term", "participants",
                "quorum", "loss", "val_loss", "is_shepherd", "members")
"""The keys of a run's status that a node serves for every run it takes part in (``runs``)."""


def summary_of(status: dict[str, Any]) -> dict[str, Any]:
    """A run's status without its history: small enough to serve for every run a node has."""
    return {k: status.get(k) for k in SUMMARY_KEYS}


def describe_run(
    *,
    run_id: str,
    name: str,
    owner: str,
    rounds: int,
    quorum: int,
    committed: int,
    val_loss: float | None,
    stopped: StopOrder | None,
    members: list[str],
    shepherd: str | None,
    term: int | None,
    reported: dict[str, Any] | None,
) -> dict[str, Any]:
    """What ``pcp run status --json`` prints, from what a client can learn in the swarm.

    ``committed``: rounds committed (the DHT's commit record); ``reported``: a
    member's :func:`summary_of` for the run (its phase), if one answered.
    Rounds are 1-based: with 2 of 12 rounds committed the run is in round 3/12.
    """
    if committed >= rounds:
        phase = FINISHED  # a stop that came after the last commit changed nothing
    elif stopped is not None:
        phase = STOPPED
    elif reported is not None and reported.get("phase"):
        phase = str(reported["phase"])
    elif not members:
        phase = "no node is taking part"
    else:
        phase = "unknown (no member answered)"
    return {
        "run_id": run_id,
        "name": name,
        "owner": owner,
        "phase": phase,
        "round": min(committed + 1, rounds),
        "rounds": rounds,
        "committed": committed,
        "shepherd": shepherd,
        "term": term,
        "members": len(members),
        "quorum": quorum,
        "val_loss": val_loss,
        "stop_reason": stopped.reason if stopped is not None else None,
    }


def status_line(view: dict[str, Any]) -> str:
    """One line for ``pcp run watch``: phase, round, shepherd, members/quorum, last val loss."""
    shepherd = view.get("shepherd")
    val = view.get("val_loss")
    return (f"{view['phase']} · round {view['round']}/{view['rounds']} ({view['committed']} committed) · "
            f"shepherd {shepherd[-8:] if shepherd else '-'} · members {view['members']}/{view['quorum']} · "
            f"val loss {f'{val:.4f}' if isinstance(val, (int, float)) else '-'}")
