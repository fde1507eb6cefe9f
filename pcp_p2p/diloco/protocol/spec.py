"""The run spec: everything a run's owner fixes before the first round, signed.

A run spec is written by a person as TOML, parsed here into frozen dataclasses
(which are also wire structs, so the *same* objects are signed, gossiped and
stored), validated with a :class:`~pcp_p2p.core.errors.ConfigError` that names the
offending key, and signed by the owner's node key. The run id is the CID of the
encoded signed spec: it names exactly one set of rules and one owner, so a
submission tagged with another run id can be refused without looking further.

Example (every key optional; these are the defaults)::

    name = "shakespeare-tiny"
    seed = 0

    [model]
    preset = "tiny"          # or "small", "medium", "large" (~100M parameters; docs/compile.md)

    [inner]            # AdamW, run locally by each worker
    lr = 1e-3
    beta1 = 0.9
    beta2 = 0.99
    weight_decay = 0.1
    grad_clip = 1.0
    batch_size = 16
    seq_len = 64

    [outer]            # Nesterov SGD on the averaged pseudo-gradient
    lr = 0.7
    momentum = 0.9
    update_codec = "int8"    # the applied outer step on the wire, or "fp32" (as computed)

    [round]
    time_budget_s = 60.0     # inner training time per round (fast nodes do more steps)
    max_inner_steps = 500    # and never more than this
    deadline_s = 120.0       # from announcement to "commit with whoever arrived"
    rounds = 100
    min_quorum = 2
    delta_codec = "int8"     # or "fp32", or "topk2" (sparse 3-bit, error feedback; needs
                             # audit_rate = 0 and rule = "centered_clip" or "mean")
    max_delta_norm = 0.0     # 0: derive from AdamW's step size (see aggregate.py)
    token_slack = 1.5        # how far above its measured speed a worker may claim
    overlap = false          # start the next round's inner steps while the Δ is in flight
                             # (needs audit_rate = 0; docs/diloco.md, "Overlap")

    [election]         # who is shepherd: terms, leases, rotation (see docs/election.md)
    lease_s = 6.0
    renew_every_s = 2.0
    grace_s = 1.0
    min_uptime_s = 5.0
    rotate_every = 10        # rounds per term; 0 = never rotate
    claim_timeout_s = 10.0
    max_skew_s = 2.0         # a lease dated further ahead of a verifier's clock is refused

    [aggregation]      # bounded, robust, scored, audited contributions (docs/security.md)
    rule = "trimmed_mean"    # or "centered_clip", or "mean" (not robust)
    trim_fraction = 0.25
    clip_iters = 3
    norm_vs_median = 3.0     # ‖Δ‖ above 3x the round's median is refused; 0 = off
    max_share = 0.5          # the most token weight one worker may carry
    score_tolerance = 0.05   # a Δ whose held-out loss is worse than the round's median by more (nats) is refused
    val_jump = 0.10          # a commit whose val loss rises >10% is retried without suspects
    audit_rate = 0.04        # share of accepted submissions re-executed by another worker
    aggregators = 0          # above aggregate_above workers, this many members combine groups of Δs; 0 = off
    aggregate_above = 16     # (docs/diloco.md, "Aggregators")
    partial_audit_rate = 0.25  # share of partial aggregates another member recomputes

    [admission]        # who may contribute
    mode = "open"            # or "allowlist"
    allowlist = []           # peer ids (amendable by owner-signed updates)
    shepherds = []           # peer ids that may be elected shepherd; [] = any admitted member

    [data]
    dataset = "shakespeare"  # or a path to a text file or a folder of .txt files

    [targets]            # compile targets (see `pcp compile --help`) workers may run
    allowed = ["cpu-x86_64-v4", "cpu-x86_64-v3", "cpu-x86_64-generic", "cpu-aarch64", "cpu-apple-m1"]
"""

from __future__ import annotations

import dataclasses
import math
import tomllib
from pathlib import Path
from typing import Any

