"""``pcp run stop`` and ``pcp run status`` over real libp2p on 127.0.0.1.

A bootstrap server and two training nodes run in this process (``swarm3``);
the owner's commands are the real ``pcp`` in subprocesses. No node can compile
(the test capabilities say so), so no shepherd is elected and nothing trains:
what is tested is the run's life on every node, not its rounds.
"""

from __future__ import annotations

import json
import signal
import subprocess
from pathlib import Path

import pytest
import trio
from conftest import TEST_CAPS
from test_cli_errors import DEAD_PEER, assert_one_error_line, bootstrap  # noqa: F401  (bootstrap: a fixture)
from test_cli_errors import Node as PcpProcess
from test_cli_errors import pcp as pcp_sync
from test_run_phase import until

from pcp_p2p.core.errors import PcpError
from pcp_p2p.core.identity import Identity, load_or_create_identity
from pcp_p2p.dht.records import MAX_TTL_S, sign_record
from pcp_p2p.diloco.protocol.lifecycle import STOP_FILE, STOP_KIND, StopOrder, sign_stop, stop_name
from pcp_p2p.diloco.protocol.runs import TrustPolicy
from pcp_p2p.diloco.protocol.spec import SignedRunSpec, parse_spec, run_id_of, sign_spec
from pcp_p2p.diloco.run.training_service import TrainingService, install_training
from pcp_p2p.node.local_swarm import pcp_command
from pcp_p2p.node.node import Node, NodeConfig, open_node

pytestmark = pytest.mark.timeout(240)

SPEC = 'name = "{name}"\n[round]\nrounds = 12\nmin_quorum = 2\n'


async def pcp(*argv: str) -> subprocess.CompletedProcess[str]:
    return await trio.to_thread.run_sync(lambda: subprocess.run(
        [*pcp_command(), *argv], capture_output=True, text=True, timeout=120, stdin=subprocess.DEVNULL))


def one_error_line(res: subprocess.CompletedProcess[str]) -> str:
    errors = [line for line in res.stderr.splitlines() if line.startswith("pcp: error: ")]
    assert res.returncode == 1 and len(errors) == 1 and "Traceback" not in res.stderr, res.stderr[-2000:]
    return errors[0]


async def publish(node: Node, owner: Identity, name: str, to: list[Node]) -> tuple[str, SignedRunSpec]:
    """What `pcp run create` does, in process: the DHT record, then the spec handed to ``to``."""
    signed = sign_spec(parse_spec(SPEC.format(name=name)), owner)
    run_id = run_id_of(signed)
    await node.put_record(sign_record(owner, "run", run_id, signed, ttl_s=MAX_TTL_S))
    for n in to:
        await node.messenger.send(n.peer_id, signed)
    return run_id, signed


