"""One error path for ``pcp``: a ``pcp: error:`` line per failure, conventional exit codes, nodes that stop.

Every case runs the real ``pcp`` in a subprocess on 127.0.0.1 and cleans up
each process it starts.
"""

from __future__ import annotations

import contextlib
import os
import select
import shutil
import signal
import socket
import subprocess
import sys
import textwrap
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from pcp_p2p.cli import describe, exit_code, leaves, main
from pcp_p2p.core.errors import ConfigError, PeerGone
from pcp_p2p.core.identity import Identity
from pcp_p2p.core.shutdown import Interrupted, watched_parent

PCP = [sys.executable, "-m", "pcp_p2p.cli"]
STOP_BOUND_S = 30.0  # generous: the machine is shared; a wedged node used to need SIGKILL after minutes
DEAD_PEER = Identity.generate().peer_id


def pcp(*args: str, timeout: float = 90) -> subprocess.CompletedProcess[str]:
    return subprocess.run([*PCP, *args], capture_output=True, text=True, timeout=timeout, stdin=subprocess.DEVNULL)


def assert_one_error_line(res: subprocess.CompletedProcess[str], code: int = 1) -> str:
    """Exit ``code``, exactly one ``pcp: error:`` line, no traceback; returns that line."""
    errors = [line for line in res.stderr.splitlines() if line.startswith("pcp: error: ")]
    assert "Traceback" not in res.stderr and "ExceptionGroup" not in res.stderr, res.stderr[-3000:]
    assert len(errors) == 1, res.stderr[-3000:]
    assert res.returncode == code, (res.returncode, res.stderr[-3000:])
    return errors[0]


class Node:
    """A ``pcp`` node process that prints its multiaddr on its first stdout line."""

    def __init__(self, *args: str, sigint_ignored: bool = False) -> None:
        # sigint_ignored: started the way a non-interactive shell starts `pcp node join &`.
        self.proc = subprocess.Popen(
            [*PCP, *args], stdout=subprocess.PIPE, stderr=subprocess.PIPE, stdin=subprocess.DEVNULL,
            text=True, start_new_session=True,
            preexec_fn=(lambda: signal.signal(signal.SIGINT, signal.SIG_IGN)) if sigint_ignored else None,
        )
        assert self.proc.stdout is not None
        self.addr = self.proc.stdout.readline().strip()  # the node prints it once it listens
        if not self.addr:
            self.stop()
            raise AssertionError(f"node did not start: {self.proc.stderr.read()[-3000:] if self.proc.stderr else ''}")
        self.port = int(self.addr.split("/tcp/")[1].split("/")[0])

    def signal(self, signum: int) -> None:
        os.killpg(self.proc.pid, signum)

    def wait(self, timeout: float) -> tuple[int, float, str]:
        """(exit code, seconds it took, stderr)."""
        t0 = time.monotonic()
        code = self.proc.wait(timeout=timeout)
        took = time.monotonic() - t0
        assert self.proc.stderr is not None
        return code, took, self.proc.stderr.read()

    def stop(self) -> None:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait(timeout=10)
        for f in (self.proc.stdout, self.proc.stderr):
            if f is not None:
                f.close()


@pytest.fixture(scope="module")
def bootstrap(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Node]:
    data = tmp_path_factory.mktemp("boot")
    node = Node("bootstrap", "--listen", "/ip4/127.0.0.1/tcp/0", "--data-dir", str(data))
    node.data_dir = data  # type: ignore[attr-defined]
    yield node
    node.stop()


@pytest.fixture
def taken_port() -> Iterator[int]:
    """A port held the way py-libp2p holds its listen port (SO_REUSEADDR + SO_REUSEPORT)."""
    with socket.socket() as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
        s.bind(("127.0.0.1", 0))
        s.listen()
        yield s.getsockname()[1]


# -- the table of bad inputs ---------------------------------------------------------------

# Each case: (argv built from the fixtures, substring the error line must contain).
Case = Callable[[Path, Node, int], tuple[list[str], str]]


def _bad_spec(tmp: Path, boot: Node, port: int) -> tuple[list[str], str]:
    (tmp / "run.toml").write_text('name = "x"\n[round]\nrounds = -3\n')
    return ["run", "create", str(tmp / "run.toml"), "--bootstrap", boot.addr, "--data-dir", str(tmp)], "rounds"


def _data_dir_is_a_file(tmp: Path, boot: Node, port: int) -> tuple[list[str], str]:
    (tmp / "f").write_text("")
    return ["node", "join", "--data-dir", str(tmp / "f" / "sub")], "f/sub/logs: not a directory"