from pcp_p2p.core.cid import cid_of
from pcp_p2p.core.errors import ConfigError, MalformedMessage
from pcp_p2p.core.identity import Identity, verify_signature
from pcp_p2p.diloco.algorithm.robust import AGGREGATION_RULES, AggregationPolicy
from pcp_p2p.diloco.algorithm.update import UPDATE_CODECS
from pcp_p2p.wire import Message, encode, signing_bytes, wire_message, wire_struct

MODEL_PRESETS = ("tiny", "small", "medium", "large")
"""``model.preset``: the named shapes of pcp_p2p.compile.model.PRESETS (0.2M, 1M, 10.8M, 99.7M parameters)."""
DELTA_CODECS = ("int8", "fp32", "topk2")
"""``round.delta_codec``: int8 (dense, ~1 byte/parameter), fp32 (exact), topk2 (the largest of
every 16 values, 3-bit values, error feedback: ~0.47 bit/parameter; pcp_p2p.diloco.algorithm.sparse)."""
FEEDBACK_CODECS = ("topk2",)
"""Codecs whose workers keep an error-feedback residual (pcp_p2p.diloco.algorithm.sparse): not auditable yet."""
ADMISSION_MODES = ("open", "allowlist")


@wire_struct
class InnerOptimizer(Message):
    """AdamW hyper-parameters of the inner loop (run inside the compiled artifact)."""

    lr: float = 1e-3
    beta1: float = 0.9
    beta2: float = 0.99
    weight_decay: float = 0.1
    grad_clip: float = 1.0
    batch_size: int = 16
    seq_len: int = 64


@wire_struct
class OuterOptimizer(Message):
    """Nesterov momentum SGD on the averaged pseudo-gradient (DiLoCo: 0.7 / 0.9)."""

    lr: float = 0.7
    momentum: float = 0.9
    update_codec: str = "int8"  # how the applied outer step travels (pcp_p2p.diloco.algorithm.update)


@wire_struct
class RoundPolicy(Message):
    """How long a round lasts, who must answer, and what a submission may look like."""

    time_budget_s: float = 60.0
    max_inner_steps: int = 500
    deadline_s: float = 120.0
    rounds: int = 100
    min_quorum: int = 2
    delta_codec: str = "int8"
    max_delta_norm: float = 0.0
    token_slack: float = 1.5
    overlap: bool = False  # early inner runs (pcp_p2p.diloco.protocol.worker, "Overlap")


@wire_struct
class ElectionPolicy(Message):
    """Shepherd election rules; part of the spec so that every member ranks and times out alike.

    Defaults are for swarms on one site: a lease lapses 6 s after its last
    renewal, so a dead shepherd is replaced within seconds.
    """

    lease_s: float = 6.0
    renew_every_s: float = 2.0
    grace_s: float = 1.0
    min_uptime_s: float = 5.0
    rotate_every: int = 10  # rounds per term before a planned hand-over; 0 = never
    claim_timeout_s: float = 10.0
    max_skew_s: float = 2.0  # how far a lease's times may lie ahead of a verifier's clock


@wire_struct
class AdmissionPolicy(Message):
    """Who may contribute to the run (``open``: any member; ``allowlist``: the owner's list).

    ``allowlist`` may be amended later by updates the owner signs (see
    :mod:`pcp_p2p.diloco.protocol.admission`). ``shepherds``, when not empty, is the only
    set of peers that may be elected shepherd (they sign the artifacts every
    worker runs); empty means any admitted member that can compile.
    """

    mode: str = "open"
    allowlist: tuple[str, ...] = ()
    shepherds: tuple[str, ...] = ()


