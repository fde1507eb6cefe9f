"""Training on a node: accept runs from trusted owners and drive each with a :class:`RunRuntime`.

Installed on a running node by ``pcp node join`` (:func:`install_training`). It
takes signed run specs handed to it directly (``pcp run create``) and finds
the runs its peers advertise in their member records (a node that starts
after a run was created learns of it within a heartbeat and fetches the spec
from the DHT). Round messages go to the runtime of the run they name; a
message for a run this node does not take part in is refused.

Trust can change while the node runs (``--trust-file``, see
:mod:`pcp_p2p.diloco.run.trust_file`): every :data:`~pcp_p2p.diloco.run.trust_file.POLL_S`
the file is looked at; new owners take effect for specs handed over
afterwards, for the specs this node refused for want of trust (held by the
:class:`RunBook`), and for the runs each trusted owner lists in its
``owner-runs`` record (:mod:`pcp_p2p.diloco.protocol.owner_runs`), looked up when an
owner becomes trusted and every :data:`OWNER_LOOKUP_PERIOD_S` after. A
hand-off this node declines is answered with the reason (not trusted, no
target this machine can run), which ``pcp run create`` prints.
"""

from __future__ import annotations

import functools
import logging
import time
from typing import Any

import trio

from pcp_p2p.core.errors import PcpError, VerificationError
from pcp_p2p.core.faults import sole
from pcp_p2p.core.shutdown import add_farewell
from pcp_p2p.dht.records import VerifiedRecord
from pcp_p2p.diloco.protocol.admission import AllowlistUpdate
from pcp_p2p.diloco.protocol.audit import AUDIT_MESSAGES
from pcp_p2p.diloco.protocol.election import Heartbeat, Lease
from pcp_p2p.diloco.protocol.lifecycle import StopOrder, summary_of
from pcp_p2p.diloco.protocol.messages import ROUND_MESSAGES
from pcp_p2p.diloco.protocol.owner_runs import OWNER_RUNS_KIND, OwnerRuns
from pcp_p2p.diloco.protocol.partial_audit import PARTIAL_AUDIT_MESSAGES
from pcp_p2p.diloco.protocol.partials import PartialAggregate
from pcp_p2p.diloco.protocol.runs import KnownRun, NoAllowedTarget, RunBook, TrustPolicy
from pcp_p2p.diloco.protocol.spec import RunSpec, SignedRunSpec
from pcp_p2p.diloco.run.runtime import RunRuntime
from pcp_p2p.diloco.run.trust_file import POLL_S, TrustFile
from pcp_p2p.node.node import Node
from pcp_p2p.wire import Message

log = logging.getLogger("pcp.training")

DISCOVERY_PERIOD_S = 2.0
OWNER_LOOKUP_PERIOD_S = 60.0
"""How often each trusted owner's ``owner-runs`` record is read again (a DHT miss
at the first look, or a run created while no node trusting it was up)."""
OWNER_RETRY_S = 10.0  # after a miss (no record yet, or the DHT not ready at start)
OWNER_LOOKUPS_PER_PASS = 4  # a long trust file is looked up a few owners per discovery pass

RESUME_TRIES = 30  # lookups (DISCOVERY_PERIOD_S apart) of a run this node left unfinished, at most


def fits_this_machine(spec: RunSpec) -> None:
    """Raise :class:`NoAllowedTarget` unless the run allows this machine's best CPU target."""
    from pcp_p2p.executor.cpu import best_cpu_target

    best = best_cpu_target().name
    if best not in spec.targets:
        raise NoAllowedTarget(f"this machine's best target {best} is not among the run's targets.allowed "
                              f"({', '.join(spec.targets)})")