def _bad_config(tmp: Path, boot: Node, port: int) -> tuple[list[str], str]:
    (tmp / "c.toml").write_text("listen = [\n")
    return ["bootstrap", "--config", str(tmp / "c.toml")], "c.toml"


def _unreadable_blob_dir(tmp: Path, boot: Node, port: int) -> tuple[list[str], str]:
    # A data dir the node cannot write into (its blob store's place is a file).
    (tmp / "blobs").write_text("not a directory")
    return ["node", "join", "--listen", "/ip4/127.0.0.1/tcp/0", "--data-dir", str(tmp)], "blobs"


CASES: dict[str, Case] = {
    "generate: unknown run id": lambda tmp, boot, port: (
        ["generate", "--bootstrap", boot.addr, "--run", "no-such-run", "--data-dir", str(tmp), "--timeout", "4"],
        "no run no-such-run found in the swarm's DHT within 4 s"),
    "bootstrap: listen port in use": lambda tmp, boot, port: (
        ["bootstrap", "--listen", f"/ip4/127.0.0.1/tcp/{port}", "--data-dir", str(tmp)],
        f"cannot listen on /ip4/127.0.0.1/tcp/{port}: address already in use"),
    "node join: listen port in use": lambda tmp, boot, port: (
        ["node", "join", "--listen", f"/ip4/127.0.0.1/tcp/{port}", "--data-dir", str(tmp)],
        f"cannot listen on /ip4/127.0.0.1/tcp/{port}: address already in use"),
    "node join: --metrics-port in use": lambda tmp, boot, port: (
        ["node", "join", "--listen", "/ip4/127.0.0.1/tcp/0", "--metrics-port", str(port), "--data-dir", str(tmp)],
        f"cannot serve metrics on 127.0.0.1:{port}: address already in use"),
    "node join: data dir not writable": _unreadable_blob_dir,
    "node join: data dir is a file": _data_dir_is_a_file,
    "run create: bad run spec": _bad_spec,
    "status: dead node": lambda tmp, boot, port: (
        ["status", "--json", "--connect", f"/ip4/127.0.0.1/tcp/1/p2p/{DEAD_PEER}", "--timeout", "5"], ""),
    "bootstrap: bad --config": _bad_config,
}


@pytest.mark.parametrize("name", list(CASES))
def test_bad_input_is_one_error_line(name: str, tmp_path: Path, bootstrap: Node, taken_port: int) -> None:
    argv, needle = CASES[name](tmp_path, bootstrap, taken_port)
    line = assert_one_error_line(pcp(*argv))
    assert needle in line, line


@pytest.mark.slow  # the owner's client waits 30 s for a bootstrap server to answer
def test_run_create_with_an_unreachable_bootstrap_is_one_error_line(tmp_path: Path) -> None:
    (tmp_path / "run.toml").write_text('name = "x"\n')
    dead = f"/ip4/127.0.0.1/tcp/1/p2p/{DEAD_PEER}"
    line = assert_one_error_line(pcp("run", "create", str(tmp_path / "run.toml"), "--bootstrap", dead,
                                     "--data-dir", str(tmp_path)))
    assert "no bootstrap server answered" in line and dead in line


@pytest.mark.skipif(os.geteuid() != 0 or shutil.which("unshare") is None,
                    reason="needs root and unshare for a ro mount")
def test_read_only_data_dir_is_one_error_line(tmp_path: Path) -> None:
    from pcp_p2p.core.identity import load_or_create_identity

    data = tmp_path / "ro"
    load_or_create_identity(data)  # a node that ran before, its data dir now mounted read-only
    script = (f"mount --bind {data} {data} && mount -o remount,bind,ro {data} && "
              f"exec {' '.join(PCP)} node join --listen /ip4/127.0.0.1/tcp/0 --data-dir {data}")
    res = subprocess.run(["unshare", "-m", "sh", "-c", script], capture_output=True, text=True, timeout=90)
    if "mount:" in res.stderr or "unshare:" in res.stderr:
        pytest.skip(f"no private mount namespace here: {res.stderr.strip()[:200]}")
    assert "read-only file system" in assert_one_error_line(res)


def test_debug_prints_the_traceback_wherever_the_flag_is(tmp_path: Path) -> None:
    for argv in (["--debug", "status", "--data-dir", str(tmp_path)],
                 ["status", "--data-dir", str(tmp_path), "--debug"]):
        res = pcp(*argv)
        assert res.returncode == 1 and "Traceback" in res.stderr and "no running node" in res.stderr