@wire_struct
class RunSpec(Message):
    """One training run's rules. Build with :func:`parse_spec`; always :meth:`validate`."""

    name: str = "run"
    seed: int = 0
    model: str = "tiny"
    inner: InnerOptimizer = dataclasses.field(default_factory=InnerOptimizer)
    outer: OuterOptimizer = dataclasses.field(default_factory=OuterOptimizer)
    round: RoundPolicy = dataclasses.field(default_factory=RoundPolicy)
    election: ElectionPolicy = dataclasses.field(default_factory=ElectionPolicy)
    aggregation: AggregationPolicy = dataclasses.field(default_factory=AggregationPolicy)
    admission: AdmissionPolicy = dataclasses.field(default_factory=AdmissionPolicy)
    dataset: str = "shakespeare"
    targets: tuple[str, ...] = ("cpu-x86_64-v4", "cpu-x86_64-v3", "cpu-x86_64-generic", "cpu-aarch64", "cpu-apple-m1")

    @property
    def tokens_per_step(self) -> int:
        return self.inner.batch_size * self.inner.seq_len

    def validate(self) -> RunSpec:
        """Raise :class:`ConfigError` naming the first bad value; return ``self``."""

        def need(ok: bool, key: str, why: str) -> None:
            if not ok:
                raise ConfigError(f"run spec: {key} {why}")

        def finite(x: float) -> bool:
            return isinstance(x, float) and math.isfinite(x)

        i, o, r = self.inner, self.outer, self.round
        need(0 < len(self.name) <= 128, "name", "must be 1-128 characters")
        need(self.model in MODEL_PRESETS, "model.preset", f"must be one of {MODEL_PRESETS}")
        need(finite(i.lr) and 0 < i.lr < 1, "inner.lr", "must be in (0, 1)")
        need(finite(i.beta1) and 0 <= i.beta1 < 1, "inner.beta1", "must be in [0, 1)")
        need(finite(i.beta2) and 0 <= i.beta2 < 1, "inner.beta2", "must be in [0, 1)")
        need(finite(i.weight_decay) and 0 <= i.weight_decay < 1, "inner.weight_decay", "must be in [0, 1)")
        need(finite(i.grad_clip) and i.grad_clip >= 0, "inner.grad_clip", "must be >= 0 (0 = off)")
        need(1 <= i.batch_size <= 4096, "inner.batch_size", "must be in [1, 4096]")
        need(1 <= i.seq_len <= 65536, "inner.seq_len", "must be in [1, 65536]")
        need(finite(o.lr) and 0 < o.lr <= 10, "outer.lr", "must be in (0, 10]")
        need(finite(o.momentum) and 0 <= o.momentum < 1, "outer.momentum", "must be in [0, 1)")
        need(o.update_codec in UPDATE_CODECS, "outer.update_codec", f"must be one of {UPDATE_CODECS}")
        need(finite(r.time_budget_s) and r.time_budget_s > 0, "round.time_budget_s", "must be > 0")
        need(1 <= r.max_inner_steps <= 1_000_000, "round.max_inner_steps", "must be in [1, 1e6]")
        need(
            finite(r.deadline_s) and r.deadline_s > r.time_budget_s,
            "round.deadline_s",
            "must be a finite number above round.time_budget_s (workers need time to submit)",
        )
        need(1 <= r.rounds <= 10_000_000, "round.rounds", "must be >= 1")
        need(1 <= r.min_quorum <= 100_000, "round.min_quorum", "must be >= 1")
        need(r.delta_codec in DELTA_CODECS, "round.delta_codec", f"must be one of {DELTA_CODECS}")
        need(finite(r.max_delta_norm) and r.max_delta_norm >= 0, "round.max_delta_norm", "must be >= 0 (0 = derived)")
        need(finite(r.token_slack) and r.token_slack >= 1, "round.token_slack", "must be >= 1")
        need(0 < len(self.dataset) <= 4096, "data.dataset", "must be a name or a path")
        need(
            0 < len(self.targets) <= 64 and all(0 < len(t) <= 128 for t in self.targets),
            "targets.allowed",
            "must list 1-64 target names",
        )
        e = self.election
        need(finite(e.lease_s) and 0 < e.renew_every_s < e.lease_s, "election.renew_every_s", "must be in (0, lease_s)")
        need(finite(e.grace_s) and e.grace_s >= 0, "election.grace_s", "must be >= 0")
        need(finite(e.min_uptime_s) and e.min_uptime_s >= 0, "election.min_uptime_s", "must be >= 0")
        need(0 <= e.rotate_every <= 1_000_000, "election.rotate_every", "must be >= 0 (0 = never)")
        need(finite(e.claim_timeout_s) and e.claim_timeout_s > 0, "election.claim_timeout_s", "must be > 0")
        need(finite(e.max_skew_s) and 0 <= e.max_skew_s <= e.lease_s, "election.max_skew_s", "must be in [0, lease_s]")
        g = self.aggregation
        need(g.rule in AGGREGATION_RULES, "aggregation.rule", f"must be one of {AGGREGATION_RULES}")
        need(finite(g.trim_fraction) and 0 <= g.trim_fraction < 0.5, "aggregation.trim_fraction", "must be in [0, 0.5)")
        need(1 <= g.clip_iters <= 100, "aggregation.clip_iters", "must be in [1, 100]")
        need(finite(g.norm_vs_median) and (g.norm_vs_median == 0 or g.norm_vs_median >= 1),
             "aggregation.norm_vs_median", "must be 0 (off) or >= 1")
        need(finite(g.max_share) and 0 < g.max_share <= 1, "aggregation.max_share", "must be in (0, 1]")
        need(finite(g.score_tolerance), "aggregation.score_tolerance", "must be a number (< 0 = off)")
        need(finite(g.val_jump) and g.val_jump >= 0, "aggregation.val_jump", "must be >= 0 (0 = off)")
        need(finite(g.audit_rate) and 0 <= g.audit_rate <= 1, "aggregation.audit_rate", "must be in [0, 1]")
        need(0 <= g.aggregators <= 64, "aggregation.aggregators", "must be in [0, 64] (0 = off)")
        need(g.aggregate_above >= 0, "aggregation.aggregate_above", "must be >= 0")
        need(finite(g.partial_audit_rate) and 0 <= g.partial_audit_rate <= 1, "aggregation.partial_audit_rate",
             "must be in [0, 1]")
        need(g.audit_rate == 0 or r.delta_codec not in FEEDBACK_CODECS, "aggregation.audit_rate",
             f"must be 0 with round.delta_codec = {r.delta_codec!r}: its workers train from θ minus a private "
             "error-feedback residual, which an audit cannot replay yet")
        need(g.rule != "trimmed_mean" or r.delta_codec not in FEEDBACK_CODECS, "aggregation.rule",
             f"must not be trimmed_mean with round.delta_codec = {r.delta_codec!r}: it drops what fewer than "
             "trim_fraction of the workers sent, which their residuals already let go (use centered_clip)")
        need(g.audit_rate == 0 or not r.overlap, "aggregation.audit_rate",
             "must be 0 with round.overlap = true: an overlapped round starts from the worker's own end point "
             "and is shifted mid-run, which an audit cannot replay yet")
        a = self.admission
        need(a.mode in ADMISSION_MODES, "admission.mode", f"must be one of {ADMISSION_MODES}")
        need(len(a.allowlist) <= 10_000 and all(0 < len(p) <= 128 for p in a.allowlist),
             "admission.allowlist", "must list at most 10000 peer ids")
        need(len(a.shepherds) <= 1_000 and all(0 < len(p) <= 128 for p in a.shepherds),
             "admission.shepherds", "must list at most 1000 peer ids")
        from pcp_p2p.compile.targets import TARGETS

        unknown = [t for t in self.targets if t not in TARGETS]
        need(not unknown, "targets.allowed", f"names unknown targets {unknown}; known: {', '.join(TARGETS)}")
        return self


