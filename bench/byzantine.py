"""A 4-worker DiLoCo run, clean and with one Byzantine worker of each kind.

Run: ``.venv/bin/python bench/byzantine.py`` (about 10 minutes on 2 CPU cores).

Every arm is the same run: the ``tiny`` GPT on Shakespeare from the same warm
start, the same run id and four worker identities (so the same data shards and
seeds, also in the arms whose spec differs in its ``[aggregation]`` table),
``ROUNDS`` rounds of H inner AdamW steps, through the *real* round protocol
pumped in one process (:mod:`pcp_p2p.testing.inprocess`: the
:class:`~pcp_p2p.diloco.protocol.shepherd.Shepherd` and :class:`~pcp_p2p.diloco.protocol.worker.Worker`
machines, signed messages, int8 Δs, the aggregator with the spec's defences,
the shepherd scoring each submission on a held-out batch and evaluating each
commit on the validation batches). A round commits with 2 of the 4 accepted.
The workers start from the warm start's AdamW moments, as in the steady state
of a long run (``PCP_BENCH_FRESH_MOMENTS=1``: fresh moments, where the held-out
score refuses more honest first rounds). In an attacked arm the fourth seat is
taken by a worker of :mod:`pcp_p2p.testing.byzantine` — same key, well-formed
signed submissions, dishonest numbers, and a Join with every submission so that
refusals never evict it:

=================  ===============================================================
random             no training; a random Δ with norm 0.99x the absolute bound
sign_flip          trains, sends −Δ
scaled             trains, sends 10·Δ (or the largest multiple under the bound)
token_inflation    joins claiming 1e12 tokens/s, claims the spec's maximum steps
                   (10·H) and sends its Δ extrapolated to them (x10, under the bound)
stale_replay       trains in its first round only, then replays that Δ re-signed
                   (and the old signed submission verbatim, refused as stale)
=================  ===============================================================

Headline: the worst final validation loss, attacked / clean, both under the
spec's default defences (target ≤ 1.02, lower is better). One Byzantine worker
of four is a quarter of the data gone even when it is perfectly ignored:
``ratio_three_honest`` is that floor, the same run with the fourth seat empty.

Also, each with its ``*_target``:

- ``robust_clean_cost``: clean run, the defaults (robust rule, norm screen,
  share cap, scoring, val-jump guard) over the plain token-weighted mean with
  every defence off (main before issue #12). Target ≤ 1.01. Every arm reports
  ``honest_refusals``: honest submissions the defences refused (false positives).
- ``audit_overhead``: compute spent on auditability and audits over compute
  spent training, as ``bench/audit.py`` defines it (state digest per round +
  ``audit_rate`` × (state export + import + replay)), measured here on the
  clean arm's submissions: drawn by :func:`~pcp_p2p.diloco.protocol.audit.plan_audits`,
  replayed by the JAX inner loop, judged by :func:`~pcp_p2p.diloco.protocol.audit.judge`
  (``audit_verdicts``: all ``match`` when replays are bit-exact), in CPU
  seconds. Each attacked arm also audits every attacker submission the
  aggregator accepted (``attacker_audit_verdicts``). Target ≤ 0.05;
  ``audit_overhead_method`` says the same. ``bench/audit.py`` measures it on the
  IREE executor.
- ``flood_rss_growth_mib``: a real ``pcp node join`` process flooded by one
  peer with 48 concurrent ``/pcp/msg`` streams each one byte short of the
  largest frame (:func:`pcp_p2p.testing.flood.flood`); peak RSS growth.
  Target ≤ 64 MiB.

Knobs: ``PCP_BENCH_ROUNDS`` (5), ``PCP_BENCH_H`` (50), ``PCP_BENCH_WARMUP``
(200 synchronous steps), ``PCP_BENCH_ATTACKS`` (comma list, default all),
``PCP_BENCH_UNDEFENDED`` (comma list of attacks also run with every defence
off, to show what they do unopposed; default ``random``; empty for none),
``PCP_BENCH_FLOOD`` (1; 0 skips it), ``PCP_BENCH_FLOOD_HOLD_S`` (20),
``PCP_BENCH_FRESH_MOMENTS`` (0).
"""

from __future__ import annotations

import json
import math
import os
import sys
import time
from collections import Counter
from pathlib import Path
from typing import Any

os.environ.setdefault("JAX_PLATFORMS", "cpu")
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import numpy as np