def test_usage_error_exits_2() -> None:
    res = pcp("node", "join", "--no-such-flag")
    assert res.returncode == 2 and "Traceback" not in res.stderr


# -- a port in use is refused, not shared --------------------------------------------------


def test_a_second_node_on_a_taken_port_is_refused_and_the_first_keeps_it(tmp_path: Path, bootstrap: Node) -> None:
    listen = f"/ip4/127.0.0.1/tcp/{bootstrap.port}"
    for argv in (["bootstrap", "--listen", listen, "--data-dir", str(tmp_path / "b")],
                 ["node", "join", "--listen", listen, "--data-dir", str(tmp_path / "j")],
                 # Even with the first node's own data dir: refused, and its node.addr is left alone.
                 ["bootstrap", "--listen", listen, "--data-dir", str(bootstrap.data_dir)]):  # type: ignore[attr-defined]
        line = assert_one_error_line(pcp(*argv))
        assert "address already in use" in line
    assert (bootstrap.data_dir / "node.addr").read_text().strip() == bootstrap.addr  # type: ignore[attr-defined]
    assert bootstrap.proc.poll() is None


# -- signals: Ctrl+C is 130, SIGTERM a clean leave, always within a bound --------------------


@pytest.mark.parametrize("sigint_ignored", [False, True], ids=["foreground", "background job"])
def test_ctrl_c_stops_a_joined_node_with_130(tmp_path: Path, bootstrap: Node, sigint_ignored: bool) -> None:
    node = Node("node", "join", "--listen", "/ip4/127.0.0.1/tcp/0", "--bootstrap", bootstrap.addr,
                "--data-dir", str(tmp_path), sigint_ignored=sigint_ignored)
    try:
        node.signal(signal.SIGINT)
        code, _, stderr = node.wait(STOP_BOUND_S)
        assert code == 130, stderr[-2000:]
        assert "Traceback" not in stderr and "pcp: stopped by SIGINT" in stderr
        assert not (tmp_path / "node.addr").exists()
    finally:
        node.stop()


def test_sigterm_stops_a_joined_node_cleanly(tmp_path: Path, bootstrap: Node) -> None:
    node = Node("node", "join", "--listen", "/ip4/127.0.0.1/tcp/0", "--bootstrap", bootstrap.addr,
                "--data-dir", str(tmp_path))
    try:
        node.signal(signal.SIGTERM)
        code, _, stderr = node.wait(STOP_BOUND_S)
        assert code == 0 and "Traceback" not in stderr, stderr[-2000:]
    finally:
        node.stop()


@pytest.mark.parametrize("argv", [
    ["run", "create", "RUN_TOML", "--bootstrap", f"/ip4/127.0.0.1/tcp/1/p2p/{DEAD_PEER}"],
    ["generate", "--run", "x", "--bootstrap", f"/ip4/127.0.0.1/tcp/1/p2p/{DEAD_PEER}"],
], ids=["run create", "generate"])
def test_ctrl_c_in_a_client_command_is_130(tmp_path: Path, argv: list[str]) -> None:
    (tmp_path / "run.toml").write_text('name = "x"\n')
    argv = [str(tmp_path / "run.toml") if a == "RUN_TOML" else a for a in argv]
    proc = subprocess.Popen([*PCP, *argv, "--data-dir", str(tmp_path)], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, stdin=subprocess.DEVNULL, text=True, start_new_session=True)
    try:
        assert proc.stderr is not None
        seen = ""
        for _ in range(5):  # progress lines, then: its node is up and retrying the dead bootstrap server
            seen += proc.stderr.readline()
            if "no bootstrap server answered" in seen:
                break
        assert "no bootstrap server answered" in seen, seen
        proc.send_signal(signal.SIGINT)
        _, rest = proc.communicate(timeout=STOP_BOUND_S)
        assert proc.returncode == 130, rest
        assert "Traceback" not in rest and "pcp: error:" not in rest
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.communicate(timeout=10)