# --- TOML -------------------------------------------------------------------

_SECTIONS: dict[str, type[Message]] = {
    "inner": InnerOptimizer,
    "outer": OuterOptimizer,
    "round": RoundPolicy,
    "election": ElectionPolicy,
    "aggregation": AggregationPolicy,
    "admission": AdmissionPolicy,
}


def _build(cls: type[Message], table: Any, where: str) -> Any:
    """A struct from a TOML table, with ints accepted for floats and unknown keys refused."""
    if not isinstance(table, dict):
        raise ConfigError(f"run spec: [{where}] must be a table")
    fields = {f.name: f for f in dataclasses.fields(cls)}
    kwargs: dict[str, Any] = {}
    for key, value in table.items():
        if key not in fields:
            raise ConfigError(f"run spec: unknown key {where}.{key} (known: {', '.join(fields)})")
        default = fields[key].default
        if isinstance(default, float) and type(value) is int:
            value = float(value)
        if isinstance(default, tuple):  # lists of strings (peer ids)
            if not isinstance(value, list) or not all(type(x) is str for x in value):
                raise ConfigError(f"run spec: {where}.{key} must be a list of strings")
            value = tuple(value)
        if type(value) is not type(default):
            raise ConfigError(
                f"run spec: {where}.{key} must be a {type(default).__name__}, got {value!r:.40}"
            )
        kwargs[key] = value
    return cls(**kwargs)


