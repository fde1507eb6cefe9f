"""The executor's child process: IREE runtime and numpy, nothing else.

Started by :class:`pcp_p2p.executor.executor.Executor` as
``python <this file>`` (by path, so that no package ``__init__`` runs and the
child imports exactly what this file imports: numpy, msgpack and
``iree.runtime`` — never JAX or the compiler). It speaks a small
request/response protocol on stdin/stdout: each message is an 8-byte
big-endian length and a msgpack map. The child's own fd 1 is pointed at
stderr before anything else runs, so native code that prints cannot corrupt
the protocol stream.

State lives here, in IREE device arrays, between calls: parameters and
optimiser state are uploaded once (``set``), each ``call`` feeds the
program's outputs straight back in as the next call's inputs, and only
what the parent asks for (``fetch``) is copied to the host. Host copies are
real copies: ``DeviceArray.to_host()`` on local-task is a view into a pool
that later calls overwrite.

Requests (``op`` and its fields) and what a success returns:

``init {driver}``                     -> {}  create the device (IncompatibleArtifact if none)
``load {name, vmfb}``                 -> {}  load a module; its ``main`` becomes program ``name``
``set {arrays}``                      -> {}  upload named arrays into device state
``call {program, inputs, outputs, feeds, keep, fetch}`` -> {arrays}
                                        run ``program`` on ``inputs`` (each a feed or a state
                                        name); outputs named in ``keep`` replace state,
                                        those in ``fetch`` come back
``get {names, tag?}``                 -> {arrays}  (from snapshot ``tag`` if given)
``digest {names, tag?}``              -> {digest}  :func:`state_digest` of those arrays, ``step`` last
``snapshot {tag, names}``             -> {}  remember the current arrays ``names`` under ``tag``
``restore {tag}``                     -> {}  put a snapshot's arrays back into state
``drop {tag}``                        -> {}  forget a snapshot
``modules``                           -> {modules: [...]}  (for the no-JAX test)
``pid``                               -> {pid}
``exit``                              -> {} and the child exits

A failure answers ``{ok: False, kind, msg}`` with ``kind`` one of
``InvalidInput``, ``IncompatibleArtifact``, ``ExecutorError``.
"""

from __future__ import annotations

import hashlib
import os
import signal
import struct
import sys
from collections.abc import Iterable
from typing import IO, Any, TypedDict

import msgpack
import numpy as np

_LEN = struct.Struct(">Q")
Reply = dict[str, Any]
"""A success answer: a msgpack map whose fields depend on the op (see the table above)."""
MAX_FRAME = 4 << 30  # 4 GiB: far above a medium model's full state (~130 MB)


# --- framing and arrays, shared with the parent --------------------------------


def write_frame(f: IO[bytes], obj: Any) -> None:
    data = msgpack.packb(obj, use_bin_type=True)
    f.write(_LEN.pack(len(data)))
    f.write(data)
    f.flush()


def read_frame(f: IO[bytes]) -> Any:
    """One message, or None at EOF (the other side is gone)."""
    head = _read_exact(f, _LEN.size)
    if head is None:
        return None
    (n,) = _LEN.unpack(head)
    if n > MAX_FRAME:
        raise ValueError(f"frame of {n} bytes")
    body = _read_exact(f, n)
    if body is None:
        return None
    return msgpack.unpackb(body, raw=False)


def _read_exact(f: IO[bytes], n: int) -> bytes | None:
    buf = bytearray()
    while len(buf) < n:
        chunk = f.read(n - len(buf))
        if not chunk:
            return None
        buf += chunk
    return bytes(buf)


class PackedArray(TypedDict):
    """An array as it crosses the pipe: dtype string, shape, C-order bytes."""

    dtype: str
    shape: list[int]
    data: bytes


def pack_array(a: np.ndarray) -> PackedArray:
    # tobytes() is C order whatever the layout (np.ascontiguousarray would turn 0-d into 1-d)
    return {"dtype": a.dtype.str, "shape": list(a.shape), "data": a.tobytes()}


