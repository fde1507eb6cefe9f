"""The phase a run shows while it cannot train yet, over real libp2p on 127.0.0.1.

A run whose dataset the elected shepherd cannot read used to show ``round 0 idle``
everywhere while the shepherd retried; now the shepherd shows ``set-up failed: …``
and so does every worker (from the shepherd's member record), and a run short of
its quorum says so.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from contextlib import AsyncExitStack
from pathlib import Path

import pytest
import trio
from conftest import TEST_CAPS

from pcp_p2p.core.identity import Identity
from pcp_p2p.dht.records import MAX_TTL_S, sign_record
from pcp_p2p.diloco.protocol.runs import TrustPolicy
from pcp_p2p.diloco.protocol.spec import parse_spec, run_id_of, sign_spec
from pcp_p2p.diloco.run.training_service import install_training
from pcp_p2p.node.node import Node, NodeConfig, open_node

pytestmark = pytest.mark.timeout(180)

LOOK_EVERY_S = 0.5


async def until(node: Node, predicate: Callable[[], bool], timeout: float) -> None:
    """Wait until ``predicate`` holds: on the node's membership events, and every LOOK_EVERY_S too.

    A runtime's own state (its phase, the runs a node lists) changes without any
    event a test can wait on, so a membership event alone may come too early.
    """
    with trio.fail_after(timeout):
        while not predicate():
            with trio.move_on_after(LOOK_EVERY_S):
                await node.wait_until(predicate, timeout + LOOK_EVERY_S)


async def test_a_dataset_the_shepherd_cannot_read_shows_as_the_runs_phase_everywhere(tmp_path: Path) -> None:
    owner = Identity.generate()
    compiler = dataclasses.replace(TEST_CAPS, can_compile=True)

    def cfg(name: str, caps=TEST_CAPS, **kw: object) -> NodeConfig:  # type: ignore[no-untyped-def]
        return NodeConfig(tmp_path / name, listen=("/ip4/127.0.0.1/tcp/0",), capabilities=caps, op_timeout=2.0, **kw)  # type: ignore[arg-type]

    async with AsyncExitStack() as stack:
        boot = await stack.enter_async_context(open_node(cfg("boot", role="bootstrap")))
        lead = await stack.enter_async_context(open_node(cfg("lead", compiler, bootstrap=(boot.addrs()[0],))))
        work = await stack.enter_async_context(open_node(cfg("work", bootstrap=(boot.addrs()[0],))))
        for n in (lead, work):
            await n.wait_until(lambda n=n: len(n.membership.live()) == 2, timeout=30)
        services = {n.peer_id: install_training(n, TrustPolicy(frozenset({owner.peer_id}))) for n in (lead, work)}

        # Signed here, past `pcp run create`'s own dataset check (a spec from an older client, or a
        # path that exists on the owner's machine only).
        missing = tmp_path / "not-here.txt"
        signed = sign_spec(parse_spec(
            f'name = "bad-data"\n[data]\ndataset = "{missing}"\n[round]\nmin_quorum = 2\n'
            '[election]\nmin_uptime_s = 0.0\n'), owner)
        run_id = run_id_of(signed)
        await boot.put_record(sign_record(owner, "run", run_id, signed, ttl_s=MAX_TTL_S))
        for n in (lead, work):
            await boot.messenger.send(n.peer_id, signed)

        worker_rt = services[work.peer_id].runtimes[run_id]
        # The worker learns it from the shepherd's member record, once it follows that shepherd.
        await until(work, lambda: worker_rt.status()["phase"].startswith("set-up failed:"), timeout=90)
        shown = worker_rt.status()["phase"]
        assert "not-here.txt" in shown and worker_rt.status()["shepherd"] == lead.peer_id, shown
        lead_phase = services[lead.peer_id].runtimes[run_id].status()["phase"]
        assert lead_phase.startswith("set-up failed:") and "not-here.txt" in lead_phase
        assert worker_rt.status()["round"] == 0 and "idle" not in shown


async def test_a_run_short_of_its_quorum_says_so(swarm3) -> None:
    boot, a, b = swarm3
    owner = Identity.generate()
    services = {n.peer_id: install_training(n, TrustPolicy(frozenset({owner.peer_id}))) for n in (a, b)}
    signed = sign_spec(parse_spec('name = "three"\n[round]\nmin_quorum = 3\n'), owner)
    run_id = run_id_of(signed)
    for n in (a, b):
        await boot.messenger.send(n.peer_id, signed)
    rt = services[a.peer_id].runtimes[run_id]
    # Both nodes take part (their member records list the run): 2 of the 3 the quorum needs.
    await until(a, lambda: rt.status()["phase"] == "waiting for quorum (2/3)", timeout=30)
    assert rt.status()["members"] == 2