def test_ctrl_c_in_pcp_swarm_is_130_and_leaves_nothing_running(tmp_path: Path) -> None:
    from pcp_p2p.node.node import check_can_bind

    proc = subprocess.Popen([*PCP, "swarm", "--workers", "1", "--rounds", "1", "--dir", str(tmp_path)],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, stdin=subprocess.DEVNULL, text=True,
                            start_new_session=True)
    try:
        assert proc.stdout is not None
        line = proc.stdout.readline()  # "bootstrap server  /ip4/127.0.0.1/tcp/PORT/p2p/..."
        assert line.startswith("bootstrap server"), line
        port = int(line.split("/tcp/")[1].split("/")[0])
        proc.send_signal(signal.SIGINT)
        _, stderr = proc.communicate(timeout=STOP_BOUND_S)
        assert proc.returncode == 130 and "Traceback" not in stderr, stderr[-3000:]
        check_can_bind("127.0.0.1", port, "listen where the swarm's bootstrap server was")  # it is gone
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.communicate(timeout=10)


# A command whose graceful stop wedges the way the unstoppable shepherd did: its
# work sits in a thread that cancellation cannot interrupt ("thread"), or blocks
# trio's own thread so that no trio task runs at all ("loop").
WEDGED = textwrap.dedent("""
    import sys, time, trio
    from pcp_p2p.core import logs
    from pcp_p2p.cli import report
    from pcp_p2p.core.shutdown import run_until_signal

    logs.configure("INFO")

    async def wedged(how):
        print("ready", flush=True)
        if how == "thread":
            await trio.to_thread.run_sync(time.sleep, 120)  # not cancellable
        else:
            time.sleep(120)  # trio's scheduler never runs again

    try:
        run_until_signal(wedged, sys.argv[2], grace_s=float(sys.argv[1]))
    except BaseException as exc:
        sys.exit(report(exc))
""")


@pytest.fixture
def wedged() -> Iterator[Callable[..., subprocess.Popen[str]]]:
    procs: list[subprocess.Popen[str]] = []

    def start(grace_s: float, how: str = "thread") -> subprocess.Popen[str]:
        proc = subprocess.Popen([sys.executable, "-c", WEDGED, str(grace_s), how], stdout=subprocess.PIPE,
                                stderr=subprocess.PIPE, text=True, start_new_session=True)
        procs.append(proc)
        assert proc.stdout is not None and proc.stdout.readline().strip() == "ready"
        return proc

    yield start
    for proc in procs:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
        proc.communicate(timeout=10)


@pytest.mark.parametrize("how", ["thread", "loop"])
def test_a_wedged_stop_ends_after_the_grace_period(wedged: Callable[..., subprocess.Popen[str]], how: str) -> None:
    proc = wedged(1.0, how)
    t0 = time.monotonic()
    proc.send_signal(signal.SIGTERM)
    _, stderr = proc.communicate(timeout=STOP_BOUND_S)
    assert proc.returncode == 143, stderr
    assert "pcp: error: still stopping 1 s after SIGTERM; exiting anyway" in stderr
    assert time.monotonic() - t0 >= 1.0  # it did wait for a graceful stop first


def test_a_second_signal_forces_exit_at_once(wedged: Callable[..., subprocess.Popen[str]]) -> None:
    proc = wedged(600.0)  # the grace period cannot be what ends it
    proc.send_signal(signal.SIGINT)
    assert proc.stderr is not None
    first = proc.stderr.readline()  # the graceful stop has begun (and hangs)
    assert "SIGINT: stopping" in first, first
    proc.send_signal(signal.SIGINT)
    _, stderr = proc.communicate(timeout=STOP_BOUND_S)
    assert proc.returncode == 130, stderr
    assert "SIGINT again: exiting now" in stderr and "Traceback" not in stderr


# A harness that starts a pcp process and is then SIGKILLed (a CI timeout) before its cleanup.
ORPHANED = textwrap.dedent("""
    import os, subprocess, sys
    from pcp_p2p.core.shutdown import PARENT_ENV
    child = subprocess.Popen([sys.executable, "-c", sys.argv[1]], env={**os.environ, PARENT_ENV: str(os.getpid())})
    print(child.pid, flush=True)
    sys.stdin.read()
""")
FOREVER = textwrap.dedent("""
    import trio
    from pcp_p2p.core.shutdown import run_until_signal
    async def forever():
        print("ready", flush=True)
        await trio.sleep_forever()
    run_until_signal(forever)
""")