def unpack_array(d: PackedArray) -> np.ndarray:
    # frombuffer over the received bytes is read-only; copy so callers own the array
    return np.frombuffer(d["data"], dtype=np.dtype(d["dtype"])).reshape(tuple(d["shape"])).copy()


STATE_DIGEST_TAG = b"pcp-inner-state/1\0"


def state_digest(step: int, arrays: Iterable[tuple[str, np.ndarray]]) -> str:
    """The hex sha256 that names an inner optimiser state (a worker commits to it).

    Defined over the values, not over any file format, so the executor child
    (which holds the arrays on its device) and a node that decoded a state blob
    compute it with this one function. It covers the step, and each array's
    name, dtype, shape and little-endian bytes, in the order given.
    """
    h = hashlib.sha256(STATE_DIGEST_TAG)
    h.update(struct.pack(">q", int(step)))
    for name, a in arrays:
        a = np.asarray(a)
        a = np.ascontiguousarray(a, dtype=a.dtype.newbyteorder("<"))
        head = f"{name}|{a.dtype.str}|{','.join(map(str, a.shape))}".encode()
        h.update(struct.pack(">I", len(head)))
        h.update(head)
        h.update(a.tobytes())
    return h.hexdigest()


# --- the child -------------------------------------------------------------------


class _Failure(Exception):
    def __init__(self, kind: str, msg: str) -> None:
        super().__init__(msg)
        self.kind = kind


class _Child:
    def __init__(self) -> None:
        self.rt: Any = None
        self.ctx: Any = None
        self.device: Any = None
        self.programs: dict[str, Any] = {}
        self.state: dict[str, Any] = {}
        # Device arrays are immutable (no program aliases its inputs), so a
        # snapshot is only references: free until the state moves on.
        self.snapshots: dict[str, dict[str, Any]] = {}

    def op_init(self, driver: str) -> Reply:
        import iree.runtime as rt

        self.rt = rt
        if driver not in rt.query_available_drivers():
            raise _Failure("IncompatibleArtifact", f"IREE runtime has no {driver!r} driver here")
        try:
            config = rt.Config(driver)
        except Exception as exc:  # no device for this driver
            raise _Failure("IncompatibleArtifact", f"no {driver} device: {exc}") from exc
        self.ctx = rt.SystemContext(config=config)
        self.device = config.device
        return {}

    def op_load(self, name: str, vmfb: bytes) -> Reply:
        if self.ctx is None:
            raise _Failure("ExecutorError", "load before init")
        if name in self.programs:
            raise _Failure("ExecutorError", f"program {name!r} already loaded")
        try:
            module = self.rt.VmModule.copy_buffer(self.ctx.instance, vmfb)
            self.ctx.add_vm_module(module)
            self.programs[name] = self.ctx.modules[module.name]["main"]
        except Exception as exc:
            kind = "IncompatibleArtifact" if "INCOMPATIBLE" in str(exc).upper() else "ExecutorError"
            raise _Failure(kind, f"cannot load {name}: {exc}") from exc
        return {}

    def _upload(self, d: PackedArray) -> Any:
        return self.rt.asdevicearray(self.device, unpack_array(d))

    def op_set(self, arrays: dict[str, PackedArray]) -> Reply:
        uploaded = {k: self._upload(v) for k, v in arrays.items()}
        self.state.update(uploaded)
        return {}

    def op_call(self, program: str, inputs: list[str], outputs: list[str], feeds: dict[str, PackedArray],
                keep: list[str], fetch: list[str]) -> Reply:
        fn = self.programs.get(program)
        if fn is None:
            raise _Failure("ExecutorError", f"program {program!r} not loaded")
        fed = {k: self._upload(v) for k, v in feeds.items()}
        args = []
        for name in inputs:
            if name in fed:
                args.append(fed[name])
            elif name in self.state:
                args.append(self.state[name])
            else:
                raise _Failure("InvalidInput", f"{program}: no value for input {name!r}")
        try:
            result = fn(*args)
        except Exception as exc:
            raise _Failure("ExecutorError", f"{program} failed: {exc}") from exc
        if not isinstance(result, tuple):
            result = (result,)
        if len(result) != len(outputs):
            raise _Failure("ExecutorError", f"{program} returned {len(result)} results, "
                           f"signature has {len(outputs)}")
        by_name = dict(zip(outputs, result))
        out = {name: pack_array(_host_copy(by_name[name])) for name in fetch}
        for name in keep:
            self.state[name] = by_name[name]
        return {"arrays": out}

    def _arrays(self, names: list[str], tag: str | None) -> dict[str, Any]:
        if tag is None:
            source = self.state
        elif tag in self.snapshots:
            source = self.snapshots[tag]
        else:
            raise _Failure("ExecutorError", f"no snapshot {tag!r:.80}")
        missing = [n for n in names if n not in source]
        if missing:
            raise _Failure("ExecutorError", f"no state for {missing[:5]}")
        return {n: source[n] for n in names}

    def op_get(self, names: list[str], tag: str | None = None) -> Reply:
        got = self._arrays(names, tag)
        return {"arrays": {n: pack_array(_host_copy(a)) for n, a in got.items()}}

    def op_digest(self, names: list[str], tag: str | None = None) -> Reply:
        """:func:`state_digest` of ``names`` (the last one is the int step), hashed here:
        only 64 hex characters cross the pipe, not the moments."""
        got = self._arrays(names, tag)
        *arrays, step = names
        return {"digest": state_digest(int(got[step].to_host()), ((n, got[n].to_host()) for n in arrays))}

    def op_snapshot(self, tag: str, names: list[str]) -> Reply:
        self.snapshots[tag] = self._arrays(names, None)
        return {}

    def op_restore(self, tag: str) -> Reply:
        if tag not in self.snapshots:
            raise _Failure("ExecutorError", f"no snapshot {tag!r:.80}")
        self.state.update(self.snapshots[tag])
        return {}

    def op_drop(self, tag: str) -> Reply:
        self.snapshots.pop(tag, None)
        return {}

    def op_modules(self) -> Reply:
        return {"modules": sorted(sys.modules)}

    def op_pid(self) -> Reply:
        return {"pid": os.getpid()}


