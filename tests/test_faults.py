"""The error boundary (pcp_p2p/core/faults.py): a bug in a handler is our fault, never the peer's.

Over real py-libp2p on 127.0.0.1 where the handlers live (direct messages,
status, the DHT validator, the blob server): a handler that raises a plain bug
answers the sender with the neutral ``internal_error``, logs one traceback,
counts a local fault, leaves the sender's rejected counts alone, and serves
the next message. A RemoteError still counts as the peer's; cancellation is
never swallowed. And every error class sits under exactly one branch.
"""

from __future__ import annotations

import importlib
import logging
import pkgutil
import struct
import threading
from pathlib import Path

import pytest
import trio

import pcp_p2p
from pcp_p2p.core.errors import (
    BadSignature,
    ConfigError,
    LocalError,
    MalformedMessage,
    PcpError,
    PeerError,
    PeerGone,
    PeerTimeout,
    Refused,
    RemoteError,
)
from pcp_p2p.core.faults import (
    INTERNAL_ERROR,
    LOCAL,
    PEER,
    REMOTE,
    InternalFault,
    LocalFaults,
    blame_of,
    refusal_reason,
)
from pcp_p2p.wire import encode

pytestmark = pytest.mark.timeout(120)

BRANCHES = (RemoteError, PeerError, LocalError)
# Exceptions that are signals inside one module, never errors a boundary sees:
# cluster.comm.Cancelled is an MPI wait's cancel (like trio.Cancelled); the
# private ones (_Failure, _Refused) carry a typed PcpError across a process
# or a guest call and are unwrapped where they are caught.
NOT_ERRORS = {"pcp_p2p.cluster.comm.Cancelled"}


def _all_exception_classes() -> list[type[BaseException]]:
    for mod in pkgutil.walk_packages(pcp_p2p.__path__, "pcp_p2p."):
        importlib.import_module(mod.name)
    found: dict[str, type[BaseException]] = {}
    stack: list[type[BaseException]] = [Exception]
    while stack:
        cls = stack.pop()
        for sub in cls.__subclasses__():
            stack.append(sub)
            if sub.__module__.startswith("pcp_p2p."):
                found[f"{sub.__module__}.{sub.__qualname__}"] = sub
    return list(found.values())


def test_every_error_class_sits_under_exactly_one_branch() -> None:
    classes = _all_exception_classes()
    errors = [c for c in classes if issubclass(c, PcpError) and c not in (PcpError, *BRANCHES)]
    assert len(errors) > 40  # the walk saw the package, not an empty import
    misplaced = {c.__qualname__: [b.__name__ for b in BRANCHES if issubclass(c, b)] for c in errors}
    assert {name: under for name, under in misplaced.items() if len(under) != 1} == {}
    outside = {f"{c.__module__}.{c.__qualname__}" for c in classes if not issubclass(c, PcpError)}
    assert {n for n in outside if n not in NOT_ERRORS and not n.rsplit(".", 1)[-1].startswith("_")} == set()


def test_blame_follows_the_tree_and_a_bug_is_ours() -> None:
    assert blame_of(MalformedMessage("x")) == REMOTE
    assert blame_of(PeerTimeout("x")) == PEER and blame_of(trio.BrokenResourceError()) == PEER
    assert blame_of(ZeroDivisionError()) == LOCAL and blame_of(ConfigError("x")) == LOCAL
    # a group is as bad as its worst member: one bug among peers' faults is still a bug
    assert blame_of(ExceptionGroup("g", [BadSignature("x"), PeerGone("y")])) == REMOTE
    assert blame_of(ExceptionGroup("g", [BadSignature("x"), AssertionError()])) == LOCAL
    assert refusal_reason(ZeroDivisionError()) == INTERNAL_ERROR
    assert refusal_reason(ConfigError("x")) == INTERNAL_ERROR  # our misconfiguration says nothing of the peer
    assert refusal_reason(PeerGone("x")) == "unavailable"


