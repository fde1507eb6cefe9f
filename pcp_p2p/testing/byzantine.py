"""Byzantine workers: correct protocol, dishonest numbers.

Each class here is a :class:`~pcp_p2p.diloco.protocol.worker.Worker` that joins, fetches,
signs and submits exactly as an honest one does — every message well-formed,
on time, signed by its own key, for the current term, round and attempt — and
lies only where the shepherd cannot check it by reading the message: the Δ it
sends, and how much work it claims. That is the attacker issue #12 worries
about (a stranger with a fresh key), and the one the robust aggregation,
scoring and audits must withstand; anything malformed is refused by the
admission checks long before and is tested elsewhere.

How the lie is told: the honest machinery computes the pseudo-gradient as
``Δ = θ_r − θ_local``, so a subclass's :meth:`ByzantineWorker.forge` returns the
Δ it wants to send and the claimed step count, and the worker hands the parent
a θ_local of ``θ_r − Δ`` — codec, signature and bill are then the parent's own.
Workers that do not need to train (random, stale after its first round) answer
their ``RunInner`` at once, without compute, the way a freeloader would. Every
attacker joins again with each submission: refused every round, it still never
misses enough rounds to leave the roster, so it attacks every round.

``last_base`` / ``last_honest`` / ``last_forged`` keep the θ of the most recent
forgery, the honest Δ from it (if one was trained) and the Δ actually sent, and
``inner_requests`` the inputs of every round it was asked to train (what an
auditor replays), so tests can check each attacker does what
it says (a sign flip is exactly −honest, ...).
"""

from __future__ import annotations

import dataclasses
import hashlib
from typing import ClassVar, TypedDict, Unpack

import numpy as np

from pcp_p2p.core.identity import Identity
from pcp_p2p.diloco.algorithm.params import Params, global_norm
from pcp_p2p.diloco.protocol.aggregate import delta_norm_bound
from pcp_p2p.diloco.protocol.effects import Effect, RunInner, Send
from pcp_p2p.diloco.protocol.messages import FRESH_STATE, RoundAnnouncement, Submission
from pcp_p2p.diloco.protocol.spec import RunSpec
from pcp_p2p.diloco.protocol.worker import InnerResult, Worker

UNDER_BOUND = 0.99
"""How close to the aggregator's absolute norm bound a maximal attacker goes."""


class WorkerArgs(TypedDict):
    """:class:`Worker`'s keyword arguments, which every attacker passes through unchanged."""

    spec: RunSpec
    run_id: str
    identity: Identity
    shepherds: dict[int, str]
    target: str
    tokens_per_s: float


class AttackerArgs(WorkerArgs, total=False):
    """What a subclass of :class:`ByzantineWorker` passes up: the worker's arguments and the seed."""

    seed: int