def _host_copy(x: Any) -> np.ndarray:
    """A host copy that stays valid after later calls (``to_host`` alone is a reused view)."""
    return np.array(x.to_host(), copy=True)


def main() -> int:
    # MPICH's process manager tells the ranks of a worker group that one of them died with
    # SIGUSR1 to their whole process group (pcp_p2p.cluster); the rank handles it, its
    # executor must not die of it. (The child still ends when its parent's pipe closes.)
    signal.signal(signal.SIGUSR1, signal.SIG_IGN)
    # Keep the protocol on a private fd; whatever prints to fd 1 goes to stderr.
    proto_out = os.fdopen(os.dup(1), "wb")
    os.dup2(2, 1)
    sys.stdout = sys.stderr
    inp = os.fdopen(0, "rb", buffering=1 << 16)
    child = _Child()
    while True:
        req = read_frame(inp)
        if req is None:
            return 0
        op = req.pop("op", None)
        if op == "exit":
            write_frame(proto_out, {"ok": True})
            return 0
        handler = getattr(child, f"op_{op}", None)
        try:
            if handler is None:
                raise _Failure("ExecutorError", f"unknown op {op!r}")
            reply = handler(**req)
            reply["ok"] = True
        except _Failure as exc:
            reply = {"ok": False, "kind": exc.kind, "msg": str(exc)}
        except Exception as exc:  # a bug here must not look like a crash of native code
            reply = {"ok": False, "kind": "ExecutorError", "msg": f"{type(exc).__name__}: {exc}"}
        write_frame(proto_out, reply)


if __name__ == "__main__":
    sys.exit(main())
