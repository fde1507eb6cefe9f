"""A run's commits last: the DHT record is retried, and a commit is accepted only with its
checkpoint (or with its θ built here and checked, the rest of the checkpoint following)."""

from __future__ import annotations

import dataclasses
import threading
from collections.abc import Callable
from types import SimpleNamespace
from typing import Any

import pytest
import trio
import trio.testing

from pcp_p2p.core.errors import BadSignature, NotElected, PeerTimeout
from pcp_p2p.core.identity import Identity
from pcp_p2p.dht.lookup import REFRESHED_REPLICAS, K
from pcp_p2p.diloco.protocol.effects import Send
from pcp_p2p.diloco.protocol.election import Candidate, Election, ElectionConfig, FollowShepherd, Lease
from pcp_p2p.diloco.protocol.messages import CommitRecord, RoundAnnouncement, sign
from pcp_p2p.diloco.run.run_dht import COMMIT_PUT_ATTEMPTS, RunRecords
from pcp_p2p.diloco.run.run_effects import MessageIn, ReplicateCommit, Replicated
from pcp_p2p.diloco.run.runtime import COMMIT_BEHIND_S, RunRuntime

RUN = "bafkreihdwdcefgh4dqkjv67uzcmw7ojee6xedzdetojuzjevtenxquvyku"


class FlakyDht:
    """A node whose first ``fails`` DHT puts time out."""

    def __init__(self, fails: int) -> None:
        self.identity = Identity.generate()
        self.config = SimpleNamespace(op_timeout=10.0)
        self.fails, self.puts, self.logged, self.spread = fails, [], [], []

    async def put_record(self, signed, *, timeout=None, replicas=K, checkup=True) -> None:  # type: ignore[no-untyped-def]
        self.puts.append(trio.current_time())
        self.spread.append((replicas, checkup))
        if len(self.puts) <= self.fails:
            raise PeerTimeout("DHT put timed out")

    def log_once(self, who, exc, what) -> None:  # type: ignore[no-untyped-def]
        self.logged.append(what)


def records(node: FlakyDht) -> RunRecords:
    return RunRecords(node, RUN)  # type: ignore[arg-type]


def commit(node: FlakyDht) -> CommitRecord:
    return sign(CommitRecord(run_id=RUN, term=0, round=7, attempt=0, prev_theta_cid="p", theta_cid="t",
                             checkpoint_cid="c", participants=(), tokens=1, mean_loss=1.0, val_loss=None,
                             shepherd=node.identity.peer_id), node.identity)


async def test_a_commit_put_that_times_out_is_retried(autojump_clock: trio.testing.MockClock) -> None:
    node = FlakyDht(fails=2)
    await records(node).publish_commit(commit(node))
    assert len(node.puts) == 3 and not node.logged  # stored on the third try
    assert [round(b - a) for a, b in zip(node.puts, node.puts[1:])] == [2, 4]  # backing off


async def test_a_rounds_commit_goes_to_a_few_peers_and_the_runs_last_to_k_with_a_walk() -> None:
    """The next round's commit replaces this one: 4 copies, no walk (k copies and a walk each
    round cost the shepherd O(N) a round, issue #15). Nothing replaces the last one, which a node
    that was down looks up for good: k copies and the check-up walk."""
    node = FlakyDht(fails=0)
    await records(node).publish_commit(commit(node))
    await records(node).publish_commit(commit(node), final=True)
    assert node.spread == [(REFRESHED_REPLICAS, False), (K, True)]


async def test_a_commit_put_that_keeps_failing_gives_up_and_says_so(autojump_clock: trio.testing.MockClock) -> None:
    node = FlakyDht(fails=100)
    await records(node).publish_commit(commit(node))
    assert len(node.puts) == COMMIT_PUT_ATTEMPTS and node.logged == ["storing the commit record failed"]


class _Store:
    def __init__(self, held: set[str]) -> None:
        self.held = held

    def has(self, cid: str) -> bool:
        return cid in self.held


class _Io:
    """A run's blob side as the commit path sees it (``RunBlobs.holds``/``stored``): blobs in the
    store, and stores in flight (``storing``: CID -> the event set when its write has ended)."""

    def __init__(self, held: set[str]) -> None:
        self.store, self.storing = _Store(held), dict[str, trio.Event]()

    def holds(self, cid: str) -> bool:
        return cid in self.storing or self.store.has(cid)

    async def stored(self, cid: str) -> bool:
        if (busy := self.storing.get(cid)) is not None:
            await busy.wait()
        return self.store.has(cid)


