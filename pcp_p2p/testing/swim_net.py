"""An in-memory network of real SWIM machines, in virtual time, with a seeded fault plan.

:class:`SwimNet` runs N :class:`~pcp_p2p.net.membership.Membership` machines
(the same class the node pumps over libp2p) with signed member records, and
carries their :class:`~pcp_p2p.net.membership.Send` effects between them the
way the node's pump does: a request, the receiver's ``respond`` (a ``ping_req``
relays a ping first), and the reply fed to ``receive``. Exchanges complete
within the step they start in; what the plan drops (``loss`` per packet, a
killed node, a partition) is silence, which the machine's own timers turn into
suspicion, exactly as a lost packet over libp2p does.

It is how the unit tests exercise detection, refutation, restarts and
partitions on virtual time, and how ``bench/membership_sim.py`` runs 10,000
nodes on one core. Nothing in it decides membership: it only moves packets.
"""

from __future__ import annotations

import random
from collections import Counter
from dataclasses import dataclass, field
from functools import lru_cache

from pcp_p2p.core.identity import Identity
from pcp_p2p.dht.records import VerifiedRecord, sign_record
from pcp_p2p.net.capabilities import Capabilities
from pcp_p2p.net.membership import (
    Gossip,
    MemberJoined,
    MemberLeft,
    MemberRecord,
    Membership,
    MembershipEvent,
    Refute,
    Send,
    SwimConfig,
    SwimPacket,
    boot_ms,
    verify_member_record,
)
from pcp_p2p.wire import encode

CAPS = Capabilities(("local-task",), "cpu", "x86_64", (), 2, 1 << 30, (), 10.0, {}, False)


@lru_cache(maxsize=1 << 17)
def cached_verify(data: bytes) -> VerifiedRecord:
    """verify_member_record once per distinct record (a record's bytes fully determine the result)."""
    return verify_member_record(data)


@dataclass
class SimNode:
    identity: Identity
    machine: Membership
    started_at: float
    seq: int = 0
    alive: bool = True
    left: list[MemberLeft] = field(default_factory=list)
    joined: list[MemberJoined] = field(default_factory=list)

    @property
    def peer_id(self) -> str:
        return self.identity.peer_id