def parse_spec(text: str) -> RunSpec:
    """A validated :class:`RunSpec` from TOML text; :class:`ConfigError` for anything wrong."""
    try:
        doc = tomllib.loads(text)
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError(f"run spec is not valid TOML: {exc}") from exc
    known = {"name", "seed", "model", "inner", "outer", "round", "election", "aggregation", "admission", "data",
             "targets"}
    for key in doc:
        if key not in known:
            raise ConfigError(f"run spec: unknown key {key!r} (known: {', '.join(sorted(known))})")
    kwargs: dict[str, Any] = {}
    for key, typ in (("name", str), ("seed", int)):
        if key in doc:
            if type(doc[key]) is not typ:
                raise ConfigError(f"run spec: {key} must be a {typ.__name__}")
            kwargs[key] = doc[key]
    if "model" in doc:
        model = doc["model"]
        if not isinstance(model, dict) or set(model) - {"preset"} or type(model.get("preset", "tiny")) is not str:
            raise ConfigError(f"run spec: [model] takes one key, preset = one of {MODEL_PRESETS}")
        kwargs["model"] = model.get("preset", "tiny")
    for key, cls in _SECTIONS.items():
        if key in doc:
            kwargs[key] = _build(cls, doc[key], key)
    if "data" in doc:
        data = doc["data"]
        if not isinstance(data, dict) or set(data) - {"dataset"} or type(data.get("dataset", "")) is not str:
            raise ConfigError("run spec: [data] takes one key, dataset = \"shakespeare\" or a path")
        if "dataset" in data:
            kwargs["dataset"] = data["dataset"]
    if "targets" in doc:
        t = doc["targets"]
        allowed = t.get("allowed") if isinstance(t, dict) else None
        if not isinstance(allowed, list) or not all(type(x) is str for x in allowed) or set(t) - {"allowed"}:
            raise ConfigError("run spec: [targets] takes one key, allowed = [\"target\", ...]")
        kwargs["targets"] = tuple(allowed)
    return RunSpec(**kwargs).validate()


def load_spec(path: str | Path) -> RunSpec:
    """Read and parse a TOML run spec file."""
    try:
        text = Path(path).read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise ConfigError(f"cannot read run spec {path}: {exc}") from exc
    return parse_spec(text)


# --- signed form ------------------------------------------------------------


@wire_message("diloco.run_spec", max_size=16 * 1024)
class SignedRunSpec(Message):
    """A run spec with its owner's peer id and Ed25519 signature over the rest."""

    spec: RunSpec
    owner: str
    signature: bytes = b""


def sign_spec(spec: RunSpec, identity: Identity) -> SignedRunSpec:
    """The spec signed by ``identity`` (who thereby owns the run)."""
    spec.validate()
    unsigned = SignedRunSpec(spec=spec, owner=identity.peer_id)
    return dataclasses.replace(unsigned, signature=identity.sign(signing_bytes(unsigned)))


def verify_spec(signed: SignedRunSpec) -> RunSpec:
    """The spec if the owner's signature holds and its values are sane.

    Raises :class:`~pcp_p2p.core.errors.BadSignature` for a bad signature and
    :class:`~pcp_p2p.core.errors.MalformedMessage` for a signed spec with values out of
    range (it came from a peer: a remote fault, not a local config error).
    """
    verify_signature(signed.owner, signing_bytes(signed), signed.signature)
    try:
        return signed.spec.validate()
    except ConfigError as exc:
        raise MalformedMessage(f"signed run spec has bad values: {exc}") from exc


def run_id_of(signed: SignedRunSpec) -> str:
    """The run id: the CID of the encoded signed spec."""
    return cid_of(encode(signed))