def test_a_local_fault_is_logged_once_per_bug_with_its_traceback(caplog: pytest.LogCaptureFixture) -> None:
    faults = LocalFaults()

    def bug() -> None:
        raise ZeroDivisionError("boom")

    caplog.set_level(logging.DEBUG, logger="pcp.faults")
    for _ in range(3):
        try:
            bug()
        except ZeroDivisionError as exc:
            faults.record(exc, "message", "peerX")
    faults.record(InternalFault("already counted where it was raised"), "message")
    errors = [r for r in caplog.records if r.levelno >= logging.ERROR]
    assert len(errors) == 1 and errors[0].exc_info is not None
    assert "boom" in errors[0].getMessage()
    assert faults.counts == {"message:ZeroDivisionError": 3} and faults.total == 3


def _errors(caplog: pytest.LogCaptureFixture) -> list[logging.LogRecord]:
    return [r for r in caplog.records if r.name == "pcp.faults" and r.levelno >= logging.ERROR]


async def test_a_bug_in_a_message_handler_is_a_local_fault_not_the_senders(swarm3, caplog) -> None:
    from pcp_p2p.node.status import StatusRequest

    _boot, a, b = swarm3
    got: list[StatusRequest] = []
    raising: list[BaseException] = []

    async def handler(sender: str, msg: object) -> None:
        if raising:
            raise raising[0]
        assert isinstance(msg, StatusRequest)
        got.append(msg)

    b.messenger.register((StatusRequest,), handler)
    rejected = dict(b.rejected)
    caplog.set_level(logging.INFO)
    for bug in (ZeroDivisionError("1/0 in a handler"), ZeroDivisionError("again")):
        raising[:] = [bug]
        with pytest.raises(Refused) as caught:
            await a.messenger.send(b.peer_id, StatusRequest())
        assert caught.value.reason == INTERNAL_ERROR and "1/0" not in caught.value.detail  # neutral, no leak
    assert b.boundary.faults.counts["message:ZeroDivisionError"] == 2
    assert len(_errors(caplog)) == 1 and _errors(caplog)[0].exc_info is not None  # one traceback, not two
    assert dict(b.rejected) == rejected  # the sender is not blamed
    # A LocalError met while handling (our misconfiguration) is ours too.
    raising[:] = [ConfigError("no such directory")]
    with pytest.raises(Refused) as caught:
        await a.messenger.send(b.peer_id, StatusRequest())
    assert caught.value.reason == INTERNAL_ERROR and b.boundary.faults.counts["message:ConfigError"] == 1
    # The peer's fault still is the peer's: its own code, counted as rejected.
    raising[:] = [BadSignature("signed by someone else")]
    with pytest.raises(Refused) as caught:
        await a.messenger.send(b.peer_id, StatusRequest())
    assert caught.value.reason == "refused" and b.rejected["message:BadSignature"] == 1
    # The world breaking blames nobody: "unavailable", dropped, not rejected.
    raising[:] = [PeerGone("the checkpoint's holder left")]
    with pytest.raises(Refused) as caught:
        await a.messenger.send(b.peer_id, StatusRequest())
    assert caught.value.reason == "unavailable" and b.boundary.dropped["message:PeerGone"] == 1
    assert b.boundary.faults.total == 3 and "message:PeerGone" not in b.rejected
    # And the node serves the next message, and says what happened in its status.
    raising.clear()
    await a.messenger.send(b.peer_id, StatusRequest(members=False))
    assert got == [StatusRequest(members=False)]
    network = b.status(members=False).network
    assert network["local_faults"] == 3 and network["local_fault_kinds"]["message:ZeroDivisionError"] == 2


class _FakeStream:
    """Just enough of an INetStream for :meth:`Messenger.handle`: one frame in, writes recorded."""

    class _Conn:
        class _Peer:
            def to_base58(self) -> str:
                return "12D3KooWfake"

        peer_id = _Peer()

    muxed_conn = _Conn()

    def __init__(self, data: bytes) -> None:
        self._data = bytearray(data)
        self.written: list[bytes] = []
        self.reset_called = False

    async def read(self, n: int | None = None) -> bytes:
        out = bytes(self._data[: n or len(self._data)])
        del self._data[: len(out)]
        return out

    async def write(self, data: bytes) -> None:
        self.written.append(data)

    async def close(self) -> None:
        pass

    async def reset(self) -> None:
        self.reset_called = True


