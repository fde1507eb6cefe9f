"""A compile nobody needs any more stops at once: the compiler process is killed, and a node
whose election went to another peer does not keep compiling for the lost term."""

from __future__ import annotations

import os
import sys
import threading
import time
from pathlib import Path
from types import SimpleNamespace

import pytest
import trio
from conftest_compile import TINY, TINY_OPTS, lowered

from pcp_p2p.compile import iree_compile, pipeline
from pcp_p2p.compile.cache import ArtifactCache
from pcp_p2p.core.errors import CompileCancelled, CompileError
from pcp_p2p.core.identity import Identity
from pcp_p2p.diloco.protocol.election import FollowShepherd, StepDown
from pcp_p2p.diloco.protocol.spec import parse_spec
from pcp_p2p.diloco.run import engine
from pcp_p2p.diloco.run.reputation import ReputationLedger
from pcp_p2p.diloco.run.run_effects import SetUpEnded
from pcp_p2p.diloco.run.run_machine import RunMachine
from pcp_p2p.diloco.run.run_setup import TermSetUp
from pcp_p2p.diloco.run.runtime import RunRuntime

pytestmark = pytest.mark.timeout(60)


@pytest.fixture
def slow_compiler(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """An ``iree-compile`` that writes its pid and then compiles for a minute; the pid file's path."""
    pid_file = tmp_path / "pid"
    script = tmp_path / "iree-compile"
    script.write_text(f"#!{sys.executable}\nimport os, sys, time\nsys.stdin.read()\n"
                      f"open({str(pid_file)!r}, 'w').write(str(os.getpid()))\ntime.sleep(60)\n")
    script.chmod(0o755)
    monkeypatch.setattr(iree_compile, "compiler_path", lambda: str(script))
    return pid_file


def wait_for_pid(pid_file: Path) -> int:
    for _ in range(1200):  # the child starts a Python interpreter (niced): seconds on a busy machine
        if pid_file.exists() and pid_file.read_text():
            return int(pid_file.read_text())
        time.sleep(0.05)
    raise AssertionError("the fake compiler never started")


def gone(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    return False


def test_a_cancelled_compile_kills_the_compiler(slow_compiler: Path) -> None:
    cancel = threading.Event()
    outcome: list[BaseException] = []

    def compile_() -> None:
        try:
            iree_compile.run_compiler("module {}", ("--flag",), cancel=cancel)
        except BaseException as exc:
            outcome.append(exc)

    t = threading.Thread(target=compile_)
    t.start()
    pid = wait_for_pid(slow_compiler)
    cancel.set()
    t.join(timeout=20)  # the fake compiler sleeps 60 s: returning sooner means it was killed
    assert not t.is_alive()
    assert [type(e) for e in outcome] == [CompileCancelled]
    assert gone(pid)  # killed and reaped, not left behind


def test_a_large_program_reaches_the_compiler_whole(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The program text (megabytes, far above a pipe's buffer) goes in whole and stdin is closed,
    also while a cancel flag is being watched."""
    script = tmp_path / "iree-compile"
    script.write_text(f"#!{sys.executable}\nimport sys\ndata = sys.stdin.buffer.read()\n"
                      "sys.stdout.buffer.write(len(data).to_bytes(8, 'little'))\n")
    script.chmod(0o755)
    monkeypatch.setattr(iree_compile, "compiler_path", lambda: str(script))
    text = "x" * (8 << 20)
    out = iree_compile.run_compiler(text, (), cancel=threading.Event())
    assert int.from_bytes(out, "little") == len(text)


def test_a_compile_past_its_timeout_kills_the_compiler(slow_compiler: Path) -> None:
    with pytest.raises(CompileError, match="timed out"):
        iree_compile.run_compiler("module {}", ("--flag",), timeout=0.5)
    assert gone(wait_for_pid(slow_compiler))


def test_a_cancelled_lowering_kills_its_child(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Tracing a training step takes seconds of JAX, and (in a thread) ran to its end after
    the build was given up; in a child it stops at once."""
    pid_file = tmp_path / "pid"
    script = (f"import os, sys, time\nsys.stdin.read()\nopen({str(pid_file)!r}, 'w').write(str(os.getpid()))\n"
              "time.sleep(60)\n")
    monkeypatch.setattr(pipeline, "lower_command", lambda: [sys.executable, "-c", script])
    cancel = threading.Event()
    outcome: list[BaseException] = []

    def lower() -> None:
        try:
            pipeline.lower_program("train", TINY, TINY_OPTS, cancel=cancel)
        except BaseException as exc:
            outcome.append(exc)

    t = threading.Thread(target=lower)
    t.start()
    pid = wait_for_pid(pid_file)
    cancel.set()
    t.join(timeout=20)
    assert not t.is_alive()
    assert [type(e) for e in outcome] == [CompileCancelled]
    assert gone(pid)


def test_a_failed_lowering_child_is_a_one_line_compile_error(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(pipeline, "lower_command",
                        lambda: [sys.executable, "-c", "import sys; sys.exit('no JAX here')"])
    with pytest.raises(CompileError, match=r"lowering train failed \(exit 1\): no JAX here"):
        pipeline.lower_program("train", TINY, TINY_OPTS, cancel=threading.Event())


@pytest.mark.slow
def test_lowering_in_a_child_gives_the_same_text_and_the_cache_keeps_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
) -> None:
    cache = ArtifactCache(tmp_path)
    there = pipeline.lower_program("train", TINY, TINY_OPTS, cancel=threading.Event(), cache=cache)
    assert there.stablehlo == lowered("train").stablehlo
    monkeypatch.setattr(pipeline, "lower_command", lambda: ["false"])  # a second lowering would fail
    again = pipeline.lower_program("train", TINY, TINY_OPTS, cancel=threading.Event(), cache=cache)
    assert again.stablehlo_hash == there.stablehlo_hash


def becoming_runtime() -> RunRuntime:
    """A runtime with just what the shepherd's set-up and the election's effects touch, and a
    real run machine that is setting up term 4."""
    rt = RunRuntime.__new__(RunRuntime)
    ident = Identity.generate()
    rt.node = SimpleNamespace(peer_id=ident.peer_id, identity=ident, leads=set(),  # type: ignore[assignment]
                              config=SimpleNamespace(data_dir=Path("/nonexistent")))
    rt.run_id, rt.clock = "run", lambda: 1000.0
    rt.spec = parse_spec("[round]\nrounds = 10\n")
    rt.dataset = SimpleNamespace(vocab_size=65)  # type: ignore[assignment]
    rt.machine = RunMachine.for_spec(rt.spec, run_id="run", owner=ident.peer_id, identity=ident,
                                     ledger=ReputationLedger(Path("/nonexistent/ledger.json"), "run"),
                                     target=None, tokens_per_s=1.0, started_at=1000.0)
    rt.machine.becoming, rt.machine.becoming_term = True, 4  # as after BecomeShepherd(term=4)
    rt.setup = TermSetUp(rt)
    rt._send, rt._inbox = trio.open_memory_channel[tuple](10)
    rt._machine_lock, rt._machine_thread, rt._beats_in = threading.Lock(), trio.CapacityLimiter(1), []
    return rt


@pytest.mark.parametrize("lost", ["deposed", "another holds the term"])
async def test_losing_the_election_cancels_the_compile_at_once(lost: str, monkeypatch: pytest.MonkeyPatch) -> None:
    started, stopped = threading.Event(), threading.Event()

    def build(*args, cancel: threading.Event, **kw):  # type: ignore[no-untyped-def]
        started.set()
        cancel.wait(30)  # a long compile that looks at its flag, as run_compiler does
        stopped.set()
        raise CompileCancelled("cancelled")

    monkeypatch.setattr(engine, "build_train_artifacts", build)
    rt = becoming_runtime()

    async def set_up(eff) -> None:  # type: ignore[no-untyped-def]
        await rt.setup.build_artifacts(["x86_64-v3"])
        raise AssertionError("the set-up went on after the term was lost")

    monkeypatch.setattr(rt.setup, "build", set_up)
    async with trio.open_nursery() as nursery:
        rt._nursery = nursery
        nursery.start_soon(rt.setup.run, SimpleNamespace(term=4))
        await trio.to_thread.run_sync(started.wait, 10)
        other = Identity.generate().peer_id
        effects = [StepDown(4, "deposed")] if lost == "deposed" else [FollowShepherd(4, other, 0, "")]
        with trio.fail_after(10):  # not the 30 s the build would take
            m = rt.machine
            rt._carry_out(m._run(1000.0, lambda: m._election(effects, 1000.0)))  # the election's effects
            ended = await rt._inbox.receive()
            assert ended == SetUpEnded(4)  # the set-up task ended
            await rt._dispatch(ended)
    assert await trio.to_thread.run_sync(stopped.wait, 10)  # and the build thread was told to stop
    assert rt.setup.scope is None and not rt.machine.becoming
