"""Setting a term up on the node that won it: dataset, artifacts (compiled, or the standby's),
evaluator and starting state, then the :class:`~pcp_p2p.diloco.protocol.shepherd.Shepherd`.

I/O only: *that* a term is set up, and that a lost one is cancelled, is the run
machine's call (``SetUpShepherd``, ``CancelSetUp``); this module carries it out
for :class:`~pcp_p2p.diloco.run.runtime.RunRuntime` and answers with
``ShepherdBuilt`` and ``SetUpEnded``. The compile runs in a thread that a
cancellation abandons at once, killing the compiler process, so neither a lost
election nor a node stopping waits for a compile to finish.
"""

from __future__ import annotations

import logging
import threading
from typing import TYPE_CHECKING

import trio

from pcp_p2p.core.errors import LocalError, PcpError
from pcp_p2p.diloco.algorithm.data import CharDataset
from pcp_p2p.diloco.algorithm.outer import OuterState
from pcp_p2p.diloco.protocol.audit_desk import AuditDesk
from pcp_p2p.diloco.protocol.election import BecomeShepherd, start_candidates
from pcp_p2p.diloco.protocol.lifecycle import COMPILING, SETUP_FAILED
from pcp_p2p.diloco.protocol.shepherd import Shepherd, ShepherdOptions
from pcp_p2p.diloco.protocol.sizing import MemoryPlan, plan_memory
from pcp_p2p.diloco.run.run_effects import SetUpEnded, ShepherdBuilt
from pcp_p2p.wire import encode

if TYPE_CHECKING:
    from pcp_p2p.compile.pipeline import Artifact
    from pcp_p2p.diloco.run.engine import Evaluator
    from pcp_p2p.diloco.run.runtime import RunRuntime

log = logging.getLogger("pcp.run")


