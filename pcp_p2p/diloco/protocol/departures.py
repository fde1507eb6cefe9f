"""Announced departures: a node stopping gracefully tells its runs so that nobody waits for it.

Without this a node that left with Ctrl+C looked exactly like one that was
SIGKILLed: the round in flight waited out its whole deadline for the leaver's
submission, and a leaving shepherd's term ran until its lease lapsed plus the
grace. With it:

- the leaver, while it stops (a bounded farewell: :func:`pcp_p2p.core.shutdown.add_farewell`),
  sends a signed :class:`~pcp_p2p.diloco.protocol.messages.Leave` to the run's shepherd, or, if it
  is the shepherd, to every member of the run;
- the shepherd drops the leaver from the roster and from the round in flight at once
  (:meth:`Shepherd.on_leave <pcp_p2p.diloco.protocol.shepherd.Shepherd.on_leave>`), so the round
  closes as soon as everyone *else* has reported, and relays the ``Leave`` to the run;
- every member's election forgets the leaver as a candidate, and fails over at once when
  the leaver held the term (:meth:`Election.on_departure
  <pcp_p2p.diloco.protocol.election.Election.on_departure>`).

Every peer is a stranger, so :class:`Departures` checks the whole chain before any
of that: the ``Leave`` is for this run, signed by the peer it names, sent by that
peer (or relayed by the shepherd of the current term), fresh, and not a replay.
A forged departure therefore cannot push an honest worker out of a round.
"""

from __future__ import annotations

from pcp_p2p.core.errors import BadSignature, StaleMessage, VerificationError
from pcp_p2p.core.identity import Identity
from pcp_p2p.diloco.protocol.messages import Leave, sign, verify

LEAVE_FRESH_S = 30.0
"""A ``Leave`` dated further than this from the receiver's clock is refused: it is delivered
within a farewell's 2 s, so anything older is a replay (or a clock far off)."""
MAX_REMEMBERED = 1024
"""Departures remembered (for replay refusal and the candidate filter); the oldest go first."""


def make_leave(run_id: str, identity: Identity, now: float) -> Leave:
    """This node's signed departure from ``run_id`` at ``now``."""
    return sign(Leave(run_id=run_id, peer=identity.peer_id, at=now), identity)


class Departures:
    """The departures one node accepted for one run: the authority check and the memory.

    Sans-IO: ``now`` is passed in. ``relayer`` in :meth:`check` is the one peer
    besides the leaver that may deliver a ``Leave`` (the current term's shepherd);
    the signature must be the leaver's whatever the sender.
    """

    def __init__(self, run_id: str) -> None:
        self.run_id = run_id
        self.left: dict[str, float] = {}  # peer -> ``at`` of its latest accepted Leave

    def check(self, msg: Leave, sender: str, now: float, relayer: str | None = None) -> None:
        """Raise a typed error unless ``msg`` is a departure this node should act on; then remember it."""
        if msg.run_id != self.run_id:
            raise VerificationError(f"departure from another run {msg.run_id:.20}")
        if sender != msg.peer and (relayer is None or sender != relayer):
            raise BadSignature(f"{sender:.16}… may not announce the departure of {msg.peer:.16}…")
        verify(msg, msg.peer)  # BadSignature unless the leaver itself signed it
        if not abs(now - msg.at) <= LEAVE_FRESH_S:  # NaN too
            raise StaleMessage(f"departure dated {now - msg.at:+.0f} s from now")
        last = self.left.get(msg.peer)
        if last is not None and msg.at <= last:
            raise StaleMessage(f"departure of {msg.peer:.16}… at {msg.at:.3f} seen already")
        self.left[msg.peer] = msg.at
        while len(self.left) > MAX_REMEMBERED:
            del self.left[min(self.left, key=self.left.__getitem__)]

    def gone(self, peer: str, started_at: float) -> bool:
        """Whether ``peer``'s incarnation that started at ``started_at`` announced its departure.

        Both times are on the leaver's own clock (its member record's ``started_at`` and
        its ``Leave.at``), so a restart under the same peer id is told apart exactly.
        """
        at = self.left.get(peer)
        return at is not None and started_at <= at