@pytest.mark.skipif(not hasattr(os, "pidfd_open"), reason="waits on a pidfd (Linux)")
def test_a_process_whose_harness_was_killed_stops_by_itself() -> None:
    harness = subprocess.Popen([sys.executable, "-c", ORPHANED, FOREVER], stdin=subprocess.PIPE,
                               stdout=subprocess.PIPE, text=True, start_new_session=True)
    assert harness.stdout is not None
    pid = int(harness.stdout.readline())
    fd = os.pidfd_open(pid)
    try:
        assert harness.stdout.readline().strip() == "ready"
        assert select.select([fd], [], [], 0)[0] == []  # running
        harness.kill()
        harness.wait(timeout=10)
        ready, _, _ = select.select([fd], [], [], STOP_BOUND_S)  # readable once the process has ended
        assert ready, "the orphaned process kept running"
    finally:
        os.close(fd)
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
        harness.stdout.close()


def test_only_the_direct_parent_is_watched() -> None:
    """An mpiexec rank inherits the variable from the harness that started mpiexec: its parent is
    the launcher, so it must not take itself for an orphan (it did, and stopped at once)."""
    assert watched_parent("4242", 4242) == 4242
    assert watched_parent("4242", 777) is None  # a launcher in between
    assert watched_parent(None, 4242) is None and watched_parent("x", 4242) is None


# -- a closed stdout is silence --------------------------------------------------------------


@pytest.mark.parametrize("json_flag", [["--json"], []])
def test_status_into_a_closed_pipe_is_silent(bootstrap: Node, json_flag: list[str]) -> None:
    proc = subprocess.Popen([*PCP, "status", *json_flag, "--connect", bootstrap.addr], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, stdin=subprocess.DEVNULL, text=True)
    assert proc.stdout is not None and proc.stderr is not None
    proc.stdout.close()  # `| head -c1` that has already finished: nobody reads what pcp prints
    stderr = proc.stderr.read()
    assert proc.wait(timeout=90) == 141, stderr
    assert stderr == "", stderr


def test_status_into_head_is_silent(bootstrap: Node) -> None:
    res = subprocess.run(f"{' '.join(PCP)} status --json --connect {bootstrap.addr} | head -c1",
                         shell=True, capture_output=True, text=True, timeout=90)
    assert res.stdout == "{" and res.stderr == "", res.stderr


# -- the error path itself, in-process ----------------------------------------------------


def test_exception_groups_are_unwrapped_to_the_cause() -> None:
    inner = ExceptionGroup("node", [ConfigError("no run x found in the swarm's DHT")])
    exc = BaseExceptionGroup("outer", [inner, RuntimeError("teardown noise")])
    assert [type(e) for e in leaves(exc)] == [ConfigError, RuntimeError]
    assert describe(exc.exceptions[0].exceptions[0]) == "no run x found in the swarm's DHT"
    assert exit_code(exc) == 1
    assert exit_code(ExceptionGroup("g", [PeerGone("x")])) == 1
    assert exit_code(BaseExceptionGroup("g", [ValueError("x"), KeyboardInterrupt()])) == 130
    assert exit_code(BaseExceptionGroup("g", [Interrupted(signal.SIGTERM)])) == 143


def test_os_errors_name_the_file_and_the_reason() -> None:
    assert describe(PermissionError(13, "Permission denied", "/var/lib/pcp/identity.key")) == \
        "cannot use /var/lib/pcp/identity.key: permission denied"
    try:
        try:
            raise OSError(98, "Address already in use")
        except OSError as cause:
            raise RuntimeError("failed to start the listener") from cause
    except RuntimeError as wrapped:
        assert describe(wrapped) == "failed to start the listener: address already in use"
    assert describe(TypeError("bad")).startswith("internal error: TypeError: bad")


def test_main_returns_codes_and_prints_one_line(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["status", "--data-dir", str(tmp_path)]) == 1
    err = capsys.readouterr().err
    assert err.count("pcp: error:") == 1 and "no running node" in err


def test_generate_retries_its_lookups_within_the_stated_deadline(tmp_path: Path, bootstrap: Node) -> None:
    assert "--timeout" in pcp("generate", "--help").stdout
    started = time.monotonic()
    res = pcp("generate", "--bootstrap", bootstrap.addr, "--run", "no-such-run", "--data-dir", str(tmp_path),
              "--timeout", "5")
    took = time.monotonic() - started
    line = assert_one_error_line(res)
    assert "no run no-such-run found in the swarm's DHT within 5 s" in line
    progress = [ln for ln in res.stderr.splitlines() if ln.startswith("pcp: looking up run no-such-run")]
    assert len(progress) >= 2 and "(attempt 2," in progress[1], res.stderr[-2000:]  # retried, and said so
    assert took < 5 + 30  # the deadline bounds the lookups; the rest is start-up and shutdown