async def test_cancellation_passes_through_the_message_boundary(swarm3) -> None:
    from pcp_p2p.node.status import StatusRequest

    _boot, _a, b = swarm3
    entered = trio.Event()

    async def handler(sender: str, msg: object) -> None:
        entered.set()
        await trio.sleep_forever()

    b.messenger.register((StatusRequest,), handler)
    frame = encode(StatusRequest())
    stream = _FakeStream(struct.pack(">I", len(frame)) + frame)
    before = (dict(b.rejected), dict(b.boundary.dropped), b.boundary.faults.total)
    async with trio.open_nursery() as nursery:
        nursery.start_soon(b.messenger.handle, stream)
        await entered.wait()
        nursery.cancel_scope.cancel()  # the node stopping, say
    # Cancelled went through: nothing counted, nothing answered, nothing reset.
    assert (dict(b.rejected), dict(b.boundary.dropped), b.boundary.faults.total) == before
    assert stream.written == [] and not stream.reset_called


async def test_a_bug_in_the_status_endpoint_or_a_dht_check_is_a_local_fault(swarm3, caplog) -> None:
    from pcp_p2p.node.status import fetch_status

    _boot, a, b = swarm3
    rejected = dict(b.rejected)
    caplog.set_level(logging.INFO)
    # status(): a section that raises
    b.config.extra_status["broken"] = lambda: 1 / 0
    with pytest.raises(PcpError):
        await fetch_status(b.addrs()[0])
    assert b.boundary.faults.counts["status:ZeroDivisionError"] == 1
    del b.config.extra_status["broken"]
    assert (await fetch_status(b.addrs()[0])).peer_id == b.peer_id
    # the DHT validator: an authority check with a bug refuses the record (never stores it unchecked)
    def buggy(rec: object, now: float) -> None:
        raise AssertionError("an authority with a bug")

    b.record_validator.authorities.append(buggy)
    from pcp_p2p.core.identity import Identity
    from pcp_p2p.dht.records import sign_record
    from pcp_p2p.net.membership import MemberRecord

    # a well-signed record under a key nobody else publishes (a's own member record is re-put in the background)
    other = Identity.generate()
    record = MemberRecord(other.peer_id, ("/ip4/127.0.0.1/tcp/9",), "worker", 0.0, a.capabilities)
    signed = sign_record(other, "member", other.peer_id, record, ttl_s=60)
    key = signed.key.encode()
    await a.put_record(signed)
    await a.dht.wait_idle()  # every store a's put started has its answer: b's handler ran
    assert b.boundary.faults.counts["dht:AssertionError"] >= 1
    assert b.dht.value_store.get(key) is None
    assert [r.exc_info is not None for r in _errors(caplog)] == [True, True]  # status's, then the DHT's
    assert dict(b.rejected) == rejected
    b.record_validator.authorities.remove(buggy)
    await a.put_record(signed)
    await a.dht.wait_idle()
    stored = b.dht.value_store.get(key)
    assert stored is not None and stored.value == encode(signed)