class SwimNet:
    """N SWIM machines on an in-memory network; ``step`` advances virtual time."""

    def __init__(
        self,
        n: int,
        *,
        seed: int = 0,
        config: SwimConfig | None = None,
        loss: float = 0.0,
        identities: list[Identity] | None = None,
        cached: bool = False,
    ) -> None:
        self.rng = random.Random(seed)
        self.config = config or SwimConfig()
        self.loss = loss
        self.now = 0.0
        self.cached = cached
        self.nodes: dict[str, SimNode] = {}
        self.packets = 0
        self.dropped = 0
        self.sent_by: Counter[str] = Counter()
        self._cut: set[frozenset[str]] = set()  # pairs that cannot reach each other
        self._groups: dict[str, int] | None = None
        # Identities from the seed too: a run is then the same run every time (peer ids order
        # the views and the probes, so random keys made outcomes vary between runs).
        for ident in identities or [Identity(self.rng.randbytes(32)) for _ in range(n)]:
            self.add(ident)

    # -- the fault plan -------------------------------------------------------------

    def add(self, ident: Identity, *, started_at: float | None = None) -> SimNode:
        machine = Membership(
            ident.peer_id, config=self.config, rng=random.Random(self.rng.random()),
            verify=cached_verify if self.cached else verify_member_record,
        )
        node = SimNode(ident, machine, started_at if started_at is not None else 1_000_000.0 + self.now)
        self.nodes[ident.peer_id] = node
        self._resign(node)
        return node

    def kill(self, peer_id: str) -> None:
        self.nodes[peer_id].alive = False

    def restart(self, peer_id: str) -> SimNode:
        """The same identity back with a later boot (a restarted process): a fresh machine."""
        old = self.nodes[peer_id]
        return self.add(old.identity, started_at=old.started_at + self.now + 1.0)

    def partition(self, *groups: set[str]) -> None:
        self._groups = {p: i for i, g in enumerate(groups) for p in g}

    def heal(self) -> None:
        self._groups = None

    # -- seeding views ----------------------------------------------------------------

    def join_all(self, via: str | None = None) -> None:
        """Every node syncs with ``via`` (a first node, like a bootstrap server) as the node's pump does."""
        ids = list(self.nodes)
        via = via or ids[0]
        for p in ids:
            if p != via:
                self.nodes[p].machine.add_seed(via, ())
                packet = self.nodes[p].machine.join(self.now)
                self._exchange(p, Send(via, (), packet, self.config.probe_timeout_s))

    def seed_views(self, k: int) -> None:
        """Give every node ``k`` random members (a large swarm that has been running a while)."""
        ids = list(self.nodes)
        for p in ids:
            node = self.nodes[p]
            for q in self.rng.sample(ids, min(k + 1, len(ids))):
                if q != p:
                    other = self.nodes[q]
                    me = other.machine.get(q)
                    assert me is not None
                    g = Gossip("alive", q, boot_ms(me.record), me.signed.seq, me.signed_bytes)
                    node.machine.receive(q, SwimPacket("sync", updates=(g,)), self.now)
            node.machine.take_errors()
        for node in self.nodes.values():  # steady state: nothing left to spread
            node.machine.settle()

    # -- time ------------------------------------------------------------------------------

    def step(self, dt: float = 0.1) -> None:
        self.step_to(self.now + dt)

    def step_to(self, now: float) -> None:
        """Advance to ``now`` (virtual seconds, or trio's MockClock via :func:`run_on_trio`)."""
        self.now = now
        for p, node in list(self.nodes.items()):
            if not node.alive:
                continue
            effects, events = node.machine.tick(self.now)
            self._record(node, events)
            for effect in effects:
                if isinstance(effect, Refute):
                    self._resign(node)
                elif isinstance(effect, Send):
                    self._exchange(p, effect)

    def run(self, seconds: float, dt: float = 0.1) -> None:
        end = self.now + seconds
        while self.now < end - 1e-9:
            self.step(dt)


    # -- views ---------------------------------------------------------------------------

    def view(self, peer_id: str) -> set[str]:
        return {m.record.peer_id for m in self.nodes[peer_id].machine.live()}

    def live_ids(self) -> set[str]:
        return {p for p, n in self.nodes.items() if n.alive}

    # -- internals -----------------------------------------------------------------------

    def _resign(self, node: SimNode) -> None:
        node.seq += 1
        rec = MemberRecord(node.peer_id, (f"/sim/{node.peer_id[-8:]}",), "worker", node.started_at, CAPS)
        signed = sign_record(node.identity, "member", node.peer_id, rec, ttl_s=3600, seq=node.seq)
        node.machine.set_self(encode(signed), now=self.now)

    def _reachable(self, a: str, b: str) -> bool:
        target = self.nodes.get(b)
        if target is None or not target.alive or not self.nodes[a].alive:
            return False
        return self._groups is None or self._groups.get(a) == self._groups.get(b)

    def _deliver(self) -> bool:
        self.packets += 1
        if self.loss and self.rng.random() < self.loss:
            self.dropped += 1
            return False
        return True

    def _exchange(self, sender: str, send: Send) -> bool:
        """One request/reply as the node's pump does it; False where the plan made it silence."""
        self.sent_by[sender] += 1
        if not self._reachable(sender, send.peer) or not self._deliver():
            return False
        receiver = self.nodes[send.peer]
        reply, relay, events = receiver.machine.respond(sender, send.packet, self.now)
        self._record(receiver, events)
        if relay is not None:
            acked = self._exchange(send.peer, relay)
            reply = receiver.machine.relay_result(sender, send.packet, acked)
        receiver.machine.take_errors()
        self.sent_by[send.peer] += 1
        if reply is None or not self._reachable(send.peer, sender) or not self._deliver():
            return False
        node = self.nodes[sender]
        self._record(node, node.machine.receive(send.peer, reply, self.now))
        node.machine.take_errors()
        return reply.kind != "nack"

    @staticmethod
    def _record(node: SimNode, events: list[MembershipEvent]) -> None:
        for ev in events:
            if isinstance(ev, MemberLeft):
                node.left.append(ev)
            elif isinstance(ev, MemberJoined):
                node.joined.append(ev)


async def run_on_trio(net: SwimNet, seconds: float, dt: float = 0.1) -> None:
    """Step ``net`` on trio's clock (``MockClock`` in tests) for ``seconds``."""
    import trio

    end = trio.current_time() + seconds
    while trio.current_time() < end:
        await trio.sleep(dt)
        net.step_to(trio.current_time())