class TrainingService:
    def __init__(self, node: Node, trust: TrustPolicy, *, trust_file: TrustFile | None = None,
                 flag_owners: frozenset[str] = frozenset()) -> None:
        self.node = node
        self.book = RunBook(trust, fits=fits_this_machine)
        self.runtimes: dict[str, RunRuntime] = {}
        self.trust_file = trust_file
        self.flag_owners = flag_owners  # --trust: kept whatever the file says
        self._owner_looked: dict[str, float] = {}  # owner -> trio time of its last owner-runs lookup
        self._owner_listed: dict[str, list[str]] = {}  # trusted owner -> the live runs its list names

    def install(self) -> None:
        self.node.record_validator.authorities.append(self._check_record)
        self.node.messenger.register((SignedRunSpec,), self._on_spec)
        self.node.messenger.register((*ROUND_MESSAGES, PartialAggregate, *PARTIAL_AUDIT_MESSAGES,
                                      AllowlistUpdate, StopOrder, *AUDIT_MESSAGES),
                                     self._on_round_message)
        # posted on a line (a lease renewal is, a claim is sent: RunRuntime._publish_lease)
        self.node.messenger.register((Heartbeat, Lease), self._on_round_message, line=True)
        self.node.config.extra_status["run"] = self.run_status
        self.node.config.extra_status["artifacts"] = self.artifacts_status
        self.node.config.extra_status["runs"] = self.runs_status
        # Top-level election fields for `pcp status --json` (the dashboard's shepherd panel).
        for key in ("term", "lease_expires_s", "shepherd_history"):
            self.node.config.extra_status[key] = functools.partial(self._run_status_field, key)
        self.node.nursery.start_soon(self._discovery_loop)
        if self.trust_file is not None:
            self.node.nursery.start_soon(self._trust_file_loop)
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
        except Exception as exc:  # the boundary (pcp_p2p.core.faults): a run's failure stops the run, never the node
            cause = sole(exc)  # a task's error arrives wrapped in its nursery's group
            if isinstance(cause, PcpError):
                runtime.phase = f"stopped: {cause}"
                log.error("run %s stopped: %s", runtime.run_id, cause)
            else:  # a bug: logged with its traceback, counted in local_faults
                self.node.boundary.faults.record(cause, "run")
                runtime.phase = "stopped: internal error (see the node's log)"
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
            await self._look_up_owners()
            # Listed runs are looked up each pass until found, like advertised ones:
            # a DHT miss on the run record must not wait for the next owner lookup.
            for run_ids in list(self._owner_listed.values()):
                for run_id in self.book.unknown(run_ids):
                    await self._look_up(run_id)
            await trio.sleep(DISCOVERY_PERIOD_S)

    async def _trust_file_loop(self) -> None:
        assert self.trust_file is not None
        while True:
            await trio.sleep(POLL_S)
            owners = self.trust_file.poll()
            if owners is not None:
                self.set_trusted(self.flag_owners | owners)

    def set_trusted(self, owners: frozenset[str]) -> None:
        """Trust exactly ``owners`` (and any owner, with --trust-any) from now on.

        Held specs of newly trusted owners start at once; their ``owner-runs``
        records are read on the next discovery pass. Removing an owner stops
        nothing already running: it only refuses that owner's runs from now on.
        """
        old = self.book.trust
        added, removed = owners - old.owners, old.owners - owners
        if not added and not removed:
            return
        log.info("trust changed: %d owner(s) added, %d removed (%d trusted)", len(added), len(removed), len(owners))
        for run in self.book.retrust(TrustPolicy(owners, any_owner=old.any_owner)):
            log.info("run %s: its owner is trusted now; taking it up", run.run_id)
            self._start(run)
        for owner in added | removed:
            self._owner_looked.pop(owner, None)  # an added owner is looked up on the next pass
            self._owner_listed.pop(owner, None)

    async def _look_up_owners(self) -> None:
        """Read the ``owner-runs`` record of trusted owners not looked up lately; note the runs it lists."""
        now = trio.current_time()
        due = [o for o in sorted(self.book.trust.owners)
               if o not in self._owner_looked or now - self._owner_looked[o] >= OWNER_LOOKUP_PERIOD_S]
        for owner in due[:OWNER_LOOKUPS_PER_PASS]:
            self._owner_looked[owner] = now
            try:
                listed = await self.node.get_record(OWNER_RUNS_KIND, owner)
            except PcpError as exc:
                self.node.log_once(owner, exc, "owner-runs lookup")
                listed = None
            if not isinstance(listed, OwnerRuns):
                self._owner_looked[owner] = now - OWNER_LOOKUP_PERIOD_S + OWNER_RETRY_S
                continue
            # The validator checked the record is this owner's; each run is then
            # fetched as its own owner-signed record and checked against trust
            # (by the discovery loop, until found).
            self._owner_listed[owner] = listed.live(time.time())

    def _unfinished_runs(self) -> list[str]:
        """Runs this node took part in before it (re)started and did not see finish (its data dir says)."""
        from pcp_p2p.diloco.run.pins import RunPins
        from pcp_p2p.diloco.run.runtime import PINS_FILE

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

    def runs_status(self) -> dict[str, dict[str, Any]]:
        """Every run's summary by run id, for `pcp run status` (the `run` section is the latest run only)."""
        return {rid: summary_of(r.status()) for rid, r in self.runtimes.items()}

    def _run_status_field(self, key: str) -> Any:
        return (self.run_status() or {}).get(key)


    def artifacts_status(self) -> list[dict[str, Any]] | None:
        if not self.runtimes:
            return None
        return list(self.runtimes.values())[-1].artifacts


def install_training(node: Node, trust: TrustPolicy, *, trust_file: TrustFile | None = None,
                     flag_owners: frozenset[str] = frozenset()) -> TrainingService:
    service = TrainingService(node, trust, trust_file=trust_file, flag_owners=flag_owners)
    service.install()
    return service
