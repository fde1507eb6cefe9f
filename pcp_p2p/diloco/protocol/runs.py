"""How runs travel: publishing a signed run spec, finding runs, and whom to trust.

A run is created by its owner (``pcp run create SPEC.toml``), who signs the
spec; the run id is the CID of the signed spec. The spec then reaches nodes
three ways, so neither a dropped message nor a late start strands a node:

1. the owner stores it in the DHT under ``/pcp/run/<run id>`` (a record only
   the owner can sign, and only for the spec that hashes to that id);
2. the owner sends it directly (``/pcp/msg/1.0.0``) to every live member it
   sees within a few seconds of joining;
3. every node taking part lists the run id in its member record, so a node
   that joins later sees the id in a heartbeat and fetches the spec from the
   DHT.

A node acts on a spec only if it trusts the owner (``--trust PEER_ID``,
repeatable, and the peer ids in ``--trust-file``, re-read when it changes);
``--trust-any`` accepts every owner and is meant for local demos: it lets
anyone who can reach the node make it download and run their artifact.

Trust can grow while a node runs, so a refusal for want of trust is not
final: the book keeps the last :data:`MAX_HELD_UNTRUSTED` such specs (signed
and checked, so a stranger can only fill a bounded list) and offers them again
when the trusted set changes (:meth:`RunBook.retrust`). A run nobody trusted
when it was handed out is found through its owner's ``owner-runs`` record
(:mod:`pcp_p2p.diloco.protocol.owner_runs`) once the owner is trusted.
"""

from __future__ import annotations

import logging
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field

from pcp_p2p.core.errors import BadSignature, PcpError, RemoteError, VerificationError
from pcp_p2p.dht.records import KindRule
from pcp_p2p.diloco.protocol.spec import RunSpec, SignedRunSpec, run_id_of, verify_spec
from pcp_p2p.wire import Message, encode

log = logging.getLogger("pcp.runs")


def _owner_signs_its_run(name: str, signer: str, payload: Message) -> None:
    assert isinstance(payload, SignedRunSpec)
    if payload.owner != signer:
        raise BadSignature("a run record must be signed by the run's owner")
    if run_id_of(payload) != name:
        raise VerificationError("run record stored under another run id")
    verify_spec(payload)


RUN_KIND = "run"
RUN_RULE = KindRule(SignedRunSpec, _owner_signs_its_run)


MAX_HELD_UNTRUSTED = 64
"""Specs refused for want of trust that a node keeps, to take up if trust comes later."""


class UntrustedOwner(VerificationError):
    """A run whose owner this node does not trust."""

    refusal_reason = "not_trusted"


class NoAllowedTarget(RemoteError):
    """A run that allows no compile target this machine can run: the node cannot train for it.

    A refusal of the offered run (the peer's input), not a fault of this node:
    nothing here is broken, and the sender is told why (``no_target``).
    """

    refusal_reason = "no_target"


@dataclass
class TrustPolicy:
    """Whose runs this node trains for: ``--trust`` flags, plus the trust file's current list.

    ``owners`` is replaced (never edited in place) when the trust file changes,
    so a reader always sees one whole set.
    """

    owners: frozenset[str] = frozenset()
    any_owner: bool = False

    def trusts(self, owner: str) -> bool:
        return self.any_owner or owner in self.owners

    def check(self, owner: str) -> None:
        if not self.trusts(owner):
            raise UntrustedOwner(f"run owner {owner} is not trusted by this node (--trust / --trust-file)")


@dataclass
class KnownRun:
    run_id: str
    signed: SignedRunSpec

    @property
    def spec(self) -> RunSpec:
        return self.signed.spec

    @property
    def owner(self) -> str:
        return self.signed.owner


@dataclass
class RunBook:
    """The runs this node knows and accepts (sans-IO: callers feed it specs)."""

    trust: TrustPolicy
    fits: Callable[[RunSpec], None] | None = None  # raises (NoAllowedTarget) if this node cannot train for it
    runs: dict[str, KnownRun] = field(default_factory=dict)
    refused: dict[str, str] = field(default_factory=dict)  # run id -> why
    untrusted: OrderedDict[str, SignedRunSpec] = field(default_factory=OrderedDict)  # verified, owner not trusted

    def offer(self, signed: SignedRunSpec) -> KnownRun | None:
        """Check a signed spec; return it if it is new and acceptable, None if known.

        Raises a PcpError (bad signature, bad values, untrusted owner) otherwise.
        """
        run_id = run_id_of(signed)
        if run_id in self.runs:
            return None
        try:
            verify_spec(signed)
            self.trust.check(signed.owner)
            if self.fits is not None:
                self.fits(signed.spec)
        except UntrustedOwner as exc:
            self.refused[run_id] = str(exc)
            self.untrusted[run_id] = signed  # well signed: worth a second look if trust changes
            self.untrusted.move_to_end(run_id)
            while len(self.untrusted) > MAX_HELD_UNTRUSTED:
                dropped, _ = self.untrusted.popitem(last=False)
                self.refused.pop(dropped, None)  # findable again if advertised or listed by its owner
            raise
        except PcpError as exc:
            self.refused[run_id] = str(exc)
            raise
        self.refused.pop(run_id, None)
        self.untrusted.pop(run_id, None)
        run = KnownRun(run_id, signed)
        self.runs[run_id] = run
        log.info("run %s from owner %s accepted", run_id, signed.owner)
        return run

    def retrust(self, trust: TrustPolicy) -> list[KnownRun]:
        """Adopt a new trust policy; return the held runs it now accepts (to start as if announced)."""
        self.trust = trust
        accepted = []
        for run_id, signed in list(self.untrusted.items()):
            if trust.trusts(signed.owner):
                self.untrusted.pop(run_id)
                self.refused.pop(run_id, None)
                run = self.offer(signed)
                if run is not None:
                    accepted.append(run)
        return accepted

    def unknown(self, run_ids: tuple[str, ...] | list[str]) -> list[str]:
        """Run ids worth looking up: neither known nor already refused."""
        return [r for r in run_ids if r not in self.runs and r not in self.refused]


def spec_bytes(signed: SignedRunSpec) -> bytes:
    return encode(signed)
