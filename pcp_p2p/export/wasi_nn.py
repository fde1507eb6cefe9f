"""wasi-nn for the ``wasmtime`` Python engine, backed by ONNX Runtime.

The wasmtime wheel has WASI but not wasi-nn, so this module supplies the
``wasi_ephemeral_nn`` imports (the witx ABI wasmtime's own CLI implements for
core modules): ``load``, ``init_execution_context``, ``set_input``,
``compute`` and ``get_output``. Each returns an ``nn_errno`` as wasmtime's
does, and a refusal also keeps a typed error (:attr:`WasiNnHost.error`) so the
caller can say in one line *why* a guest that then exits non-zero failed.

Memory layout of the ABI (all little-endian, wasm32):

- ``graph_builder``: ``{ptr u32, len u32}``; ``load`` takes an array of them.
- ``tensor``: ``{dims_ptr u32, dims_len u32, type u8 (+3 pad), data_ptr u32, data_len u32}``,
  20 bytes; ``type`` is 0 f16, 1 f32, 2 f64, 3 u8, 4 i32, 5 i64.
- encodings: 1 is ONNX (the only one served here); targets: all run on the CPU.

Every pointer and length a guest passes is checked against its memory, and
graphs and contexts are bounded, so a guest cannot make the host read or
write outside it or keep sessions without limit.
"""

from __future__ import annotations

import math
import struct
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from pcp_p2p.core.errors import CorruptModel, GuestError, NoSuchTensor, PcpError

MODULE = "wasi_ephemeral_nn"
ENCODING_ONNX = 1
MAX_GRAPHS = 4
MAX_CONTEXTS = 16

# nn_errno
SUCCESS, INVALID_ARGUMENT, INVALID_ENCODING, MISSING_MEMORY = 0, 1, 2, 3
BUSY, RUNTIME_ERROR, UNSUPPORTED_OPERATION, TOO_LARGE, NOT_FOUND = 4, 5, 6, 7, 8

_TENSOR_TYPES: dict[int, np.dtype] = {
    0: np.dtype("<f2"), 1: np.dtype("<f4"), 2: np.dtype("<f8"),
    3: np.dtype("u1"), 4: np.dtype("<i4"), 5: np.dtype("<i8"),
}
_ORT_TYPES = {
    "tensor(float16)": np.dtype("<f2"), "tensor(float)": np.dtype("<f4"), "tensor(double)": np.dtype("<f8"),
    "tensor(uint8)": np.dtype("u1"), "tensor(int32)": np.dtype("<i4"), "tensor(int64)": np.dtype("<i8"),
}


class _Refused(Exception):
    """Internal: a call refused with ``errno``; ``error`` is what the host keeps."""

    def __init__(self, errno: int, error: PcpError) -> None:
        super().__init__(str(error))
        self.errno, self.error = errno, error


@dataclass
class _Context:
    session: Any
    feeds: dict[str, np.ndarray] = field(default_factory=dict)
    results: list[np.ndarray] | None = None