class ByzantineWorker(Worker):
    """A worker that speaks the protocol correctly but chooses its own Δ and step claim."""

    kind: ClassVar[str] = "byzantine"

    def __init__(self, *, seed: int = 0, **kw: Unpack[WorkerArgs]) -> None:
        super().__init__(**kw)
        self.rng = np.random.default_rng(seed)
        self.last_base: Params | None = None
        self.last_honest: Params | None = None
        self.last_forged: Params | None = None
        self.last_losses: tuple[float, ...] = ()
        self.inner_requests: dict[tuple[int, int], RunInner] = {}  # (round, attempt) -> its inputs, for audits

    # --- what a subclass decides ---------------------------------------------------

    def trains(self, e: RunInner) -> bool:
        """Whether this round needs the honest inner loop's result (default: yes)."""
        return True

    def forge(self, honest: Params | None, trained_steps: int, ann: RoundAnnouncement) -> tuple[Params, int]:
        """(the Δ to send, the steps to claim); ``honest`` is None when it did not train."""
        raise NotImplementedError

    # --- plumbing --------------------------------------------------------------------

    def on_announcement(self, ann: RoundAnnouncement, now: float) -> list[Effect]:
        return self._skip_training(super().on_announcement(ann, now), now)

    def on_blob(self, cid: str, data: bytes, now: float) -> list[Effect]:
        return self._skip_training(super().on_blob(cid, data, now), now)

    def _skip_training(self, effects: list[Effect], now: float) -> list[Effect]:
        """Answer at once the ``RunInner`` of a round this attacker does not train for."""
        out: list[Effect] = []
        for e in effects:
            if isinstance(e, RunInner):
                self.inner_requests[(e.round, e.attempt)] = e
            if isinstance(e, RunInner) and not self.trains(e):
                # It claims fresh moments and names an end state it never had: well-formed,
                # and only an audit's replay can tell (audit.StateChain allows fresh starts).
                fake_out = hashlib.sha256(self.rng.bytes(32)).hexdigest()
                result = InnerResult(e.round, e.attempt, e.theta, 0, (), e.inner_state, FRESH_STATE, fake_out)
                out += self.on_inner_done(result, now)
            else:
                out.append(e)
        return out

    def on_inner_done(self, result: InnerResult, now: float) -> list[Effect]:
        ann, theta = self.current, self.theta
        if ann is None or theta is None or (result.round, result.attempt) != (ann.round, ann.attempt):
            return super().on_inner_done(result, now)  # superseded: the parent ignores it
        honest = None
        if result.steps > 0:
            honest = {k: theta[k] - np.asarray(result.theta[k], dtype=np.float32) for k in theta}
            self.last_losses = tuple(result.losses)
        delta, steps = self.forge(honest, result.steps, ann)
        self.last_base, self.last_honest, self.last_forged = theta, honest, delta
        forged_local = {k: (theta[k] - delta[k]).astype(np.float32) for k in theta}
        losses = self.last_losses[:steps] or (2.0,)  # a healthy-looking training loss
        forged = dataclasses.replace(result, theta=forged_local, steps=steps, losses=losses)
        effects = super().on_inner_done(forged, now)
        # Persistent: it joins again with every submission, so a refusal never
        # makes it miss rounds and drop off the roster (a Join resets the count).
        return effects + self._join() if any(isinstance(e, Send) for e in effects) else effects

    # --- helpers for subclasses ---------------------------------------------------------

    def claim(self, trained_steps: int, ann: RoundAnnouncement) -> int:
        """Steps to claim when honest about the count: what was trained, else the assignment's cap."""
        a = ann.assignment_for(self.peer_id)
        assert a is not None
        return trained_steps if trained_steps > 0 else a.max_steps

    def bound(self, steps: int) -> float:
        """The aggregator's absolute norm bound for ``steps`` claimed steps from the current θ."""
        assert self.theta is not None
        return delta_norm_bound(self.spec, self.theta, steps)


class RandomDelta(ByzantineWorker):
    """Never trains; sends a random direction with a norm just under the absolute bound."""

    kind = "random"

    def __init__(self, *, claim_steps: int, **kw: Unpack[AttackerArgs]) -> None:
        super().__init__(**kw)
        self.claim_steps = claim_steps

    def trains(self, e: RunInner) -> bool:
        return False

    def forge(self, honest: Params | None, trained_steps: int, ann: RoundAnnouncement) -> tuple[Params, int]:
        assert self.theta is not None
        steps = min(self.claim_steps, self.claim(0, ann))
        return random_delta(self.theta, UNDER_BOUND * self.bound(steps), self.rng), steps


class SignFlip(ByzantineWorker):
    """Trains honestly and sends −Δ: pushes θ uphill by as much as an honest worker pushes it down."""

    kind = "sign_flip"

    def forge(self, honest: Params | None, trained_steps: int, ann: RoundAnnouncement) -> tuple[Params, int]:
        assert honest is not None
        return {k: -v for k, v in honest.items()}, trained_steps


