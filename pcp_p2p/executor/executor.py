"""The IREE executor: runs verified artifacts in a child process that may crash.

Why a child process: an llvm-cpu artifact that uses an instruction this CPU
lacks dies with SIGILL, and a driver bug can segfault; in-process, either
would take the whole node down with it. In a child, the parent sees the pipe
close, raises :class:`~pcp_p2p.core.errors.ExecutorCrashed` (with the signal and
the child's last stderr lines) and can start a new executor.

Why ``python <file>`` rather than ``multiprocessing``: the ``spawn`` start
method re-imports the parent's ``__main__`` in the child, which for a
benchmark or a shepherd means importing JAX. The child here imports only
numpy, msgpack and ``iree.runtime`` (see :mod:`.executor_child`); this module
imports neither JAX nor the compiler either, so a worker needs neither.

Before anything runs, :meth:`Executor.start` refuses:

- an artifact whose bytes do not match its manifest, or a manifest that is
  unsigned, signed by someone other than ``expected_signer``, or names flags
  that are not this node's flags for its target (typed errors from
  :func:`~pcp_p2p.compile.manifest.verify_manifest`);
- an artifact for a target this machine cannot run — another CPU
  architecture, a CPU level whose flags this CPU lacks, a GPU driver or device
  that is not here (:class:`~pcp_p2p.core.errors.IncompatibleArtifact`);

and every call checks its inputs against the manifest's signature
(:class:`~pcp_p2p.core.errors.InvalidInput`).

Usage (trio code calls the blocking methods via ``trio.to_thread.run_sync``;
one lock serialises requests, so calls from several threads are safe)::

    ex = Executor.start(train_vmfb_path, train_manifest, expected_signer=shepherd)
    ex.add_program(eval_vmfb_path, eval_manifest, expected_signer=shepherd)  # optional
    ex.load_state(params, m, v, step)      # once per round: uploads to the device
    losses = ex.train(lr, xs, ys)          # H inner steps; state stays on the device
    params, m, v, step = ex.read_state()   # when the round ends
    ex.close()

For audits (:mod:`pcp_p2p.diloco.protocol.audit`) the inner optimiser state — moments
and step, not the parameters — can be named and kept without leaving the
device: :meth:`Executor.inner_digest` hashes it in the child,
:meth:`Executor.snapshot` keeps references to it under a tag (device arrays
are never written in place, so this copies nothing), :meth:`Executor.restore`
puts it back and :meth:`Executor.read_inner` copies one out when an auditor
asks for it.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import tempfile
import threading
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import IO, Any, NamedTuple

import numpy as np

from pcp_p2p.compile.manifest import Manifest, verify_manifest
from pcp_p2p.compile.signature import TensorSpec, check_array
from pcp_p2p.compile.targets import TARGETS, Target
from pcp_p2p.core.errors import (
    ConfigError,
    ExecutorCrashed,
    ExecutorError,
    IncompatibleArtifact,
    InvalidInput,
)
from pcp_p2p.core.launch import without_launch
from pcp_p2p.core.priority import EXECUTOR_NICENESS, low_priority
from pcp_p2p.executor import executor_child as proto
from pcp_p2p.executor.cpu import CpuInfo, cpu_can_run, local_cpu

CHILD_SCRIPT = Path(proto.__file__).resolve()

# glibc malloc settings for the child. IREE's CPU driver mallocs every call's
# results and transients; glibc serves blocks above its mmap threshold (at
# most 32 MiB) with fresh mmaps and unmaps them on free, so every call
# page-faults its whole working set again and the kernel zeroes it. For the
# 10.7M-parameter train step (a 129 MB result block and a 168 MB transient
# block) that was ~80k faults and ~150 ms of system time per call. Serving
# everything from one brk heap that is never trimmed (no mmap, one arena)
# makes later calls reuse warm pages: ~500 faults and no system time per call,
# for ~15% more peak memory. Other C libraries ignore the variable.
MALLOC_TUNABLES = (
    "glibc.malloc.mmap_max=0:"
    "glibc.malloc.arena_max=1:"
    "glibc.malloc.trim_threshold=68719476736:"
    "glibc.malloc.top_pad=67108864"
)
_ERRORS = {"InvalidInput": InvalidInput, "IncompatibleArtifact": IncompatibleArtifact,
           "ExecutorError": ExecutorError}
_STATE_GROUPS = ("param", "m", "v")


class TrainState(NamedTuple):
    """Parameters, AdamW moments (name -> float32 array) and the step count."""

    params: dict[str, np.ndarray]
    m: dict[str, np.ndarray]
    v: dict[str, np.ndarray]
    step: int


def check_runnable(target: Target, cpu: CpuInfo | None = None) -> None:
    """:class:`IncompatibleArtifact` if this machine's CPU cannot run a CPU ``target``.

    GPU targets are checked when the child creates the device.
    """
    if target.is_cpu:
        reason = cpu_can_run(target, cpu or local_cpu())
        if reason:
            raise IncompatibleArtifact(reason)
    elif target.driver == "metal" and sys.platform != "darwin":
        raise IncompatibleArtifact("metal artifacts run only on macOS")


def _read_artifact(path: Path | str) -> bytes:
    try:
        return Path(path).read_bytes()
    except OSError as exc:
        raise ConfigError(f"cannot read artifact {path}: {exc}") from exc


class Executor:
    """A child process holding one IREE device, the loaded programs and their state."""

    def __init__(self, target: Target, proc: subprocess.Popen[bytes], stderr_file: IO[bytes]) -> None:
        if proc.stdin is None or proc.stdout is None:
            raise ExecutorError("the executor child needs pipes on its stdin and stdout")
        self.target = target
        self._proc = proc
        self._to_child = proc.stdin
        self._from_child = proc.stdout
        self._stderr = stderr_file
        self._lock = threading.Lock()
        self._manifests: dict[str, Manifest] = {}
        self._loaded_state: set[str] = set()
        self._dead: str | None = None  # why the executor can no longer be used

    # --- life cycle ---------------------------------------------------------------

    @classmethod
    def start(
        cls,
        artifact_path: Path | str,
        manifest: Manifest,
        *,
        expected_signer: str | None = None,
        cpu: CpuInfo | None = None,
    ) -> Executor:
        """Verify the artifact, check this machine can run it, start a child and load it."""
        data = _read_artifact(artifact_path)
        verify_manifest(manifest, data, expected_signer)
        target = TARGETS[manifest.target]
        check_runnable(target, cpu)
        ex = cls._spawn(target)
        try:
            ex._request("init", driver=target.driver)
            ex._load(manifest, data)
        except BaseException:
            ex.close()
            raise
        return ex

    @classmethod
    def _spawn(cls, target: Target) -> Executor:
        stderr_file = tempfile.TemporaryFile(prefix="pcp-executor-")
        env = without_launch(os.environ)  # a child under mpiexec is a device, not an MPI rank
        env["GLIBC_TUNABLES"] = ":".join(filter(None, (env.get("GLIBC_TUNABLES"), MALLOC_TUNABLES)))
        try:
            proc = subprocess.Popen(
                [*low_priority(EXECUTOR_NICENESS), sys.executable, str(CHILD_SCRIPT)],
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                stderr=stderr_file,
                close_fds=True,
                env=env,
            )
        except OSError as exc:
            stderr_file.close()
            raise ExecutorError(f"cannot start the executor child: {exc}") from exc
        return cls(target, proc, stderr_file)

    def add_program(self, artifact_path: Path | str, manifest: Manifest, *,
                    expected_signer: str | None = None) -> None:
        """Load another program (``eval``, ``sample``) built for the same target and model."""
        data = _read_artifact(artifact_path)
        verify_manifest(manifest, data, expected_signer)
        if manifest.target != self.target.name:
            raise IncompatibleArtifact(
                f"{manifest.program} is built for {manifest.target}, this executor runs "
                f"{self.target.name}"
            )
        for other in self._manifests.values():
            if other.model_config != manifest.model_config:
                raise InvalidInput(f"{manifest.program} is for another model than "
                                   f"{other.program}")
        self._load(manifest, data)

    def _load(self, manifest: Manifest, data: bytes) -> None:
        if manifest.program in self._manifests:
            raise ExecutorError(f"a {manifest.program} program is already loaded")
        self._request("load", name=manifest.program, vmfb=data)
        self._manifests[manifest.program] = manifest

    def close(self) -> None:
        """Stop the child (politely, then by force). Safe to call twice, from any thread."""
        if self._dead is None:
            self._dead = "closed"
        proc = self._proc
        if proc.poll() is None:
            if self._lock.acquire(timeout=0.5):  # no call in flight: ask it to exit
                try:
                    proto.write_frame(self._to_child, {"op": "exit"})
                except (OSError, ValueError):
                    pass
                finally:
                    self._lock.release()
                try:
                    proc.wait(timeout=5)
                except subprocess.TimeoutExpired:
                    pass
            if proc.poll() is None:
                proc.kill()
                proc.wait()
        for f in (proc.stdin, proc.stdout):
            try:
                if f:
                    f.close()
            except OSError:
                pass
        try:
            self._stderr.close()
        except OSError:
            pass

    def __enter__(self) -> Executor:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    @property
    def pid(self) -> int:
        return self._proc.pid

    @property
    def programs(self) -> tuple[str, ...]:
        return tuple(self._manifests)

    @property
    def alive(self) -> bool:
        return self._dead is None and self._proc.poll() is None

    # --- state --------------------------------------------------------------------

    def _param_specs(self) -> list[TensorSpec]:
        manifest = next(iter(self._manifests.values()))
        return [s for s in manifest.inputs if s.name.startswith("param/")]

    def load_state(
        self,
        params: Mapping[str, Any] | Sequence[Any],
        m: Mapping[str, Any] | Sequence[Any] | None = None,
        v: Mapping[str, Any] | Sequence[Any] | None = None,
        step: int = 0,
    ) -> None:
        """Upload parameters and AdamW state (zeros where ``m``/``v`` are None) to the device.

        Each group is a dict ``name -> array`` (names as in
        :func:`pcp_p2p.compile.model.param_shapes`) or a sequence in that order.
        """
        specs = self._param_specs()
        arrays: dict[str, np.ndarray] = {}
        for group, values in (("param", params), ("m", m), ("v", v)):
            for spec, value in zip(specs, _as_list(group, values, specs)):
                name = f"{group}/{spec.name.removeprefix('param/')}"
                arrays[name] = check_array(TensorSpec(name, spec.shape, spec.dtype), value)
        if "train" in self._manifests:
            arrays["step"] = check_array(TensorSpec("step", (), "int32"), step)
        self._set(arrays)

    def load_params(self, params: Mapping[str, Any] | Sequence[Any]) -> None:
        """Upload parameters only (for an executor that evaluates or samples)."""
        specs = self._param_specs()
        self._set({s.name: check_array(s, a) for s, a in zip(specs, _as_list("param", params, specs))})

    def _set(self, arrays: dict[str, np.ndarray]) -> None:
        self._request("set", arrays={k: proto.pack_array(a) for k, a in arrays.items()})
        self._loaded_state.update(arrays)

    def read_state(self) -> TrainState:
        """Host copies of the current parameters, moments and step (valid forever)."""
        self._need("train")
        names = [s.name for s in self._manifests["train"].outputs if s.name != "losses"]
        got = self._get(names)
        groups: dict[str, dict[str, np.ndarray]] = {g: {} for g in _STATE_GROUPS}
        for name in names[:-1]:
            group, _, pname = name.partition("/")
            groups[group][pname] = got[name]
        return TrainState(groups["param"], groups["m"], groups["v"], int(got["step"]))

    def read_params(self) -> dict[str, np.ndarray]:
        names = [s.name for s in self._param_specs()]
        got = self._get(names)
        return {n.removeprefix("param/"): got[n] for n in names}

    # --- inner optimiser state (audits) ---------------------------------------------

    def inner_names(self) -> list[str]:
        """``m/*``, ``v/*`` and ``step``: the train program's state besides the parameters."""
        self._need("train")
        return [s.name for s in self._manifests["train"].outputs
                if s.name.startswith(("m/", "v/")) or s.name == "step"]

    def inner_digest(self, tag: str | None = None) -> str:
        """:func:`~pcp_p2p.executor.executor_child.state_digest` of the current (or a snapshot's)
        moments and step, computed in the child."""
        names = self.inner_names()
        if tag is None:
            self._require_loaded(names)
        return str(self._request("digest", names=names, tag=tag)["digest"])

    def snapshot(self, tag: str) -> None:
        """Keep the current moments and step under ``tag`` (references, no copy)."""
        names = self.inner_names()
        self._require_loaded(names)
        self._request("snapshot", tag=tag, names=names)

    def restore(self, tag: str) -> None:
        """Make snapshot ``tag`` the current moments and step."""
        self._request("restore", tag=tag)
        self._loaded_state.update(self.inner_names())

    def drop_snapshot(self, tag: str) -> None:
        self._request("drop", tag=tag)

    def read_inner(self, tag: str | None = None) -> TrainState:
        """Host copies of the moments and step (current, or of snapshot ``tag``); no params."""
        names = self.inner_names()
        if tag is None:
            self._require_loaded(names)
        got = {k: proto.unpack_array(a) for k, a in self._request("get", names=names, tag=tag)["arrays"].items()}
        m = {n.removeprefix("m/"): got[n] for n in names if n.startswith("m/")}
        v = {n.removeprefix("v/"): got[n] for n in names if n.startswith("v/")}
        return TrainState({}, m, v, int(got["step"]))

    def _require_loaded(self, names: list[str]) -> None:
        missing = [n for n in names if n not in self._loaded_state]
        if missing:
            raise ExecutorError(f"no state loaded for {missing[0]} (call load_state first)")

    def _get(self, names: list[str]) -> dict[str, np.ndarray]:
        self._require_loaded(names)
        reply = self._request("get", names=names)
        return {k: proto.unpack_array(a) for k, a in reply["arrays"].items()}

    # --- programs -----------------------------------------------------------------

    def train(self, lr: float, xs: np.ndarray, ys: np.ndarray) -> np.ndarray:
        """Run H inner steps on batches ``xs``/``ys`` (int32, (H, B, T)); the H losses."""
        out = self._call("train", {"lr": lr, "xs": xs, "ys": ys}, fetch=["losses"])
        return out["losses"]

    def eval(self, x: np.ndarray, y: np.ndarray) -> float:
        """Mean cross-entropy of the current parameters on one (B, T) batch."""
        return float(self._call("eval", {"x": x, "y": y}, fetch=["loss"])["loss"])

    def sample(self, idx: np.ndarray, length: int | None = None) -> np.ndarray:
        """Next-token logits (S, vocab) after the first ``length`` tokens of each row of ``idx``."""
        if length is None:
            length = self._spec("sample", "idx").shape[1]
        return self._call("sample", {"idx": idx, "length": length}, fetch=["logits"])["logits"]

    def _spec(self, program: str, name: str) -> TensorSpec:
        self._need(program)
        return next(s for s in self._manifests[program].inputs if s.name == name)

    def _need(self, program: str) -> None:
        if self._dead is not None:
            raise ExecutorCrashed(f"executor is {self._dead}; start a new one")
        if program not in self._manifests:
            raise ExecutorError(f"no {program} program loaded")

    def _call(self, program: str, feeds: dict[str, Any], fetch: list[str]) -> dict[str, np.ndarray]:
        self._need(program)
        manifest = self._manifests[program]
        specs = {s.name: s for s in manifest.inputs}
        checked = {}
        for name, value in feeds.items():
            checked[name] = check_array(specs[name], value)
        inputs = [s.name for s in manifest.inputs]
        missing = [n for n in inputs if n not in checked and n not in self._loaded_state]
        if missing:
            raise ExecutorError(f"{program}: no value for {missing[0]} (call load_state first)")
        outputs = [s.name for s in manifest.outputs]
        keep = [n for n in outputs if n in specs]  # outputs that are also inputs: new state
        reply = self._request(
            "call", program=program, inputs=inputs, outputs=outputs,
            feeds={k: proto.pack_array(a) for k, a in checked.items()}, keep=keep, fetch=fetch,
        )
        return {k: proto.unpack_array(a) for k, a in reply["arrays"].items()}

    def child_modules(self) -> list[str]:
        """The modules imported in the child (to check it never imports JAX)."""
        return list(self._request("modules")["modules"])

    # --- the pipe -----------------------------------------------------------------

    def _request(self, op: str, **fields: Any) -> proto.Reply:
        with self._lock:
            if self._dead is not None:
                raise ExecutorCrashed(f"executor is {self._dead}; start a new one")
            try:
                proto.write_frame(self._to_child, {"op": op, **fields})
                reply: proto.Reply | None = proto.read_frame(self._from_child)
            except (OSError, ValueError):
                reply = None
            if reply is None:
                raise self._crashed(op)
        if not reply.get("ok"):
            raise _ERRORS.get(reply.get("kind", ""), ExecutorError)(reply.get("msg", "executor error"))
        return reply

    def _crashed(self, op: str) -> ExecutorError:
        if self._dead == "closed":
            return ExecutorCrashed(f"executor was closed during {op}")
        try:
            code = self._proc.wait(timeout=5)
        except subprocess.TimeoutExpired:
            self._proc.kill()
            code = self._proc.wait()
        if code < 0:
            try:
                how = f"killed by {signal.Signals(-code).name}"
            except ValueError:
                how = f"killed by signal {-code}"
        else:
            how = f"exited with status {code}"
        self._dead = f"dead ({how})"
        return ExecutorCrashed(f"executor child {how} during {op}{self._stderr_tail()}")

    def _stderr_tail(self, limit: int = 2000) -> str:
        try:
            self._stderr.flush()
            size = os.fstat(self._stderr.fileno()).st_size
            self._stderr.seek(max(0, size - limit))
            text = self._stderr.read().decode(errors="replace").strip()
        except (OSError, ValueError):
            return ""
        return f"; its last output:\n{text}" if text else ""


def _as_list(group: str, values: Mapping[str, Any] | Sequence[Any] | None,
             specs: list[TensorSpec]) -> list[Any]:
    """Values for ``specs`` in order, from a dict by name, a sequence, or None (zeros)."""
    names = [s.name.removeprefix("param/") for s in specs]
    if values is None:
        return [np.zeros(s.shape, s.dtype) for s in specs]
    if isinstance(values, Mapping):
        extra = set(values) - set(names)
        missing = [n for n in names if n not in values]
        if missing or extra:
            what = f"missing {missing[0]}" if missing else f"unknown {sorted(extra)[0]}"
            raise InvalidInput(f"{group}: {what}")
        return [values[n] for n in names]
    values = list(values)
    if len(values) != len(names):
        raise InvalidInput(f"{group}: expected {len(names)} arrays, got {len(values)}")
    return values