class WasiNnHost:
    """The state behind one guest instance's wasi-nn imports."""

    def __init__(self) -> None:
        self.graphs: list[Any] = []
        self.contexts: list[_Context] = []
        self.error: PcpError | None = None  # the first refusal, kept for the caller
        self.calls = 0

    def add_to_linker(self, linker: Any) -> None:
        """Define the five ``wasi_ephemeral_nn`` functions on a ``wasmtime.Linker``."""
        import wasmtime

        i32 = wasmtime.ValType.i32()
        for name, nparams in (("load", 5), ("init_execution_context", 2), ("set_input", 3),
                              ("compute", 1), ("get_output", 5)):
            impl = getattr(self, "_" + name)
            linker.define_func(MODULE, name, wasmtime.FuncType([i32] * nparams, [i32]),
                               self._wrap(name, impl), access_caller=True)

    def _wrap(self, name: str, impl: Any) -> Any:
        def call(caller: Any, *args: int) -> int:
            self.calls += 1
            try:
                impl(_Memory(caller), *(a & 0xFFFFFFFF for a in args))
                return SUCCESS
            except _Refused as refused:
                if self.error is None:
                    self.error = refused.error
                return refused.errno

        call.__name__ = name
        return call

    # --- the five calls ------------------------------------------------------

    def _load(self, mem: _Memory, builders: int, count: int, encoding: int, target: int, graph_out: int) -> None:
        import onnxruntime as ort

        if encoding != ENCODING_ONNX:
            raise _Refused(INVALID_ENCODING, GuestError(f"wasi-nn load: graph encoding {encoding} is not ONNX "
                                                        f"({ENCODING_ONNX}), the only one this host serves"))
        if count != 1:
            raise _Refused(INVALID_ARGUMENT, GuestError(f"wasi-nn load: an ONNX graph is one builder, got {count}"))
        if len(self.graphs) >= MAX_GRAPHS:
            raise _Refused(TOO_LARGE, GuestError(f"wasi-nn load: a guest may load at most {MAX_GRAPHS} graphs"))
        ptr, size = struct.unpack("<II", mem.read(builders, 8))
        model = mem.read(ptr, size)
        options = ort.SessionOptions()
        options.log_severity_level = 4  # errors come back to us as exceptions; no stderr noise
        try:
            session = ort.InferenceSession(model, options, providers=["CPUExecutionProvider"])
        except Exception as exc:
            first = (str(exc).strip().splitlines() or [type(exc).__name__])[0]
            raise _Refused(RUNTIME_ERROR, CorruptModel(
                f"the guest's model ({size} bytes) is not a valid ONNX model: {first[:300]}")) from exc
        self.graphs.append(session)
        mem.write_u32(graph_out, len(self.graphs) - 1)

    def _init_execution_context(self, mem: _Memory, graph: int, ctx_out: int) -> None:
        if graph >= len(self.graphs):
            raise _Refused(INVALID_ARGUMENT, GuestError(f"wasi-nn: no graph {graph} was loaded"))
        if len(self.contexts) >= MAX_CONTEXTS:
            raise _Refused(TOO_LARGE, GuestError(f"wasi-nn: a guest may open at most {MAX_CONTEXTS} contexts"))
        self.contexts.append(_Context(self.graphs[graph]))
        mem.write_u32(ctx_out, len(self.contexts) - 1)

    def _set_input(self, mem: _Memory, ctx: int, index: int, tensor_ptr: int) -> None:
        context = self._context(ctx)
        inputs = context.session.get_inputs()
        if index >= len(inputs):
            raise _Refused(NOT_FOUND, NoSuchTensor(
                f"the guest set input tensor #{index}, but the model has {len(inputs)} input(s): "
                f"{', '.join(i.name for i in inputs)}"))
        spec = inputs[index]
        dims_ptr, ndims, ttype, data_ptr, data_len = struct.unpack("<IIB3xII", mem.read(tensor_ptr, 20))
        if ttype not in _TENSOR_TYPES or ndims > 8:
            raise _Refused(INVALID_ARGUMENT, GuestError(f"wasi-nn set_input: bad tensor type {ttype} or rank {ndims}"))
        dims = struct.unpack(f"<{ndims}I", mem.read(dims_ptr, 4 * ndims))
        dtype = _TENSOR_TYPES[ttype]
        want_shape = tuple(spec.shape)
        if len(dims) != len(want_shape) or any(isinstance(w, int) and w != d for w, d in zip(want_shape, dims)):
            raise _Refused(INVALID_ARGUMENT, GuestError(
                f"wasi-nn set_input: input {spec.name} has shape {list(want_shape)}, the guest gave {list(dims)}"))
        if _ORT_TYPES.get(spec.type) != dtype:
            raise _Refused(INVALID_ARGUMENT, GuestError(
                f"wasi-nn set_input: input {spec.name} is {spec.type}, the guest gave {dtype.name}"))
        if data_len != math.prod(dims) * dtype.itemsize:
            raise _Refused(INVALID_ARGUMENT, GuestError(
                f"wasi-nn set_input: {data_len} bytes of data for a {list(dims)} {dtype.name} tensor"))
        context.feeds[spec.name] = np.frombuffer(mem.read(data_ptr, data_len), dtype=dtype).reshape(dims)
        context.results = None

    def _compute(self, mem: _Memory, ctx: int) -> None:
        context = self._context(ctx)
        missing = [i.name for i in context.session.get_inputs() if i.name not in context.feeds]
        if missing:
            raise _Refused(INVALID_ARGUMENT, GuestError(f"wasi-nn compute: input(s) {', '.join(missing)} not set"))
        try:
            context.results = context.session.run(None, context.feeds)
        except Exception as exc:
            first = (str(exc).strip().splitlines() or [type(exc).__name__])[0]
            raise _Refused(RUNTIME_ERROR, GuestError(f"wasi-nn compute failed: {first[:300]}")) from exc

    def _get_output(self, mem: _Memory, ctx: int, index: int, out_ptr: int, out_max: int, written_ptr: int) -> None:
        context = self._context(ctx)
        outputs = context.session.get_outputs()
        if index >= len(outputs):
            raise _Refused(NOT_FOUND, NoSuchTensor(
                f"the guest asked for output tensor #{index}, but the model has {len(outputs)} output(s): "
                f"{', '.join(o.name for o in outputs)}"))
        if context.results is None:
            raise _Refused(INVALID_ARGUMENT, GuestError("wasi-nn get_output before compute"))
        data = np.ascontiguousarray(context.results[index]).tobytes()
        if len(data) > out_max:
            raise _Refused(TOO_LARGE, GuestError(
                f"wasi-nn get_output: output {outputs[index].name} is {len(data)} bytes, the guest's buffer {out_max}"))
        mem.write(out_ptr, data)
        mem.write_u32(written_ptr, len(data))

    def _context(self, ctx: int) -> _Context:
        if ctx >= len(self.contexts):
            raise _Refused(INVALID_ARGUMENT, GuestError(f"wasi-nn: no execution context {ctx}"))
        return self.contexts[ctx]


class _Memory:
    """The calling guest's exported memory, every access bounds-checked."""

    def __init__(self, caller: Any) -> None:
        memory = caller.get("memory")
        if memory is None:
            raise _Refused(MISSING_MEMORY, GuestError("the guest exports no memory"))
        self.caller, self.memory = caller, memory

    def _check(self, ptr: int, size: int) -> None:
        if ptr + size > self.memory.data_len(self.caller):
            raise _Refused(INVALID_ARGUMENT, GuestError(
                f"wasi-nn: the guest passed {size} bytes at {ptr}, outside its memory"))

    def read(self, ptr: int, size: int) -> bytes:
        self._check(ptr, size)
        return bytes(self.memory.read(self.caller, ptr, ptr + size))

    def write(self, ptr: int, data: bytes) -> None:
        self._check(ptr, len(data))
        self.memory.write(self.caller, data, ptr)

    def write_u32(self, ptr: int, value: int) -> None:
        self.write(ptr, struct.pack("<I", value))