class ScaledHonest(ByzantineWorker):
    """Trains honestly and sends ``scale``·Δ, or the largest multiple under the absolute bound."""

    kind = "scaled"

    def __init__(self, *, scale: float = 10.0, **kw: Unpack[AttackerArgs]) -> None:
        super().__init__(**kw)
        self.scale = scale

    def forge(self, honest: Params | None, trained_steps: int, ann: RoundAnnouncement) -> tuple[Params, int]:
        assert honest is not None
        s = capped_scale(self.scale, global_norm(honest), UNDER_BOUND * self.bound(trained_steps))
        return {k: (s * v).astype(np.float32) for k, v in honest.items()}, trained_steps


class TokenInflation(ByzantineWorker):
    """Claims 1e12 tokens/s when joining and the assignment's maximum steps in every submission.

    The Δ matches the claim: the honest Δ of the steps it really trained,
    extrapolated to the claimed count (× claimed/trained, capped under the
    absolute bound for the claimed steps), so neither the bill nor the norm
    gives it away on their own. ``payload="random"`` sends a random Δ at that
    bound instead, without training (the poisoning issue #12 reproduced:
    78–93 % of the token weight, val loss 2.66 → 3,000 in three rounds).
    """

    kind = "token_inflation"
    CLAIMED_TOKENS_PER_S = 1e12

    def __init__(self, *, payload: str = "extrapolated", **kw: Unpack[AttackerArgs]) -> None:
        if payload not in ("extrapolated", "random"):
            raise ValueError(f"payload {payload!r}: 'extrapolated' or 'random'")
        kw["tokens_per_s"] = self.CLAIMED_TOKENS_PER_S
        super().__init__(**kw)
        self.payload = payload

    def trains(self, e: RunInner) -> bool:
        return self.payload == "extrapolated"

    def forge(self, honest: Params | None, trained_steps: int, ann: RoundAnnouncement) -> tuple[Params, int]:
        a = ann.assignment_for(self.peer_id)
        assert a is not None and self.theta is not None
        steps = a.max_steps
        cap = UNDER_BOUND * self.bound(steps)
        if honest is None:
            return random_delta(self.theta, cap, self.rng), steps
        s = capped_scale(steps / max(1, trained_steps), global_norm(honest), cap)
        return {k: (s * v).astype(np.float32) for k, v in honest.items()}, steps


class StaleReplay(ByzantineWorker):
    """Trains once, then never again: each later round it replays its first submission.

    Twice per round: the old signed submission verbatim (a plain replay, which
    the header checks must refuse as stale), then the same Δ and claim re-signed
    for the current round and θ — well-formed, and free.
    """

    kind = "stale_replay"

    def __init__(self, **kw: Unpack[AttackerArgs]) -> None:
        super().__init__(**kw)
        self.kept: tuple[Params, int] | None = None

    def trains(self, e: RunInner) -> bool:
        return self.kept is None

    def forge(self, honest: Params | None, trained_steps: int, ann: RoundAnnouncement) -> tuple[Params, int]:
        if self.kept is None:
            assert honest is not None
            self.kept = (honest, trained_steps)
        return self.kept

    def on_inner_done(self, result: InnerResult, now: float) -> list[Effect]:
        old: Submission | None = self.submitted[0] if self.submitted else None
        effects = super().on_inner_done(result, now)
        if old is None or self.shepherd is None or not any(isinstance(e, Send) for e in effects):
            return effects
        return [Send(self.current.shepherd if self.current else self.shepherd, old), *effects]


KINDS: dict[str, type[ByzantineWorker]] = {
    c.kind: c for c in (RandomDelta, SignFlip, ScaledHonest, TokenInflation, StaleReplay)
}
"""Every attacker, by the name the benchmark reports it under."""


def random_delta(theta: Params, norm: float, rng: np.random.Generator) -> Params:
    """A Gaussian direction over θ's tensors, scaled to global norm ``norm``."""
    d = {k: rng.standard_normal(v.shape).astype(np.float32) for k, v in theta.items()}
    s = norm / global_norm(d)
    return {k: (v * s).astype(np.float32) for k, v in d.items()}


def capped_scale(scale: float, norm: float, cap: float) -> float:
    """``scale``, or less so that ``scale·norm`` stays at most ``cap``."""
    return min(scale, cap / norm) if norm > 0 else scale