def following(shepherd: FlakyDht) -> Election:
    """A worker's election that accepted ``shepherd``'s lease of term 0."""
    e = Election(RUN, Identity.generate(), ElectionConfig(lease_s=10.0, renew_every_s=3.0, min_uptime_s=5.0))
    e.start(1000.0)
    e.on_members([Candidate(shepherd.identity.peer_id, 100.0)], 1000.0)
    lease = sign(Lease(run_id=RUN, term=0, holder=shepherd.identity.peer_id, claimed_at=1000.0, issued=1000.0,
                       expiry=1010.0, from_round=0, from_theta_cid="", from_checkpoint_cid=""), shepherd.identity)
    assert of_type(e.on_lease(lease, 1000.5), FollowShepherd)
    return e


def of_type(effects: list, kind: type) -> list:
    return [x for x in effects if isinstance(x, kind)]


def delivering_runtime(election: Election | None, held: set[str]) -> tuple[RunRuntime, trio.MemoryReceiveChannel]:
    rt = RunRuntime.__new__(RunRuntime)
    send, inbox = trio.open_memory_channel[tuple](10)
    rt.run_id, rt.io, rt._send = RUN, _Io(held), send  # type: ignore[assignment]
    rt.started = election is not None
    rt.machine = SimpleNamespace(vouch_commit=election.check_commit if election else None)  # type: ignore[assignment]
    rt._machine_lock, rt._machine_thread, rt._beats_in = threading.Lock(), trio.CapacityLimiter(1), []
    rt._nursery, rt._late, rt._taking, rt._arriving = None, set(), {}, {}
    return rt, inbox


async def test_a_commit_without_an_accepted_lease_fetches_nothing_and_is_not_acked() -> None:
    """A stranger's well-signed commit (the "fill disks" attack) names a checkpoint: nothing
    is fetched or pinned, no ack goes back, and the election only holds the record."""
    stranger, shepherd = FlakyDht(fails=0), FlakyDht(fails=0)
    fetched: list[str] = []

    async def fetch(rec: CommitRecord, hint: str | None = None, update: bytes = b"", **_: object) -> None:
        fetched.append(rec.checkpoint_cid)

    # no lease known yet: the election keeps it until one arrives (nothing fetched, no ack)
    rt, inbox = delivering_runtime(None, set())
    rt._hold_checkpoint = fetch  # type: ignore[method-assign]
    with pytest.raises(NotElected):
        await rt.deliver(stranger.identity.peer_id, commit(stranger))
    assert fetched == [] and isinstance(inbox.receive_nowait(), MessageIn)
    # following the shepherd's term: a stranger's commit for it can never hold, refused outright
    rt, inbox = delivering_runtime(following(shepherd), set())
    rt._hold_checkpoint = fetch  # type: ignore[method-assign]
    with pytest.raises(BadSignature):
        await rt.deliver(stranger.identity.peer_id, commit(stranger))
    assert fetched == []
    with pytest.raises(trio.WouldBlock):
        inbox.receive_nowait()


async def test_a_commit_whose_checkpoint_cannot_be_fetched_is_neither_acked_nor_accepted() -> None:
    from pcp_p2p.core.errors import PeerError

    shepherd = FlakyDht(fails=0)
    rec = commit(shepherd)
    held: set[str] = set()
    rt, inbox = delivering_runtime(following(shepherd), held)

    async def shepherd_gone(rec: CommitRecord, hint: str | None = None, update: bytes = b"", **_: object) -> None:
        return None  # the fetch failed

    rt._hold_checkpoint = shepherd_gone  # type: ignore[method-assign]
    with pytest.raises(PeerError):  # the messenger then refuses it: no ack
        await rt.deliver(shepherd.identity.peer_id, rec)
    with pytest.raises(trio.WouldBlock):
        inbox.receive_nowait()  # and the run never sees it

    async def fetched(rec: CommitRecord, hint: str | None = None, update: bytes = b"", **_: object) -> None:
        held.add(rec.checkpoint_cid)

    rt._hold_checkpoint = fetched  # type: ignore[method-assign]
    await rt.deliver(shepherd.identity.peer_id, rec)  # sent again once it can be held: accepted
    assert inbox.receive_nowait() == MessageIn(shepherd.identity.peer_id, rec)