async def test_run_stop_ends_the_run_on_every_node_and_only_the_owner_can(swarm3, tmp_path: Path) -> None:
    boot, a, b = swarm3
    owner = load_or_create_identity(tmp_path / "owner")
    services: dict[str, TrainingService] = {
        n.peer_id: install_training(n, TrustPolicy(frozenset({owner.peer_id}))) for n in (a, b)}
    run_id, signed = await publish(boot, owner, "stop-me", [a, b])
    kept_id, _ = await publish(boot, owner, "keep-me", [a, b])
    for n in (a, b):  # both take part, and their member records say so
        await n.wait_until(lambda n=n: all(run_id in m.record.runs for m in n.membership.live()), timeout=30)
    client = ("--bootstrap", boot.addrs()[0], "--wait", "3", "--json")

    status = await pcp("run", "status", "--run", run_id, *client, "--data-dir", str(tmp_path / "viewer"))
    assert status.returncode == 0, status.stderr
    view = json.loads(status.stdout)
    assert (view["owner"], view["round"], view["rounds"], view["committed"]) == (owner.peer_id, 1, 12, 0)
    assert view["members"] == 2 and view["phase"] == "electing"  # nobody here can compile, so no shepherd

    # Not the owner: one line, and nothing published.
    other = await pcp("run", "stop", "--run", run_id, *client, "--data-dir", str(tmp_path / "stranger"))
    assert "is owned by" in one_error_line(other) and "only the owner can stop it" in other.stderr
    assert await boot.get_record(STOP_KIND, stop_name(run_id, owner.peer_id)) is None

    # A stop signed by someone else, sent straight to a node, is refused there and changes nothing.
    stranger = Identity.generate()
    for forged in (sign_stop(stranger, run_id, now=1e9),
                   StopOrder(run_id=run_id, owner=owner.peer_id, issued=1e9,
                             signature=sign_stop(stranger, run_id, now=1e9).signature)):
        with pytest.raises(PcpError):
            await boot.messenger.send(a.peer_id, forged)
    assert not services[a.peer_id].runtimes[run_id].finished.is_set()
    assert any("Signature" in k or "NotOwner" in k for k in a.rejected), a.rejected

    # The owner's stop: every node taking part ends the run.
    stopped = await pcp("run", "stop", "--run", run_id, *client, "--data-dir", str(tmp_path / "owner"),
                        "--reason", "enough")
    assert stopped.returncode == 0, stopped.stderr
    assert json.loads(stopped.stdout)["nodes_reached"] == 2
    for n in (a, b):
        rt = services[n.peer_id].runtimes[run_id]
        with trio.fail_after(10):
            await rt.finished.wait()
        assert rt.phase == "stopped" and rt.status()["phase"] == "stopped" and rt.pins.finished
        assert (rt.work_dir / STOP_FILE).exists()
        await until(n, lambda n=n: run_id not in n.runs, timeout=20)  # no longer advertised
        assert not services[n.peer_id].runtimes[kept_id].finished.is_set()  # the other run goes on

    # A replay of the stop is refused as stale.
    order = await boot.get_record(STOP_KIND, stop_name(run_id, owner.peer_id))
    assert isinstance(order, StopOrder) and order.reason == "enough"
    with pytest.raises(PcpError):
        await boot.messenger.send(a.peer_id, order)

    # A node that was not there when the stop went out finds it in the DHT when it takes the run up.
    late_cfg = NodeConfig(tmp_path / "late", listen=("/ip4/127.0.0.1/tcp/0",), capabilities=TEST_CAPS,
                          op_timeout=2.0, bootstrap=(boot.addrs()[0],))
    async with open_node(late_cfg) as late:
        service = install_training(late, TrustPolicy(frozenset({owner.peer_id})))
        with trio.fail_after(30):
            await late.bootstrapped.wait()
        await boot.messenger.send(late.peer_id, signed)
        with trio.fail_after(60):
            await service.runtimes[run_id].finished.wait()
        assert service.runtimes[run_id].phase == "stopped"

    status = await pcp("run", "status", "--run", run_id, *client, "--data-dir", str(tmp_path / "viewer"))
    assert status.returncode == 0, status.stderr
    assert json.loads(status.stdout)["phase"] == "stopped" and json.loads(status.stdout)["stop_reason"] == "enough"
    # `watch` prints the state once and ends by itself with the run.
    watch = await pcp("run", "watch", "--run", run_id, "--bootstrap", boot.addrs()[0], "--wait", "0",
                      "--data-dir", str(tmp_path / "viewer"))
    assert watch.returncode == 0, watch.stderr
    assert len(watch.stdout.splitlines()) == 1 and " stopped · round 1/12 (0 committed)" in watch.stdout
    # On a run that goes on, `watch` keeps watching until Ctrl+C: exit 130, no traceback.
    # Popen returns once the child is spawned (ASYNC220): its output is read on a thread below.
    watching = subprocess.Popen([*pcp_command(), "run", "watch", "--run", kept_id, "--bootstrap", boot.addrs()[0],  # noqa: ASYNC220
                                 "--wait", "0", "--data-dir", str(tmp_path / "viewer")],
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE, stdin=subprocess.DEVNULL, text=True)
    try:
        assert watching.stdout is not None
        first = await trio.to_thread.run_sync(watching.stdout.readline)
        assert "round 1/12" in first and "members 2/2" in first, first
        watching.send_signal(signal.SIGINT)
        code = await trio.to_thread.run_sync(lambda: watching.wait(timeout=30))
        assert code == 130 and "Traceback" not in watching.stderr.read()  # type: ignore[union-attr]
    finally:
        if watching.poll() is None:
            watching.kill()
            watching.wait(timeout=10)
        for f in (watching.stdout, watching.stderr):
            if f is not None:
                f.close()


# --- the owner's commands' errors: one line each, exit 1 ----------------------------------------

UNKNOWN_RUN = "bafkreiaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaa"
DEAD_BOOTSTRAP = f"/ip4/127.0.0.1/tcp/1/p2p/{DEAD_PEER}"


def _create(tmp: Path, dataset: str) -> list[str]:
    (tmp / "run.toml").write_text(f'name = "x"\n[data]\ndataset = "{dataset}"\n')
    # An unreachable bootstrap: the spec is refused before the network is touched.
    return ["run", "create", str(tmp / "run.toml"), "--bootstrap", DEAD_BOOTSTRAP, "--data-dir", str(tmp)]


CLI_CASES = {
    "run status: unknown run": (lambda tmp, boot: ["run", "status", "--run", UNKNOWN_RUN, "--bootstrap", boot,
                                                   "--data-dir", str(tmp), "--wait", "0"], "not found in the swarm"),
    "run stop: unknown run": (lambda tmp, boot: ["run", "stop", "--run", UNKNOWN_RUN, "--bootstrap", boot,
                                                 "--data-dir", str(tmp), "--wait", "0"], "not found in the swarm"),
    "run watch: bad --every": (lambda tmp, boot: ["run", "watch", "--run", UNKNOWN_RUN, "--every", "0",
                                                  "--bootstrap", boot], "--every must be"),
    "run stop: --reason too long": (lambda tmp, boot: ["run", "stop", "--run", UNKNOWN_RUN, "--reason", "x" * 201,
                                                       "--bootstrap", boot], "--reason is at most 200"),
    "run create: dataset file missing": (lambda tmp, boot: _create(tmp, str(tmp / "nope.txt")),
                                         "run spec: data.dataset: dataset"),
    "run create: dataset folder without .txt": (lambda tmp, boot: _create(tmp, str(tmp)),
                                                "run spec: data.dataset: dataset folder"),
}


@pytest.mark.parametrize("case", list(CLI_CASES))
def test_owner_commands_fail_in_one_line(case: str, bootstrap: PcpProcess, tmp_path: Path) -> None:  # noqa: F811  (the fixture imported above)
    argv, expected = CLI_CASES[case]
    line = assert_one_error_line(pcp_sync(*argv(tmp_path, bootstrap.addr)))
    assert expected in line, line
    assert not (tmp_path / "owned-runs").exists()
