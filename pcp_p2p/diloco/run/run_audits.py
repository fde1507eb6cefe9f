"""A run's audits on one node: replays as an auditor, inner-state exports as the audited worker.

The shepherd's side is :class:`~pcp_p2p.diloco.protocol.audit_desk.AuditDesk`, inside the
shepherd machine; the checks are :mod:`pcp_p2p.diloco.protocol.audit`'s. This module
runs the jobs an :class:`~pcp_p2p.diloco.run.run_effects.Audit` effect hands it:
each costs a replay or an export, so at most ``MAX_AUDIT_JOBS`` at once.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

import trio

from pcp_p2p.core.errors import LocalError, OverBudget, PcpError, VerificationError
from pcp_p2p.diloco.protocol.audit import (
    AuditJob,
    AuditReport,
    AuditRequest,
    StateOffer,
    check_request,
    check_submission,
    make_offer,
    state_to_export,
)
from pcp_p2p.diloco.protocol.group_replay import stateful_ranks
from pcp_p2p.wire import Message, encode

if TYPE_CHECKING:
    from pcp_p2p.diloco.run.runtime import RunRuntime

log = logging.getLogger("pcp.run")

AUDIT_GRACE_S = 30.0  # an audit must be reported within two round deadlines plus this
MAX_AUDIT_JOBS = 4  # replays (as auditor) and state exports (as audited worker) at once


class AuditClerk:
    """The audit jobs of one run on one node."""

    def __init__(self, rt: RunRuntime) -> None:
        self.rt = rt
        self.jobs: dict[tuple[int, int, int, str], tuple[AuditJob, trio.Event]] = {}  # as auditor
        self.exports = 0  # inner-state exports in progress (as the audited worker)

    def on_message(self, sender: str, msg: Message, nursery: trio.Nursery) -> None:
        rt = self.rt
        if isinstance(msg, StateOffer):
            entry = self.jobs.get((msg.term, msg.round, msg.attempt, msg.worker))
            if entry is None:
                rt.reject(sender, VerificationError("a state offer for no audit of this node"))
                return
            try:
                entry[0].on_offer(msg)
            except PcpError as exc:
                rt.reject(sender, exc)
                return
            entry[1].set()
            return
        assert isinstance(msg, AuditRequest)
        try:
            check_request(msg, run_id=rt.run_id, rate=rt.spec.aggregation.audit_rate,
                          is_shepherd=rt.machine.holds_term)
        except PcpError as exc:
            rt.reject(sender, exc)
            return
        me = rt.node.peer_id
        if len(self.jobs) + self.exports >= MAX_AUDIT_JOBS:
            # each costs a replay or an export: even the shepherd gets a bounded share
            rt.reject(sender, OverBudget(f"{MAX_AUDIT_JOBS} audits in progress here", reason="audits"))
        elif msg.worker == me:
            nursery.start_soon(self._serve_state, msg)
        elif msg.auditor == me and (msg.term, msg.round, msg.attempt, msg.worker) not in self.jobs:
            nursery.start_soon(self._audit, msg)

    async def _serve_state(self, req: AuditRequest) -> None:
        """The audited worker: serve the inner state its submission started from."""
        rt = self.rt
        self.exports += 1
        try:
            w = rt.machine.worker
            sub = next((s for s in reversed(w.submitted if w else [])
                        if (s.term, s.round, s.attempt) == (req.term, req.round, req.attempt)), None)
            if sub is None:
                raise LocalError(f"no submission of round {req.round + 1} is kept here any more")
            check_submission(req, encode(sub))  # the request names exactly what we signed
            digest = state_to_export(req, sub, rt.node.peer_id)
            if digest is None:
                return  # started fresh: the auditor needs nothing from us
            if rt.engine is None:
                raise LocalError("no executor holds the inner state")
            blob = await trio.to_thread.run_sync(rt.engine.export_state, digest)
            await rt.io.keep(blob)
            await rt.send_to(req.auditor, make_offer(req, digest, blob, rt.node.identity))
        except PcpError as exc:
            rt.node.log_once("self", exc, "serving an audited inner state failed")
        finally:
            self.exports -= 1

    async def _audit(self, req: AuditRequest) -> None:
        """The auditor: gather the inputs, replay the round exactly, report to the shepherd."""
        from pcp_p2p.diloco.protocol.audit import CHUNK_STEPS

        rt = self.rt
        job = AuditJob(req, rt.node.identity, chunk_steps=CHUNK_STEPS)
        key = (req.term, req.round, req.attempt, req.worker)
        offered = trio.Event()
        self.jobs[key] = (job, offered)
        report: AuditReport | None = None
        try:
            with trio.move_on_after(2 * rt.spec.round.deadline_s + AUDIT_GRACE_S) as deadline:
                try:
                    w = rt.machine.worker
                    if req.target != rt.machine.target or w is None \
                            or req.artifact_cid not in w.held_artifacts or rt.engine is None:
                        raise LocalError("this node does not run the audited round's artifact")
                    while not job.ready():
                        wanted = job.wanted()
                        if not wanted:
                            await offered.wait()  # the worker's StateOffer
                            offered = trio.Event()
                            self.jobs[key] = (job, offered)
                            continue
                        for cid in wanted:
                            public = cid == req.submission_cid or (job.sub is not None
                                                                   and cid == job.sub.base_theta_cid)
                            # a worker group's state is one (m, v) pair per stateful rank
                            copies = 2 * max(1, len(stateful_ranks(job.sub)) if job.sub is not None else 1)
                            data = await rt.io.fetch_bytes(cid, req.shepherd if public else req.worker,
                                                           keep=False, max_size=rt.state_bound(copies))
                            job.on_blob(cid, data)
                    if job.impossible_steps():
                        report = job.finish_impossible()
                    else:
                        engine = rt.engine
                        inputs = job.replay_inputs()  # a worker group's round: one per part, then recombined
                        reps = await trio.to_thread.run_sync(lambda: [engine.replay(*i) for i in inputs])
                        report = job.finish_replays(reps)
                except PcpError as exc:
                    report = job.give_up(f"{type(exc).__name__}: {exc}")
            if deadline.cancelled_caught:  # (then no report was made: each is made after the last await)
                report = job.give_up("the audit's deadline passed")
            assert report is not None
            log.info("run %s: audit of %s round %d: %s %s", rt.run_id[:16], req.worker, req.round + 1,
                     report.verdict, ",".join(report.differs))
            audits = rt.machine.stats.audits
            audits[report.verdict] = audits.get(report.verdict, 0) + 1
            await rt.send_to(req.shepherd, report)
        finally:
            self.jobs.pop(key, None)