@pytest.mark.parametrize("written", [True, False])
async def test_a_built_checkpoint_reaches_the_machine_before_it_is_written_and_the_ack_after(
        autojump_clock: trio.testing.MockClock, written: bool) -> None:
    """A checkpoint built here is held in memory while it is written: the machine gets the commit,
    and the announcement behind it goes on, at once; the ack (``deliver`` returning) waits for the
    write, and a write that failed is not acknowledged (the machine keeps the commit: its θ was
    checked against the commit's CIDs, and the shepherd and the others hold the checkpoint)."""
    from pcp_p2p.core.errors import BlobError

    shepherd = FlakyDht(fails=0)
    prev, rec = dataclasses.replace(commit(shepherd), round=6, theta_cid="p"), commit(shepherd)
    held: set[str] = set()
    rt, inbox = delivering_runtime(following(shepherd), held)
    rt.machine.worker = SimpleNamespace(last_commit=prev)  # type: ignore[attr-defined]
    writing, building = trio.Event(), trio.Event()

    async def built(rec: CommitRecord, hint: str | None = None, update: bytes = b"", **_: object) -> None:
        rt.io.storing[rec.checkpoint_cid] = writing  # type: ignore[attr-defined]
        building.set()

    rt._hold_checkpoint = built  # type: ignore[method-assign]
    ann = RoundAnnouncement(run_id=RUN, term=0, round=8, attempt=0, theta_cid=rec.theta_cid, artifacts={},
                            time_budget_s=1.0, deadline=0.0, assignments=(), shepherd=shepherd.identity.peer_id)
    acked: list[bool] = []

    async def take_commit() -> None:
        try:
            await rt.deliver(shepherd.identity.peer_id, rec)
            acked.append(True)
        except BlobError:
            acked.append(False)

    async with trio.open_nursery() as n:
        n.start_soon(take_commit)
        await building.wait()
        await trio.testing.wait_all_tasks_blocked()
        assert inbox.receive_nowait().message == rec  # in the machine while the write goes on
        await rt.deliver(shepherd.identity.peer_id, ann)  # not held behind the write
        assert inbox.receive_nowait().message == ann
        await trio.testing.wait_all_tasks_blocked()
        assert acked == []  # no ack before the write ends
        if written:
            held.add(rec.checkpoint_cid)
        del rt.io.storing[rec.checkpoint_cid]  # type: ignore[attr-defined]
        writing.set()
    assert acked == [written]


async def test_a_commit_whose_theta_was_built_goes_to_the_machine_before_its_checkpoint_is_done() -> None:
    """Built from the update, a commit reaches the machine once its θ is checked, before the
    momentum and the checkpoint's CID (the next round trains from θ alone); if the rest then
    fails and the checkpoint cannot be fetched either, the commit is not acknowledged, and it
    reaches the machine once only (the late fetch that goes on does not post it again)."""
    from pcp_p2p.core.errors import PeerError

    shepherd = FlakyDht(fails=0)
    rec = commit(shepherd)
    for whole in (True, False):
        held: set[str] = set()
        rt, inbox = delivering_runtime(following(shepherd), held)
        seen: list[object] = []

        async def build(rec: CommitRecord, hint: str | None = None, update: bytes = b"",
                        theta_ready: Callable[[], None] | None = None, whole: bool = whole,
                        held: set[str] = held, seen: list[object] = seen, inbox: Any = inbox) -> None:
            if theta_ready is None:  # (the late fetch, still nowhere to be had)
                return
            theta_ready()
            seen.append(inbox.receive_nowait().message)  # in the machine before the rest is done
            if whole:
                held.add(rec.checkpoint_cid)

        rt._hold_checkpoint = build  # type: ignore[method-assign]
        async with trio.open_nursery() as nursery:
            rt._nursery = nursery
            if whole:
                await rt.deliver(shepherd.identity.peer_id, rec)  # acked
            else:
                with pytest.raises(PeerError, match="not acknowledged"):
                    await rt.deliver(shepherd.identity.peer_id, rec)
        assert seen == [rec]
        with pytest.raises(trio.WouldBlock):
            inbox.receive_nowait()  # once only


