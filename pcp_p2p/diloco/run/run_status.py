"""What a node reports about one run it takes part in (``pcp status``, the dashboard).

Read-only: everything comes from the run machine
(:class:`~pcp_p2p.diloco.run.run_machine.RunMachine`), the executor's counters
and the node's membership view, at ``now`` (the runtime's injected clock).
"""

from __future__ import annotations

import statistics
from typing import TYPE_CHECKING, Any

from pcp_p2p.diloco.protocol.lifecycle import ENDED, PhaseInputs, run_phase
from pcp_p2p.diloco.protocol.shepherd import Phase as ShepherdPhase

if TYPE_CHECKING:
    from pcp_p2p.diloco.run.runtime import RunRuntime


def utilisation_of(busy: float, start: float | None, end: float | None) -> float | None:
    """Time inside inner steps over the time from the first inner run to the latest commit."""
    if start is None or end is None or end <= start:
        return None
    return round(min(1.0, busy / (end - start)), 4)


def members_of(rt: RunRuntime) -> int:
    """Nodes taking part in the run: the shepherd's roster here, else the members that list the run."""
    m = rt.machine
    if m.shepherd is not None:
        return len(m.shepherd.roster)
    return sum(1 for mem in rt.node.membership.live()
               if mem.record.role == "worker" and rt.run_id in mem.record.runs)


def phase_of(rt: RunRuntime, shepherd_live: bool) -> str:
    """The phase to show (:func:`~pcp_p2p.diloco.protocol.lifecycle.run_phase`): compiling, waiting
    for quorum and set-up failures rather than the idle worker's ``idle``."""
    m = rt.machine
    w, sm = m.worker, m.shepherd
    if w is None and m.target is None and rt.started:
        return m.phase  # this machine runs none of the run's targets: that is what it shows
    member = rt.node.membership.get(m.shepherd_peer) if m.shepherd_peer else None
    started = w is not None and (w.current is not None or w.last_commit is not None)
    if sm is not None and sm.phase is ShepherdPhase.WAITING and len(sm.roster) < rt.spec.round.min_quorum:
        started = False  # leading, and the round waits for joins: the quorum is what is missing
    phase = run_phase(PhaseInputs(
        base=m.phase, ended=rt.finished.is_set() or m.phase in ENDED,
        setup_error=m.setup_phase(rt.clock()) if m.shepherd is None else None,
        compiling=m.becoming,
        shepherd_state=member.record.state if member is not None else None,
        started=started, members=members_of(rt), quorum=rt.spec.round.min_quorum,
    ))
    if shepherd_live or m.shepherd_peer is None or phase in ENDED:
        return phase
    return f"{phase} (shepherd lost)"


def run_status(rt: RunRuntime) -> dict[str, Any]:
    m = rt.machine
    now = rt.clock()
    w = m.worker
    rec = w.last_commit if w is not None else None
    shepherd_live = m.shepherd_peer is not None and m.shepherd_peer in rt.node.membership
    busy = rt.engine.busy_s if rt.engine else 0.0
    tokens = rt.engine.tokens if rt.engine else 0
    ann = w.current if w is not None else None
    if rt.started:
        st = m.election.status(now)
        le = st.get("lease_expires_s")
        election = {"term": st.get("term"), "lease_expires_s": None if le is None else round(le, 1),
                    "election_role": st.get("role"), "shepherd_history": st.get("shepherd_history", [])}
    else:
        election = {"term": None, "lease_expires_s": None, "shepherd_history": []}
    stats = m.stats
    return {
        "run_id": rt.run_id,
        "owner": rt.run.owner,
        "name": rt.spec.name,
        "round": (rec.round + 1) if rec is not None else 0,
        "rounds": rt.spec.round.rounds,
        "phase": phase_of(rt, shepherd_live),
        "members": members_of(rt),
        "shepherd": m.shepherd_peer,
        **election,
        "is_shepherd": m.shepherd is not None,
        "standby": rt.setup.ready,  # artifacts and evaluator built ahead of a takeover (hot standby)
        "theta": w.theta_cid if w is not None else None,
        "participants": len(rec.participants) if rec is not None else 0,
        "deadline_s": round(max(0.0, ann.deadline - now), 1) if ann is not None else None,
        "quorum": rt.spec.round.min_quorum,
        "loss": rec.mean_loss if rec is not None else None,
        "val_loss": rec.val_loss if rec is not None else None,
        "tokens_per_s": round(tokens / busy, 1) if busy else None,
        "busy_s": round(busy, 2),
        "tokens_trained": tokens,
        "bytes_submitted": stats.bytes_submitted,
        # Compute utilisation: time inside inner steps over the wall time from
        # the first inner run to the latest commit.
        "utilisation": utilisation_of(busy, stats.first_train_at, stats.last_commit_at),
        "outer_lr": rt.spec.outer.lr,
        "first_contribution_s": stats.first_contribution_s,
        "contributed_rounds": stats.contributed_rounds[-100:],
        # rounds this worker trained early, while its Δ of the round before was in flight (round.overlap)
        "overlapped_rounds": w.early_rounds if w is not None else 0,
        # their steps before the shift over all their steps (the last 32; τ in docs/diloco.md)
        "overlap_tau": round(statistics.median(w.early_shares), 3) if w is not None and w.early_shares else None,
        "rejected": dict(stats.rejected),
        "held": stats.held,  # leases/commits kept until their authority can be checked
        "audits": dict(stats.audits),
        # aggregators (docs/diloco.md, "Aggregators"): partials this node sent, combined as the
        # shepherd, and replayed for a shepherd (by verdict); the shepherd's partial audits
        "aggregation": {
            "partials_sent": stats.partials_sent,
            "partials_combined": m.shepherd.partials_combined if m.shepherd is not None else 0,
            "partial_replays": dict(stats.partial_replays),
            "partial_audits": (m.shepherd.partial_audits.status()
                               if m.shepherd is not None and m.shepherd.partial_audits is not None else None),
        },
        "admission": rt.spec.admission.mode,
        "banned": len(m.ledger.bans()),
        "history": list(stats.history),
        "superseded": stats.superseded,  # rounds dropped from history by fork choice (docs/election.md)
        # commits' checkpoints held: built here from the update, or fetched whole (docs/diloco.md)
        "checkpoints": dict(stats.checkpoints),
    }
