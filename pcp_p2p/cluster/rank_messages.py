"""What the ranks of a worker group say to each other over MPI.

Typed wire messages like everything else PCP sends (:mod:`pcp_p2p.wire`):
ranks are the operator's own processes, but a rank's bytes still pass the
codec's type and size checks, so a confused or half-dead rank produces a typed
error on rank 0, never a crash. Bulk data (θ, the artifact, the dataset) rides
beside the header as raw parts of one MPI message (:func:`frame`).
"""

from __future__ import annotations

import struct

from pcp_p2p.core.errors import MalformedMessage
from pcp_p2p.diloco.protocol.messages import DataAssignment
from pcp_p2p.wire import Message, decode, encode, wire_message

MAX_PARTS = 4
MAX_FRAME_BYTES = 4 << 30  # a medium model's θ is 172 MB; an artifact tens of MB


@wire_message("group.hello", max_size=4 * 1024)
class Hello(Message):
    """A rank reports for duty: where it runs and how fast it is."""

    rank: int
    host: str
    pid: int
    target: str  # its best CPU target
    gflops: float


@wire_message("group.setup", max_size=64 * 1024)
class Setup(Message):
    """Start an executor for a run's artifact (parts: the vmfb, the encoded dataset)."""

    run_id: str
    signed_spec: bytes  # the run's SignedRunSpec, encoded
    manifest: bytes  # the signed train manifest, encoded
    shepherd: str  # who must have signed the manifest


@wire_message("group.ready", max_size=4 * 1024)
class Ready(Message):
    run_id: str
    error: str = ""


@wire_message("group.train", max_size=16 * 1024)
class Train(Message):
    """Train a sub-shard from θ (part 0: θ, packed tensors)."""

    epoch: int
    run_id: str
    round: int
    attempt: int
    assignment: DataAssignment
    time_budget_s: float
    inner_state: str  # this rank's own state digest to start from ("" = fresh)


@wire_message("group.done", max_size=1 << 20)
class Done(Message):
    """A rank's round: its steps, losses and state digests (Δ follows in the allreduce)."""

    epoch: int
    rank: int
    steps: int
    losses: tuple[float, ...]
    state_in: str
    state_out: str
    error: str = ""


@wire_message("group.reduce", max_size=4 * 1024)
class Reduce(Message):
    """Join the allreduce of ``epoch`` among ``members`` (ranks of COMM_WORLD)."""

    epoch: int
    members: tuple[int, ...]


@wire_message("group.export", max_size=4 * 1024)
class Export(Message):
    """Send this rank's kept inner state ``digest`` (an auditor replays the group's round from it)."""

    epoch: int
    run_id: str
    digest: str


@wire_message("group.state", max_size=4 * 1024)
class StateBlob(Message):
    """The answer to :class:`Export` (part 0: the state blob, unless ``error``)."""

    epoch: int
    digest: str
    error: str = ""


@wire_message("group.ping", max_size=256)
class Ping(Message):
    """Rank 0 is alive (a rank that hears nothing for its watchdog's time leaves)."""

    seq: int


@wire_message("group.stop", max_size=1024)
class Stop(Message):
    reason: str


ORDERS = (Setup, Train, Reduce, Export, Ping, Stop)
REPLIES = (Hello, Ready, Done, StateBlob)


def frame(msg: Message, *parts: bytes) -> bytes:
    """One MPI message: the encoded header and raw parts, each length-prefixed."""
    head = encode(msg)
    out = [struct.pack(">IB", len(head), len(parts)), head]
    for p in parts:
        out += [struct.pack(">Q", len(p)), p]
    return b"".join(out)


def unframe(data: bytes | bytearray, *expected: type[Message]) -> tuple[Message, list[memoryview]]:
    """Header and parts of a :func:`frame`; :class:`MalformedMessage` for anything else."""
    view = memoryview(data)
    try:
        hlen, n = struct.unpack_from(">IB", view, 0)
        if n > MAX_PARTS:
            raise MalformedMessage(f"a group frame with {n} parts")
        pos = 5 + hlen
        msg = decode(bytes(view[5:pos]), *expected)
        parts = []
        for _ in range(n):
            (plen,) = struct.unpack_from(">Q", view, pos)
            pos += 8
            if pos + plen > len(view):
                raise MalformedMessage("a group frame part runs past its end")
            parts.append(view[pos : pos + plen])
            pos += plen
    except struct.error as exc:
        raise MalformedMessage(f"a truncated group frame: {exc}") from None
    if pos != len(view):
        raise MalformedMessage("trailing bytes after a group frame")
    return msg, parts