async def test_a_commit_whose_checkpoint_came_too_slowly_is_accepted_once_held(
    autojump_clock: trio.testing.MockClock,
) -> None:
    """Not acknowledged (the shepherd's wait is over), but the fetch goes on and the commit is taken
    once its checkpoint is here: a slow fetch no longer costs this node the commit for good. A
    shepherd that died meanwhile leaves nothing to take, so nothing is accepted."""
    from pcp_p2p.core.errors import PeerError
    from pcp_p2p.diloco.run.run_machine import REPLICATE_TIMEOUT_S

    shepherd = FlakyDht(fails=0)
    rec = commit(shepherd)
    for alive in (True, False):
        held: set[str] = set()
        rt, inbox = delivering_runtime(following(shepherd), held)

        async def slow(rec: CommitRecord, hint: str | None = None, update: bytes = b"",
                       alive: bool = alive, held: set[str] = held, **_: object) -> None:
            await trio.sleep(REPLICATE_TIMEOUT_S + 3)  # (a swarm ancestor that timed out first)
            if alive:
                held.add(rec.checkpoint_cid)

        rt._hold_checkpoint = slow  # type: ignore[method-assign]
        async with trio.open_nursery() as nursery:
            rt._nursery = nursery
            with pytest.raises(PeerError, match="within 5 s; not acknowledged"):
                await rt.deliver(shepherd.identity.peer_id, rec)
            with pytest.raises(trio.WouldBlock):
                inbox.receive_nowait()
            if alive:
                assert await inbox.receive() == MessageIn(shepherd.identity.peer_id, rec)
        assert not rt._late
        with pytest.raises(trio.WouldBlock):
            inbox.receive_nowait()


async def test_a_batchs_messages_reach_each_peer_in_the_machines_order(autojump_clock: trio.testing.MockClock) -> None:
    """A round's commit and the next announcement leave in one batch: each peer gets them in that
    order, each after the previous one's ack (an announcement that overtook its commit made the
    worker fetch θ on a relay tree of its own, one more θ through the shepherd's uplink), while
    a slow peer holds up no other peer's messages."""
    shepherd = FlakyDht(fails=0)
    first, second = commit(shepherd), dataclasses.replace(commit(shepherd), round=8)
    arrived: list[tuple[str, int, float]] = []

    async def send_to(peer: str, msg: CommitRecord) -> bool:
        await trio.sleep(5.0 if (peer, msg.round) == ("slow", 7) else 0.1)  # the slow peer's first ack
        arrived.append((peer, msg.round, trio.current_time()))
        return True

    rt, _ = delivering_runtime(None, set())
    rt.node = SimpleNamespace(peer_id="me")  # type: ignore[assignment]
    rt.send_to = send_to  # type: ignore[method-assign,assignment]
    t0 = trio.current_time()
    async with trio.open_nursery() as n:
        rt._nursery = n
        rt._carry_out([Send("slow", first), Send("fast", first), Send("slow", second), Send("fast", second)])
    order = {peer: [r for p, r, _ in arrived if p == peer] for peer in ("slow", "fast")}
    assert order == {"slow": [7, 8], "fast": [7, 8]}
    assert max(t for p, _, t in arrived if p == "fast") - t0 < 1.0  # not behind the slow peer's ack


async def test_a_commit_goes_to_every_node_at_once_and_each_gets_one_copy(
        autojump_clock: trio.testing.MockClock) -> None:
    """The replication asks every node the commit is for at once (each acks once it holds the
    checkpoint), answers the machine at the first ack, and lets the other sends go on; the batch
    the machine then lets out names the commit again for each node that has not acked, and
    joins the send in flight instead of sending a second copy, so each node's next message
    still waits for its own ack. Asking two nodes first and the rest after one ack put two
    checkpoint fetches in a row on every round's path (docs/connectivity.md, run 7)."""
    shepherd = FlakyDht(fails=0)
    rec, after = commit(shepherd), dataclasses.replace(commit(shepherd), round=8)
    ack_after = {"a": 1.0, "b": 3.0, "c": 4.0}  # how long each node takes to hold the checkpoint
    sent: list[tuple[str, int, float]] = []  # (peer, round, when it left)
    acked: list[tuple[str, int, float]] = []

    async def send(peer: str, msg: CommitRecord) -> None:
        sent.append((peer, msg.round, trio.current_time()))
        await trio.sleep(ack_after[peer] if msg.round == 7 else 0.1)
        acked.append((peer, msg.round, trio.current_time()))

    async def nothing() -> None:
        return None

    rt, inbox = delivering_runtime(None, set())
    rt.node = SimpleNamespace(peer_id="me", messenger=SimpleNamespace(send=send))  # type: ignore[assignment]
    rt.io = SimpleNamespace(stores_done=nothing)  # type: ignore[assignment]
    rt._commits_out = {}
    t0 = trio.current_time()
    async with trio.open_nursery() as n:
        rt._nursery = n
        n.start_soon(rt._replicate_commit, ReplicateCommit(rec, ("a", "b", "c"), 5.0))
        answer = await inbox.receive()
        assert isinstance(answer, Replicated) and answer.acked == ["a"]
        assert trio.current_time() - t0 == pytest.approx(1.0)  # the first ack, not the slowest
        # what the machine lets out then: the commit to those that have not acked, each node's next message
        rt._carry_out([Send("a", after), Send("b", rec), Send("b", after), Send("c", rec), Send("c", after)])
    assert sorted((p, r) for p, r, _ in sent) == [("a", 7), ("a", 8), ("b", 7), ("b", 8), ("c", 7), ("c", 8)]
    assert all(t == t0 for p, r, t in sent if r == 7)  # side by side, from the start
    acks = {(p, r): t for p, r, t in acked}
    for peer in ack_after:  # each node's next message left after its own ack of the commit
        left = next(t for p, r, t in sent if (p, r) == (peer, 8))
        assert left >= acks[(peer, 7)]
    assert max(acks.values()) - t0 == pytest.approx(4.1)  # the slowest node's fetch, not two in a row
    assert rt._commits_out == {}


