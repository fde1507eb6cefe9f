"""Training on a node: accept runs from trusted owners and drive each with a :class:`RunRuntime`.

Installed on a running node by ``pcp node join`` (:func:`install_training`). It
takes signed run specs handed to it directly (``pcp run create``) and finds
the runs its peers advertise in their member records (a node that starts
after a run was created learns of it within a heartbeat and fetches the spec
from the DHT). Round messages go to the runtime of the run they name; a
message for a run this node does not take part in is refused.
"""

from __future__ import annotations

import logging
from typing import Any

import trio

from pcp_p2p.diloco.election import Lease
from pcp_p2p.diloco.messages import ROUND_MESSAGES
from pcp_p2p.diloco.runs import KnownRun, RunBook, TrustPolicy
from pcp_p2p.diloco.runtime import RunRuntime
from pcp_p2p.diloco.spec import SignedRunSpec
from pcp_p2p.errors import PcpError, VerificationError
from pcp_p2p.shutdown import add_farewell
from pcp_p2p.node.node import Node
from pcp_p2p.dht.records import VerifiedRecord
from pcp_p2p.diloco.admission import AllowlistUpdate
from pcp_p2p.diloco.audit import AUDIT_MESSAGES
from pcp_p2p.wire import Message

log = logging.getLogger("pcp.training")

DISCOVERY_PERIOD_S = 2.0
RESUME_TRIES = 30  # lookups (DISCOVERY_PERIOD_S apart) of a run this node left unfinished, at most


class TrainingService:
    def __init__(self, node: Node, trust: TrustPolicy) -> None:
        self.node = node
        self.book = RunBook(trust)
        self.runtimes: dict[str, RunRuntime] = {}

    def install(self) -> None:
        self.node.record_validator.authorities.append(self._check_record)
        self.node.messenger.register((SignedRunSpec,), self._on_spec)
        self.node.messenger.register((*ROUND_MESSAGES, Lease, AllowlistUpdate, *AUDIT_MESSAGES),
                                     self._on_round_message)
        self.node.config.extra_status["run"] = self.run_status
        self.node.config.extra_status["artifacts"] = self.artifacts_status
        # Top-level election fields for `pcp status --json` (the dashboard's shepherd panel).
        for key in ("term", "lease_expires_s", "shepherd_history"):
            self.node.config.extra_status[key] = lambda key=key: (self.run_status() or {}).get(key)
        self.node.nursery.start_soon(self._discovery_loop)
        self.node.nursery.start_soon(self._resume_loop, self._unfinished_runs())
        add_farewell(self.announce_departures)

    async def announce_departures(self) -> None:
        """The node is stopping: every unfinished run hears that it leaves (bounded by the caller)."""
        async with trio.open_nursery() as nursery:
            for runtime in self.runtimes.values():
                nursery.start_soon(runtime.announce_departure)

    async def _on_spec(self, sender: str, msg: Message) -> None:
        assert isinstance(msg, SignedRunSpec)
        run = self.book.offer(msg)  # raises (untrusted, bad signature): the messenger refuses it
        if run is not None:
            self._start(run)

    def _check_record(self, rec: VerifiedRecord, now: float) -> None:
        """A DHT record of a run this node takes part in must pass that run's authority chain."""
        runtime = self.runtimes.get(rec.name)
        if runtime is not None:
            runtime.check_record(rec.payload, now)

    async def _on_round_message(self, sender: str, msg: Message) -> None:
        runtime = self.runtimes.get(getattr(msg, "run_id", ""))
        if runtime is None:
            raise VerificationError("a message for a run this node does not take part in")
        await runtime.deliver(sender, msg)

    def _start(self, run: KnownRun) -> None:
        runtime = RunRuntime(self.node, self.node.blobs, run, self.node.config.data_dir / "runs" / run.run_id)
        self.runtimes[run.run_id] = runtime
        self.node.runs.add(run.run_id)
        self.node.state = "training"
        self.node.nursery.start_soon(self._run, runtime)

    async def _run(self, runtime: RunRuntime) -> None:
        async def idle_once_finished() -> None:
            # run_forever lingers up to FINISH_GRACE_S after the last commit
            # (final sends, announcements); the member record says so at once.
            await runtime.finished.wait()
            self._refresh_state()

        try:
            async with trio.open_nursery() as nursery:
                nursery.start_soon(idle_once_finished)
                await runtime.run_forever()
                nursery.cancel_scope.cancel()
        except PcpError as exc:
            runtime.phase = f"stopped: {exc}"
            log.error("run %s stopped: %s", runtime.run_id, exc)
        finally:
            self.node.runs.discard(runtime.run_id)
            self.node.leads.discard(runtime.run_id)
            self._refresh_state()

    def _refresh_state(self) -> None:
        """``training`` while any run this node takes part in is unfinished, else ``idle``."""
        busy = any(not r.finished.is_set() for rid, r in self.runtimes.items() if rid in self.node.runs)
        self.node.state = "training" if busy else "idle"

    async def _discovery_loop(self) -> None:
        while True:
            for member in self.node.membership.live():
                for run_id in self.book.unknown(member.record.runs):
                    await self._look_up(run_id)
            await trio.sleep(DISCOVERY_PERIOD_S)

    def _unfinished_runs(self) -> list[str]:
        """Runs this node took part in before it (re)started and did not see finish (its data dir says)."""
        from pcp_p2p.diloco.pins import RunPins
        from pcp_p2p.diloco.runtime import PINS_FILE

        runs_dir = self.node.config.data_dir / "runs"
        try:
            dirs = sorted(d for d in runs_dir.iterdir() if d.is_dir())
        except OSError:
            return []
        return [d.name for d in dirs if not RunPins.load(d / PINS_FILE).finished]

    async def _resume_loop(self, run_ids: list[str]) -> None:
        """Take up again the runs this node was part of when it stopped, even once they are over.

        Why not wait for discovery: peers advertise only the runs they are still
        training, so a node restarted after its run finished would never hear of it
        again, and never reach the run's final θ. Its run directory remembers the run;
        the spec comes from the DHT (owner-signed, checked against the trust policy
        like any other), and the runtime catches up from the run's latest commit.
        """
        for _ in range(RESUME_TRIES):
            run_ids = self.book.unknown(tuple(run_ids))
            if not run_ids:
                return
            for run_id in run_ids:
                await self._look_up(run_id)
            await trio.sleep(DISCOVERY_PERIOD_S)

    async def _look_up(self, run_id: str) -> None:
        try:
            signed = await self.node.get_record("run", run_id)
            if isinstance(signed, SignedRunSpec):
                run = self.book.offer(signed)
                if run is not None:
                    self._start(run)
        except PcpError as exc:
            self.node.log_once(run_id, exc, "run lookup")

    def run_status(self) -> dict[str, Any] | None:
        if not self.runtimes:
            return None
        return list(self.runtimes.values())[-1].status()


    def artifacts_status(self) -> list[dict[str, Any]] | None:
        if not self.runtimes:
            return None
        return list(self.runtimes.values())[-1].artifacts


def install_training(node: Node, trust: TrustPolicy) -> TrainingService:
    service = TrainingService(node, trust)
    service.install()
    return service