class TermSetUp:
    """The shepherd's set-up of one run on one node, and its hot standby."""

    def __init__(self, rt: RunRuntime) -> None:
        self.rt = rt
        self.scope: trio.CancelScope | None = None  # cancels the set-up in progress
        self.evaluate: Evaluator | None = None
        self.standby: list[Artifact] = []  # artifacts built and signed ahead of a takeover
        self.standby_micro_batch = 0  # the micro-batch they were compiled for
        self.ready = False  # the standby is hot: artifacts and evaluator built (status shows it)

    def wanted_targets(self) -> list[str]:
        """The best allowed CPU target of each member taking part in the run."""
        rt = self.rt
        from pcp_p2p.executor.cpu import cpu_of, runnable_cpu_targets

        wanted: set[str] = set()
        for m in rt.node.membership.live():
            if rt.run_id not in m.record.runs:
                continue
            caps = m.record.capabilities
            runnable = [t.name for t in runnable_cpu_targets(cpu_of(caps.cpu_arch, caps.cpu_flags))]
            allowed = [t for t in runnable if t in rt.spec.targets]
            if allowed:
                wanted.add(allowed[0])
        return sorted(wanted)

    def memory_plan(self) -> MemoryPlan:
        """The term's micro-batch, sized for the least free memory among the run's members
        (their signed member records; :mod:`~pcp_p2p.diloco.protocol.sizing`)."""
        rt = self.rt
        from pcp_p2p.diloco.run import engine

        assert rt.dataset is not None
        admission = rt.machine.admission
        free = [m.record.capabilities.memory_free_bytes for m in rt.node.membership.live()
                if rt.run_id in m.record.runs and admission.why_not(m.record.peer_id) is None]
        return plan_memory(rt.spec, engine.model_config(rt.spec, rt.dataset.vocab_size), free, engine.KEEP_STATES)

    def memory_refusal(self, plan: MemoryPlan, peer: str) -> str | None:
        """Why ``peer`` cannot train at ``plan`` (its advertised free memory), or None."""
        member = self.rt.node.membership.get(peer)
        return plan.why_not(member.record.capabilities.memory_free_bytes) if member is not None else None

    async def build_artifacts(self, targets: list[str], micro_batch: int = 0) -> list[Artifact]:
        """The train artifacts for ``targets`` (compiled, or from the cache), in a thread that
        this task's cancellation stops at once: the thread is abandoned and the compiler
        process it runs is killed (``CompileCancelled`` there)."""
        rt = self.rt
        from pcp_p2p.diloco.run import engine

        dataset = rt.dataset
        assert dataset is not None
        cancel = threading.Event()

        def build() -> list[Artifact]:
            return engine.build_train_artifacts(rt.spec, dataset.vocab_size, targets, rt.node.identity,
                                                rt.node.config.data_dir / "artifact-cache", cancel=cancel,
                                                micro_batch=micro_batch)

        try:
            # trio_typing's stubs (a libp2p dependency) shadow trio's own types and predate abandon_on_cancel
            return await trio.to_thread.run_sync(build, abandon_on_cancel=True)  # type: ignore[call-arg]
        finally:
            cancel.set()  # a no-op once the build is done; else the thread kills iree-compile and ends

    async def build_evaluator(self) -> Evaluator:
        """The shepherd's evaluator, built and compiled (once). ``jax.jit`` compiles on the first
        call: seconds on a loaded machine, which the machine would otherwise spend inside the
        first submission it scores, renewing no lease meanwhile (a first shepherd lost its
        term that way) and with every other submission waiting behind it."""
        rt = self.rt
        from pcp_p2p.diloco.run import engine

        if self.evaluate is not None:
            return self.evaluate
        assert rt.dataset is not None
        evaluate = await trio.to_thread.run_sync(engine.Evaluator, rt.spec, rt.dataset)
        theta = await trio.to_thread.run_sync(engine.initial_theta, rt.spec, rt.dataset.vocab_size)
        await trio.to_thread.run_sync(evaluate.score, theta)
        self.evaluate = evaluate
        return evaluate

    def cancel(self, why: str) -> None:
        rt = self.rt
        scope = self.scope
        if scope is not None and not scope.cancel_called:
            log.info("run %s: %s; the shepherd's set-up (compile) is cancelled", rt.run_id[:16], why)
            scope.cancel()

    async def prewarm(self) -> None:
        """Hot standby: build the artifacts into the cache and the evaluator now, off the
        critical path, so that taking over a term (failover, rotation) costs a cache hit."""
        rt = self.rt
        assert rt.dataset is not None
        try:
            micro_batch = self.memory_plan().micro_batch
            self.standby = await self.build_artifacts(self.wanted_targets(), micro_batch)
            self.standby_micro_batch = micro_batch
            await self.build_evaluator()
            self.ready = True
            log.info("run %s: standby ready (artifacts cached, evaluator built)", rt.run_id[:16])
        except PcpError as exc:
            rt.node.log_once("self", exc, "standby build failed")

    async def run(self, eff: BecomeShepherd) -> None:
        rt = self.rt
        rt.node.state = COMPILING  # what the workers show until the first round is announced
        scope = trio.CancelScope()
        self.scope = scope
        try:
            with scope:
                await self._with_retries(eff)
        finally:
            if self.scope is scope:
                self.scope = None
            err = rt.machine.setup_error
            rt.node.state = f"{SETUP_FAILED}: {err}" if err else "training"
            rt.post(SetUpEnded(eff.term))

    async def _with_retries(self, eff: BecomeShepherd) -> None:
        """Set up the term, up to three times while the term is still ours."""
        rt = self.rt
        for attempt in range(3):
            try:
                shepherd = await self.build(eff)
                rt.machine.setup_failed(None)
                rt.post(ShepherdBuilt(shepherd))
                break
            except PcpError as exc:
                still_mine = rt.machine.still_holds(eff.term)
                log.error("run %s: could not take up term %d (attempt %d): %s",
                          rt.run_id[:16], eff.term, attempt + 1, exc)
                # Shown as the run's phase here and, through the member record, on every worker.
                err = " ".join(str(exc).split())[:160] or type(exc).__name__
                rt.machine.setup_failed(err)
                rt.node.state = f"{SETUP_FAILED}: {err}"
                if not still_mine:
                    break
                await trio.sleep(2.0 * (attempt + 1))

    async def build(self, eff: BecomeShepherd) -> Shepherd:
        """Build the artifacts and the term's starting state (the lease names the checkpoint)."""
        rt = self.rt
        from pcp_p2p.diloco.algorithm.data import encode_dataset
        from pcp_p2p.diloco.run import engine

        # The shepherd reads and tokenises the corpus; workers get it as a blob.
        if rt.dataset is None:
            rt.dataset = await trio.to_thread.run_sync(CharDataset.load, rt.spec.dataset)
        dataset_cid = await rt.io.keep(await trio.to_thread.run_sync(encode_dataset, rt.dataset), for_run=True)
        rt.io.pins.for_dataset(dataset_cid)
        wanted = self.wanted_targets()
        plan = self.memory_plan()
        standby = self.standby if (self.standby and sorted(a.manifest.target for a in self.standby) == wanted
                                   and self.standby_micro_batch == plan.micro_batch) else None
        log.info("run %s: term %d: compiling the train program for %s, %d of the %d sequences per pass "
                 "(%d MiB modelled per worker)", rt.run_id[:16], eff.term, ", ".join(sorted(wanted)),
                 plan.micro_batch, plan.batch, plan.need_bytes >> 20)
        arts = standby or await self.build_artifacts(sorted(wanted), plan.micro_batch)
        artifacts: dict[str, str] = {}
        rt.artifacts.clear()
        for art in arts:
            if art.cached:
                log.info("run %s: artifact for %s rebuilt byte-identically from the cache (%s)",
                         rt.run_id[:16], art.manifest.target, art.cid)
            rt.artifacts.append({"target": art.manifest.target, "cid": art.cid,
                                 "size": len(art.vmfb), "cache_hit": art.cached})
            await rt.io.keep(art.vmfb, for_run=True)
            artifacts[art.manifest.target] = await rt.io.keep(encode(art.manifest), for_run=True)
        evaluate = await self.build_evaluator()
        self.ready = True  # the artifacts are in the cache and the evaluator is built
        rate = rt.spec.aggregation.audit_rate
        m = rt.machine
        opts = ShepherdOptions(
            artifacts=artifacts, evaluate=evaluate, dataset_cid=dataset_cid,
            end_round=eff.end_round, score=evaluate.score,
            admit=lambda peer: m.admission.why_not(peer) or self.memory_refusal(plan, peer),
            audits=(AuditDesk(rt.run_id, rt.node.identity, rate, resend_s=2 * rt.spec.round.time_budget_s + 2)
                    if rate > 0 else None),
            direct=m.direct_members,
        )
        if not eff.checkpoint_cid:
            return Shepherd(spec=rt.spec, run_id=rt.run_id, identity=rt.node.identity, term=eff.term,
                            state=OuterState.initial(engine.initial_theta(rt.spec, rt.dataset.vocab_size)), **opts)
        return await self._continuing(eff, opts)

    async def _continuing(self, eff: BecomeShepherd, opts: ShepherdOptions) -> Shepherd:
        """The term's shepherd from the first of its lease's starting states (``start_candidates``)
        that this node can fetch and that holds (``Shepherd.from_start``, as in both simulators)."""
        rt = self.rt
        election = rt.machine.election
        points = start_candidates(eff, election.lease, election.best_commit)
        for i, point in enumerate(points):
            try:
                blob = await rt.io.fetch_bytes(point.cid, max_size=rt.state_bound(2 if point.checkpoint else 1))
                shepherd = Shepherd.from_start(point, blob, spec=rt.spec, run_id=rt.run_id,
                                               identity=rt.node.identity, term=eff.term, **opts)
            except PcpError as exc:
                if i == len(points) - 1:
                    raise
                log.warning("run %s: term %d: %s (%s) is unavailable (%s); starting from %s", rt.run_id[:16],
                            eff.term, point.what, point.cid[-12:], exc, points[i + 1].what)
                continue
            log.info("run %s: term %d continues from round %d (%s, %s)", rt.run_id[:16], eff.term,
                     shepherd.state.round + 1, point.what, point.cid[-12:])
            return shepherd
        raise LocalError("the lease names no state to start from")  # (not reached: a checkpoint comes first)