async def test_each_nodes_next_announcement_leaves_right_behind_its_commit(
        autojump_clock: trio.testing.MockClock) -> None:
    """``ReplicateCommit.then``: a node's next announcement leaves right behind its commit, not
    after the first ack (the receiver holds it until it took the commit), and a node whose commit
    send fails gets it too; the machine still hears of the first ack only."""
    shepherd = FlakyDht(fails=0)
    rec, nxt = commit(shepherd), dataclasses.replace(commit(shepherd), round=8)
    ack_after = {"a": 1.0, "b": 3.0, "c": 4.0}
    sent: list[tuple[str, int, float]] = []

    async def send_to(peer: str, msg: CommitRecord) -> bool:
        sent.append((peer, msg.round, trio.current_time()))
        await trio.sleep(ack_after[peer] if msg.round == 7 else 0.1)
        return peer != "c" or msg.round != 7  # c's commit send fails

    rt, inbox = delivering_runtime(None, set())
    rt.send_to = send_to  # type: ignore[method-assign,assignment]
    t0 = trio.current_time()
    async with trio.open_nursery() as n:
        rt._nursery = n
        n.start_soon(rt._replicate_commit, ReplicateCommit(rec, ("a", "b", "c"), 5.0,
                                                           then=(("a", nxt), ("b", nxt), ("c", nxt))))
        answer = await inbox.receive()
        assert isinstance(answer, Replicated) and answer.acked == ["a"]
    assert sorted((p, t - t0) for p, r, t in sent) == [(p, 0.0) for p in ("a", "a", "b", "b", "c", "c")]


@pytest.mark.parametrize("commit_first", [True, False])
async def test_an_announcement_reaches_the_machine_after_the_commit_it_starts_from(
        autojump_clock: trio.testing.MockClock, commit_first: bool) -> None:
    """The receiver's side: an announcement that starts from the θ of a commit this node is
    taking (building or fetching its checkpoint) waits for it, so the machine sees the commit
    first; one that came before its commit (they travel on streams of their own) waits for the
    commit to arrive, up to ``COMMIT_BEHIND_S``; one from any other θ does not wait."""
    shepherd = FlakyDht(fails=0)
    prev, rec = dataclasses.replace(commit(shepherd), round=6, theta_cid="p"), commit(shepherd)
    rt, inbox = delivering_runtime(None, set())
    rt.machine.worker = SimpleNamespace(last_commit=prev)  # type: ignore[attr-defined]

    async def take(sender: str, msg: CommitRecord, update: bytes = b"", taken: object = None) -> None:
        await trio.sleep(2.0)  # the checkpoint being built
        rt.post(MessageIn(sender, msg))

    rt._take_commit = take  # type: ignore[method-assign]
    ann = RoundAnnouncement(run_id=RUN, term=0, round=8, attempt=0, theta_cid=rec.theta_cid, artifacts={},
                            time_budget_s=1.0, deadline=0.0, assignments=(), shepherd=shepherd.identity.peer_id)
    other = dataclasses.replace(ann, theta_cid="another", round=9)
    t0 = trio.current_time()
    async with trio.open_nursery() as n:
        first, second = (rec, ann) if commit_first else (ann, rec)
        n.start_soon(rt.deliver, shepherd.identity.peer_id, first)
        await trio.sleep(0.3)
        n.start_soon(rt.deliver, shepherd.identity.peer_id, second)
        await rt.deliver(shepherd.identity.peer_id, other)
        assert trio.current_time() - t0 == pytest.approx(0.3)  # not held: another θ and round
    got = [inbox.receive_nowait().message for _ in range(3)]
    assert got == [other, rec, ann]
    assert rt._taking == {} and rt._arriving == {}