async def test_a_bug_serving_a_blob_answers_internal_error_and_the_next_fetch_works(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    import os

    from test_blob_service import BlobService, info, network

    class Buggy(BlobService):
        bugs = 1

        def _inline(self, cid: str) -> bytes | None:
            if self.bugs:
                self.bugs -= 1
                raise ZeroDivisionError("a bug serving a manifest")
            return super()._inline(cid)

    caplog.set_level(logging.INFO)
    data = os.urandom(1000)
    async with network(tmp_path) as net:
        server = await net.node(Buggy)
        client = await net.node()
        cid = await server.publish(data)
        with trio.fail_after(20), pytest.raises(PeerError, match="internal error"):
            await client.fetch(cid, providers=[info(server)], pin=False)
        assert server.boundary.faults.counts == {"blob:ZeroDivisionError": 1}
        assert len(_errors(caplog)) == 1 and _errors(caplog)[0].exc_info is not None
        with trio.fail_after(20):
            await client.fetch(cid, providers=[info(server)], pin=False)
        assert client.store.read(cid) == data


async def test_a_bug_in_a_run_stops_that_run_and_a_bug_in_one_input_drops_only_that_input(caplog) -> None:
    """The run's two boundaries, with stand-ins for the node (the real pump is covered by the run tests):
    TrainingService._run keeps a run's failure, a bug or a task's PcpError wrapped in its nursery's
    group, from reaching the node's nursery; RunRuntime._dispatch drops one input whose handling hit a bug."""
    from types import SimpleNamespace

    from pcp_p2p.core.faults import Boundary
    from pcp_p2p.core.logs import LogOnce
    from pcp_p2p.diloco.run.run_effects import MessageIn
    from pcp_p2p.diloco.run.runtime import RunRuntime
    from pcp_p2p.diloco.run.training_service import TrainingService
    from pcp_p2p.node.status import StatusRequest

    boundary = Boundary(LogOnce(logging.getLogger("test")))
    node = SimpleNamespace(runs=set(), leads=set(), boundary=boundary,
                           _reject=lambda peer, exc, what: boundary.judge(peer, exc, what))
    service = SimpleNamespace(node=node, _refresh_state=lambda: None)

    async def bug() -> None:
        raise ZeroDivisionError("a bug in the run")

    async def child_fails() -> None:  # a task of the run's nursery: trio hands its error over in a group
        async def fail() -> None:
            raise ConfigError("the executor's directory is gone")

        async with trio.open_nursery() as nursery:
            nursery.start_soon(fail)

    caplog.set_level(logging.INFO)
    for run_forever in (bug, child_fails):
        runtime = SimpleNamespace(run_id=run_forever.__name__, finished=trio.Event(), phase="training",
                                  run_forever=run_forever)
        node.runs.add(runtime.run_id)
        await TrainingService._run(service, runtime)  # type: ignore[arg-type]
        assert runtime.run_id not in node.runs
        if run_forever is bug:
            assert runtime.phase.startswith("stopped: internal error")
        else:
            assert runtime.phase == "stopped: the executor's directory is gone"
    assert boundary.faults.counts == {"run:ZeroDivisionError": 1} and len(_errors(caplog)) == 1

    handled: list[object] = []

    def handle(ev: object, now: float) -> list[object]:
        if isinstance(ev, MessageIn) and ev.sender == "12D3KooWbuggy":
            raise AssertionError("a bug handling this input")
        handled.append(ev)
        return []

    rt = SimpleNamespace(machine=SimpleNamespace(handle=handle), clock=lambda: 0.0, node=node, run_id="run",
                         _carry_out=lambda effects: None, _beats_in=[], _machine_lock=threading.Lock(),
                         _machine_thread=trio.CapacityLimiter(1))
    rt._feed = lambda step, what: RunRuntime._feed(rt, step, what)  # type: ignore[arg-type]  # the real step
    await RunRuntime._dispatch(rt, MessageIn("12D3KooWbuggy", StatusRequest()))  # type: ignore[arg-type]
    await RunRuntime._dispatch(rt, MessageIn("12D3KooWfine", StatusRequest()))  # type: ignore[arg-type]
    assert [e.sender for e in handled] == ["12D3KooWfine"]  # type: ignore[attr-defined]
    assert boundary.faults.counts["round:AssertionError"] == 1 and not boundary.rejected


def test_an_error_wrapped_in_a_one_member_group_is_judged_as_itself() -> None:
    """trio hands a child task's error over in a group: its count, its log and the peer's answer
    name the error inside, and an InternalFault inside is not counted a second time."""
    from pcp_p2p.core.faults import Boundary
    from pcp_p2p.core.logs import LogOnce

    boundary = Boundary(LogOnce(logging.getLogger("test")))
    assert boundary.judge("12D3KooWpeer", ExceptionGroup("task", [BadSignature("forged")]), "message") == REMOTE
    assert boundary.rejected == {"message:BadSignature": 1}
    assert refusal_reason(ExceptionGroup("task", [PeerGone("left")])) == "unavailable"
    boundary.judge("12D3KooWpeer", ExceptionGroup("task", [InternalFault("counted where raised")]), "dht")
    assert boundary.faults.total == 0


async def test_a_bug_under_a_dht_operation_is_a_local_fault_not_a_vanished_peer() -> None:
    """``Node.put_record`` / ``get_record`` once turned every failure into ``PeerGone``: our own bug
    in the DHT code then looked like the network's fault and was never counted."""
    from types import SimpleNamespace

    from pcp_p2p.core.faults import Boundary
    from pcp_p2p.core.logs import LogOnce
    from pcp_p2p.node.node import Node

    async def buggy(key: str) -> None:
        raise ZeroDivisionError("a bug in the DHT code")

    async def broken(key: str) -> None:
        raise ConnectionResetError("the peer went away")

    node = Node.__new__(Node)
    node.boundary = Boundary(LogOnce(logging.getLogger("test")))
    node.config = SimpleNamespace(op_timeout=5.0)  # type: ignore[assignment]
    node.dht = SimpleNamespace(get_value=buggy)  # type: ignore[assignment]
    with pytest.raises(InternalFault):
        await node.get_record("member", "x")
    assert node.boundary.faults.counts == {"dht:ZeroDivisionError": 1}
    node.dht = SimpleNamespace(get_value=broken)  # type: ignore[assignment]
    with pytest.raises(PeerGone):
        await node.get_record("member", "x")
    assert node.boundary.faults.total == 1


async def test_a_bug_opening_a_message_or_kad_stream_is_a_local_fault_not_a_vanished_peer() -> None:
    """``Messenger.send`` and ``dht.rpc.kad_request`` once turned every failure to open a stream
    into ``PeerGone``: a bug of ours there looked like the network's fault and was never counted.
    By the boundary's rule (``Boundary.failure``) only the transport's failures are ``PeerGone``."""
    from types import SimpleNamespace

    from libp2p.kad_dht.pb.kademlia_pb2 import Message as KadMessage
    from libp2p.peer.id import ID

    from pcp_p2p.core.faults import Boundary
    from pcp_p2p.core.identity import Identity
    from pcp_p2p.core.logs import LogOnce
    from pcp_p2p.dht import rpc
    from pcp_p2p.diloco.protocol.messages import Join
    from pcp_p2p.node.messaging import Messenger

    peer = Identity.generate().peer_id
    failure: list[Exception] = []

    async def new_stream(*args: object) -> None:
        raise failure[-1]

    def no_protocols(_peer: object) -> None:
        raise KeyError("no protocols known")  # (rpc.speaks_kad: then the stream is negotiated)

    host = SimpleNamespace(new_stream=new_stream,
                           get_network=lambda: SimpleNamespace(connections={ID.from_base58(peer): object()}),
                           get_peerstore=lambda: SimpleNamespace(get_protocols=no_protocols))
    boundary = Boundary(LogOnce(logging.getLogger("test")))
    messenger = Messenger.__new__(Messenger)
    messenger.node = SimpleNamespace(config=SimpleNamespace(op_timeout=5.0), host=host,  # type: ignore[assignment]
                                     boundary=boundary)
    join = Join(run_id="run", worker=peer, target="cpu", tokens_per_s=1.0)
    request = KadMessage(type=KadMessage.MessageType.GET_VALUE, key=b"/pcp/member/x")
    for n, (send, where) in enumerate([(lambda: messenger.send(peer, join), "message"),
                                       (lambda: rpc.kad_request(host, ID.from_base58(peer), request,  # type: ignore[arg-type]
                                                                boundary=boundary), "dht")], start=1):
        failure.append(ZeroDivisionError("a bug opening the stream"))
        with pytest.raises(InternalFault):
            await send()
        assert boundary.faults.counts[f"{where}:ZeroDivisionError"] == 1 and boundary.faults.total == n
        failure.append(trio.BrokenResourceError("the connection went away"))
        with pytest.raises(PeerGone):
            await send()
        assert boundary.faults.total == n  # the world broke: nobody's bug