from pcp_p2p.core.errors import LocalError
from pcp_p2p.core.identity import Identity
from pcp_p2p.diloco.algorithm.outer import OuterState
from pcp_p2p.diloco.algorithm.params import Params
from pcp_p2p.diloco.protocol.audit import (
    PlannedAudit,
    check_submission,
    decode_inner_state,
    encode_inner_state,
    inner_state_digest,
    judge,
    plan_audits,
)
from pcp_p2p.diloco.protocol.effects import RunInner
from pcp_p2p.diloco.protocol.messages import FRESH_STATE
from pcp_p2p.diloco.protocol.shepherd import Phase, Shepherd
from pcp_p2p.diloco.protocol.spec import RunSpec, parse_spec, run_id_of, sign_spec
from pcp_p2p.diloco.protocol.worker import InnerResult, Worker
from pcp_p2p.testing.byzantine import KINDS, ByzantineWorker, RandomDelta
from pcp_p2p.testing.inprocess import JaxTrainer, RunLog, as_inner_state, pump_run

WORKERS = 4
SEAT = 3  # the attacker takes this worker's identity, shard and seeds
ABSENT = "absent"  # an arm with the seat empty: three honest workers only
H = int(os.environ.get("PCP_BENCH_H", "50"))
ROUNDS = int(os.environ.get("PCP_BENCH_ROUNDS", "5"))
WARMUP = int(os.environ.get("PCP_BENCH_WARMUP", "200"))
FRESH_MOMENTS = os.environ.get("PCP_BENCH_FRESH_MOMENTS", "0") == "1"
ATTACKS = [k for k in os.environ.get("PCP_BENCH_ATTACKS", ",".join(KINDS)).split(",") if k]
UNDEFENDED = [k for k in os.environ.get("PCP_BENCH_UNDEFENDED", "random").split(",") if k]
B, T = 16, 64
AUDIT_SAMPLES = 3  # audits run at least, drawn or not, to time one
VAL_BATCHES = 8  # x 64 x 64 tokens; the same windows in every arm, so ratios are paired
TIME_BUDGET_S = 60.0
# A round commits with 2 of the 4: the attacker's refusal must not be enough to
# discard it, and neither must one honest worker's (the score refuses some, see
# the arms' honest_refusals) on top of it.
QUORUM = 2
HONEST_SPEED = H * B * T / TIME_BUDGET_S  # tokens/s: H steps fill the budget (the cap is 1.5·H)

PLAIN_MEAN = """
[aggregation]
rule = "mean"
max_share = 1.0
norm_vs_median = 0.0
score_tolerance = -1.0
val_jump = 0.0
"""


def spec_for(defended: bool) -> RunSpec:
    """The run: the spec's default defences, or (``defended=False``) the plain mean with none."""
    return parse_spec(f"""
name = "bench-byzantine"
[model]
preset = "tiny"
[inner]
lr = 2e-3
beta1 = 0.9
beta2 = 0.99
weight_decay = 0.1
grad_clip = 1.0
batch_size = {B}
seq_len = {T}
[outer]
lr = 0.7
momentum = 0.9
[round]
time_budget_s = {TIME_BUDGET_S}
deadline_s = 120.0
max_inner_steps = {10 * H}
rounds = {ROUNDS}
min_quorum = {QUORUM}
delta_codec = "int8"
{"" if defended else PLAIN_MEAN}""")