@pytest.mark.parametrize("first", [False, True])
async def test_an_announcement_whose_commit_never_comes_waits_no_longer_than_commit_behind_s(
        autojump_clock: trio.testing.MockClock, first: bool) -> None:
    """(``first``: round 1's announcement, before this node has any commit.)"""
    shepherd = FlakyDht(fails=0)
    rt, inbox = delivering_runtime(None, set())
    rt.machine.worker = SimpleNamespace(  # type: ignore[attr-defined]
        last_commit=None if first else dataclasses.replace(commit(shepherd), round=6, theta_cid="p"))
    ann = RoundAnnouncement(run_id=RUN, term=0, round=1 if first else 8, attempt=0, theta_cid="t", artifacts={},
                            time_budget_s=1.0, deadline=0.0, assignments=(), shepherd=shepherd.identity.peer_id)
    t0 = trio.current_time()
    await rt.deliver(shepherd.identity.peer_id, ann)
    assert trio.current_time() - t0 == pytest.approx(COMMIT_BEHIND_S)
    assert inbox.receive_nowait().message == ann and rt._arriving == {}


@pytest.mark.parametrize("intact", [True, False])
async def test_an_update_sent_with_its_commit_is_used_only_as_the_vouched_commits(intact: bool) -> None:
    """``CommitWithUpdate``: the update goes to the checkpoint's build only once the commit passed
    the authority chain and only if its CID is the one the commit signed; otherwise it is
    dropped (logged) and the update is fetched as usual. From a stranger, nothing is taken."""
    from pcp_p2p.core.cid import cid_of
    from pcp_p2p.diloco.protocol.messages import CommitWithUpdate

    shepherd, stranger = FlakyDht(fails=0), FlakyDht(fails=0)
    update = b"the applied outer step"
    rec = sign(dataclasses.replace(commit(shepherd), signature=b"", update_cid=cid_of(update)), shepherd.identity)
    held: set[str] = set()
    got: list[bytes] = []

    async def hold(rec: CommitRecord, hint: str | None = None, update: bytes = b"", **_: object) -> None:
        got.append(update)
        held.add(rec.checkpoint_cid)

    rt, inbox = delivering_runtime(following(shepherd), held)
    rt._hold_checkpoint = hold  # type: ignore[method-assign]
    rt.node = shepherd  # type: ignore[assignment]  (log_once)
    sent = update if intact else b"tampered"
    await rt.deliver(shepherd.identity.peer_id, CommitWithUpdate(rec, sent))
    assert got == ([update] if intact else [b""])
    assert inbox.receive_nowait() == MessageIn(shepherd.identity.peer_id, rec)
    assert shepherd.logged == ([] if intact else ["taking a commit's update"])
    with pytest.raises(BadSignature):  # a stranger's: refused before anything is held
        await rt.deliver(stranger.identity.peer_id, CommitWithUpdate(commit(stranger), update))
    assert len(got) == 1


async def test_the_update_rides_with_the_commit_only_to_peers_reached_directly(
        autojump_clock: trio.testing.MockClock) -> None:
    """Relays carry control traffic only: a peer this node cannot dial (a relay-only home) gets
    the bare commit and fetches the update over a connection it opens itself."""
    from pcp_p2p.diloco.protocol.messages import CommitWithUpdate

    shepherd = FlakyDht(fails=0)
    rec = commit(shepherd)
    sent: dict[str, type] = {}

    async def send_to(peer: str, msg: CommitRecord) -> bool:
        sent[peer] = type(msg)
        return True

    rt, inbox = delivering_runtime(None, set())
    rt.send_to = send_to  # type: ignore[method-assign,assignment]
    rt.io = SimpleNamespace(direct_to=lambda peer: peer != "behind-a-relay")  # type: ignore[assignment]
    async with trio.open_nursery() as n:
        rt._nursery = n
        n.start_soon(rt._replicate_commit, ReplicateCommit(rec, ("home", "behind-a-relay"), 5.0, update=b"mean"))
        await inbox.receive()
    assert sent == {"home": CommitWithUpdate, "behind-a-relay": CommitRecord}