def log(msg: str) -> None:
    print(f"[byzantine {time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


class Arm:
    """One run of the swarm: clean or with one attacker, defended or not."""

    def __init__(
        self, name: str, spec: RunSpec, trainer: JaxTrainer, theta0: Params, moments: Any, attack: str | None
    ) -> None:
        self.name, self.spec, self.trainer, self.attack = name, spec, trainer, attack
        rng = np.random.default_rng(0)  # the same keys in every arm
        owner = Identity(rng.bytes(32))
        # The same run id in every arm, the defended spec's: data seeds derive from
        # it, so an arm that differs only in its [aggregation] table still trains
        # on the same batches and the ratios compare defences, not data.
        self.run_id = run_id_of(sign_spec(spec_for(True), owner))
        self.owner = owner
        self.shepherd = Shepherd(
            spec=spec, run_id=self.run_id, identity=owner, term=0, state=OuterState.initial(theta0),
            evaluate=trainer.val_loss, score=trainer.score,
        )
        common = dict(spec=spec, run_id=self.run_id, shepherds={0: owner.peer_id}, target="cpu-x86_64-v3",
                      tokens_per_s=HONEST_SPEED)
        self.workers: dict[str, Worker] = {}
        self.attacker: str | None = None
        for i in range(WORKERS):
            ident = Identity(rng.bytes(32))
            if i == SEAT and attack == ABSENT:
                continue  # the seat stays empty: an attacker ignored perfectly, from the start
            if i == SEAT and attack is not None:
                cls = KINDS[attack]
                extra: dict[str, object] = {"claim_steps": H} if cls is RandomDelta else {}
                w: Worker = cls(identity=ident, seed=1, **common, **extra)  # type: ignore[arg-type]
                self.attacker = w.peer_id
            else:
                w = Worker(identity=ident, **common)  # type: ignore[arg-type]
            w.inner_state = moments  # (a copy is not needed: the trainer never writes into a state)
            self.workers[w.peer_id] = w
        self.log = RunLog()
        self.runs: dict[tuple[str, int, int], tuple[RunInner, InnerResult]] = {}  # for audits

    def run_inner(self, worker: str, e: RunInner) -> InnerResult:
        result = self.trainer.run_inner(worker, e)
        if worker != self.attacker:
            self.runs[(worker, e.round, e.attempt)] = (e, result)
        return result

    def run(self) -> dict:
        t0 = time.perf_counter()
        n_inner = len(self.trainer.inner_cpu_s)
        rl, stalled = self.log, None
        try:
            pump_run(self.shepherd, self.workers, self.run_inner, max_discards=2 * ROUNDS, log=rl)
        except LocalError as exc:  # e.g. honest workers diverged on a poisoned θ and submit nothing
            stalled = str(exc)
        honest = [w for p, w in self.workers.items() if p != self.attacker]
        last = rl.commits[-1] if rl.commits else None
        if last is not None and last.val_loss is not None and last.theta_cid == self.shepherd.theta_cid:
            final_val = last.val_loss  # the shepherd's evaluate of the final θ: the same batches
        else:
            final_val = self.trainer.val_loss(self.shepherd.state.theta)
        out: dict = {
            "val_loss": finite(final_val),
            "finished": self.shepherd.phase is Phase.FINISHED,
            "stalled": stalled,
            "val_curve": [finite(c.val_loss) for c in rl.commits if c.val_loss is not None],
            "discarded_attempts": rl.discarded,
            "honest_agree_on_theta": {w.theta_cid for w in honest} == {self.shepherd.theta_cid},
            "honest_refusals": sum(1 for p, _, _ in rl.rejected if p in {w.peer_id for w in honest}),
            "inner_runs": len(self.trainer.inner_cpu_s) - n_inner,
            "seconds": round(time.perf_counter() - t0, 1),
        }
        if self.attacker is not None:
            out["attacker_in_commits"] = sum(self.attacker in c.participants for c in rl.commits)
            out["attacker_refusals"] = dict(Counter(rl.rejected_from(self.attacker)))
            out["attacker_refusal_example"] = next((t for p, _, t in rl.rejected if p == self.attacker), None)
        log(f"{self.name}: val {final_val:.4f}{'' if stalled is None else ' STALLED'} "
            f"curve {out['val_curve']} ({out['seconds']} s"
            + (f", attacker in {out['attacker_in_commits']}/{len(rl.commits)} commits, "
               f"refused {out['attacker_refusals']}" if self.attacker else "") + ")")
        return out


def finite(x: float | None, digits: int = 4) -> float | None:
    """``x`` rounded, or None where JSON has no number for it (NaN, ±inf)."""
    return round(x, digits) if x is not None and math.isfinite(x) else None


def plan_for(arm: Arm, workers: set[str], rate: float) -> list[PlannedAudit]:
    """The audits the protocol's draw gives ``workers``' accepted submissions in ``arm`` at ``rate``."""
    targets = {w: "cpu-x86_64-v3" for w in arm.workers}
    subs = {(s.worker, s.round, s.attempt): s for w in arm.workers.values() for s in w.submitted}
    out: list[PlannedAudit] = []
    for c in arm.log.commits:
        ann = arm.log.announcements[(c.term, c.round, c.attempt)]
        accepted = {w: subs[(w, c.round, c.attempt)] for w in c.participants if w in workers}
        out += plan_audits(run_id=arm.run_id, rate=rate, identity=arm.owner, announcement=ann,
                           accepted=accepted, beacon=c.theta_cid, targets=targets, shepherd_term=c.term)
    return out


def run_audits(arm: Arm, trainer: JaxTrainer, planned: list[PlannedAudit]) -> tuple[Counter[str], list[tuple]]:
    r"""Carry out audits as the protocol does them; (verdicts, (export, import, replay) CPU seconds each).

    The audited worker exports its start state as a blob, the auditor imports
    it (checking the digest the worker signed), replays the round from the
    announced θ and assignment, and :func:`~pcp_p2p.diloco.protocol.audit.judge`\ s it.
    """
    auditor = Identity(np.random.default_rng(99).bytes(32))
    verdicts: Counter[str] = Counter()
    costs = []
    for p in planned:
        req = p.request
        sub = check_submission(req, p.submission_bytes)
        if sub.steps != trainer.steps:  # the program replays exactly H steps
            verdicts[f"not replayed ({sub.steps} steps claimed)"] += 1
            continue
        w = arm.workers[req.worker]
        if isinstance(w, ByzantineWorker):
            e = w.inner_requests[(req.round, req.attempt)]
        else:
            e, _ = arm.runs[(req.worker, req.round, req.attempt)]
        t0 = time.process_time()
        # The worker serves the state it signed as state_in; a liar claiming fresh moments serves none.
        blob = None if sub.state_in == FRESH_STATE else encode_inner_state(as_inner_state(e.inner_state))
        t1 = time.process_time()
        state = None if blob is None else decode_inner_state(blob, e.theta)
        if state is not None and inner_state_digest(state) != sub.state_in:
            verdicts["state_in does not match"] += 1
            continue
        t2 = time.process_time()
        rep = trainer.replay(e.theta, state, req.assignment)
        t3 = time.process_time()
        assert sub.delta_inline is not None
        report = judge(req, sub, e.theta, sub.delta_inline, rep.theta, rep.state_out, rep.losses, auditor)
        verdicts[report.verdict + (f" ({', '.join(report.differs)})" if report.differs else "")] += 1
        costs.append((t1 - t0, t2 - t1, t3 - t2))
    return verdicts, costs


def audit_figure(arm: Arm, trainer: JaxTrainer, rate: float) -> dict:
    """Audits of the clean arm through :mod:`pcp_p2p.diloco.protocol.audit`, and their cost.

    The draw is the protocol's (:func:`~pcp_p2p.diloco.protocol.audit.plan_audits`, beacon =
    the commit's θ CID) at the spec's ``audit_rate``; if it picks fewer than
    ``AUDIT_SAMPLES`` submissions, more are audited (requests drawn at rate 1,
    latest rounds first, so state export and import are timed too). Cost, as
    ``bench/audit.py`` defines it: per-round state naming / inner-run compute
    + ``audit_rate`` × (export + import + replay) / inner-run compute.
    """
    everyone = set(arm.workers)
    drawn = plan_for(arm, everyone, rate)
    taken = {p.request.submission_cid for p in drawn}
    extra = [p for p in reversed(plan_for(arm, everyone, 1.0)) if p.request.submission_cid not in taken]
    extra = extra[: max(0, AUDIT_SAMPLES - len(drawn))]
    verdicts, costs = run_audits(arm, trainer, drawn + extra)
    inner_s = float(np.median(trainer.inner_cpu_s))
    state_s = float(np.median(trainer.state_cpu_s))
    export_s, import_s, replay_s = (float(np.median(c)) for c in zip(*costs))
    per_round = state_s / inner_s
    per_audit = (export_s + import_s + replay_s) / inner_s
    return {
        "audit_overhead": round(per_round + rate * per_audit, 4),
        "audit_overhead_target": 0.05,
        "audit_overhead_method": (
            "state digest per inner run / inner run + audit_rate x (state export + import + replay) / inner run, "
            "as bench/audit.py defines it, in CPU seconds of this process with the JAX inner loop: clean-arm "
            "submissions drawn by audit.plan_audits, replayed and judged by audit.judge"
        ),
        "audit_rate": rate,
        "audits_drawn": len(drawn),
        "audits_run": len(drawn) + len(extra),
        "audit_verdicts": dict(verdicts),
        "audited_submissions": sum(len(c.participants) for c in arm.log.commits),
        "audit_replay_cpu_s": round(replay_s, 3),
        "audit_state_export_import_cpu_ms": round((export_s + import_s) * 1e3, 2),
        "state_digest_cpu_ms": round(state_s * 1e3, 2),
        "inner_run_cpu_s": round(inner_s, 3),
    }


def flood_figure() -> dict:
    if os.environ.get("PCP_BENCH_FLOOD", "1") == "0":
        return {"flood_rss_growth_mib": None, "flood_rss_growth_mib_target": 64,
                "flood_note": "skipped (PCP_BENCH_FLOOD=0)"}
    import logging

    from pcp_p2p.testing.flood import flood

    # The attacker's own hosts log every stream the node refuses (py-libp2p's
    # basic_host, at ERROR): expected here, and counted in the result instead.
    logging.getLogger("libp2p").setLevel(logging.CRITICAL)
    hold = float(os.environ.get("PCP_BENCH_FLOOD_HOLD_S", "20"))
    log(f"flood: a node process, 48 /pcp/msg streams from one peer, {hold:g} s")
    r = flood(peers=1, streams_per_peer=48, hold_s=hold)
    log(f"flood: {r.as_dict()}")
    return {
        "flood_rss_growth_mib": round(r.growth_mib, 1),
        "flood_rss_growth_mib_target": 64,
        "flood": r.as_dict(),
    }


def main() -> None:
    t_start = time.perf_counter()
    defended, plain = spec_for(True), spec_for(False)
    trainer = JaxTrainer(defended, steps=H, val_batches=VAL_BATCHES, val_batch_size=WORKERS * B)
    theta0, moments = trainer.initial_theta(), None
    if WARMUP:
        log(f"warm start: {WARMUP} synchronous steps at batch {WORKERS * B}")
        theta0, moments = trainer.warm_start(theta0, steps=WARMUP, batch=WORKERS * B)
    if FRESH_MOMENTS:
        moments = None
    initial_val = trainer.val_loss(theta0)
    log(f"config: {ROUNDS} rounds x H={H}, {WORKERS} workers, attacks {ATTACKS}, undefended {UNDEFENDED}; "
        f"initial val {initial_val:.4f}")

    results: dict[str, dict] = {}
    clean = Arm("clean", defended, trainer, theta0, moments, None)
    results["clean"] = clean.run()
    results["clean_plain_mean"] = Arm("clean_plain_mean", plain, trainer, theta0, moments, None).run()
    results["three_honest"] = Arm("three_honest", defended, trainer, theta0, moments, ABSENT).run()
    audit = audit_figure(clean, trainer, defended.aggregation.audit_rate)
    for kind in ATTACKS:
        arm = Arm(kind, defended, trainer, theta0, moments, kind)
        results[kind] = arm.run()
        # What the aggregator let through, an audit of it would say (every one audited, rate 1).
        assert arm.attacker is not None
        verdicts, _ = run_audits(arm, trainer, plan_for(arm, {arm.attacker}, 1.0))
        results[kind]["attacker_audit_verdicts"] = dict(verdicts)
        if verdicts:
            log(f"{kind}: audits of its accepted submissions: {dict(verdicts)}")
    for kind in UNDEFENDED:
        results[f"{kind}_undefended"] = Arm(f"{kind}_undefended", plain, trainer, theta0, moments, kind).run()

    clean_val = results["clean"]["val_loss"]

    def ratio(arm: str) -> float:  # a diverged arm (no finite val loss) counts as infinitely worse
        v = results[arm]["val_loss"]
        return round(v / clean_val, 4) if v is not None else math.inf

    ratios = {k: ratio(k) for k in ATTACKS}
    worst = max(ratios, key=ratios.__getitem__) if ratios else None
    g = defended.aggregation
    result = {
        "headline": finite(ratios[worst]) if worst else None,
        "target": 1.02,
        "better": "lower",
        "unit": "ratio",
        "metric": "worst final validation loss, 1 Byzantine worker of 4 / clean, same run (tiny GPT, Shakespeare)",
        "worst_attack": worst,
        **{f"ratio_{k}": finite(r) for k, r in ratios.items()},
        **{f"ratio_{k}_undefended": finite(ratio(f"{k}_undefended")) for k in UNDEFENDED},
        "ratio_three_honest": finite(ratio("three_honest")),
        "robust_clean_cost": round(clean_val / results["clean_plain_mean"]["val_loss"], 4),
        "robust_clean_cost_target": 1.01,
        **audit,
        **flood_figure(),
        "clean_val_loss": round(clean_val, 4),
        "initial_val_loss": round(initial_val, 4),
        "defences": {"rule": g.rule, "trim_fraction": g.trim_fraction, "norm_vs_median": g.norm_vs_median,
                     "max_share": g.max_share, "score_tolerance": g.score_tolerance, "val_jump": g.val_jump},
        "config": {"workers": WORKERS, "byzantine": 1, "rounds": ROUNDS, "inner_steps": H, "batch": B,
                   "seq_len": T, "warm_start_steps": WARMUP, "fresh_moments": FRESH_MOMENTS, "min_quorum": QUORUM,
                   "model": "tiny",
                   "max_inner_steps": 10 * H, "codec": "int8", "val_batches": VAL_BATCHES},
        "arms": {k: {kk: (round(v, 4) if isinstance(v, float) else v) for kk, v in r.items()}
                 for k, r in results.items()},
        "seconds_total": round(time.perf_counter() - t_start, 1),
    }
    print(json.dumps(result))


if __name__ == "__main__":
    main()
