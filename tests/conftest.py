"""Shared fixtures."""

from __future__ import annotations

import traceback
from collections.abc import AsyncIterator
from contextlib import AsyncExitStack, asynccontextmanager
from pathlib import Path

import pytest
import trio

from pcp_p2p.core import logs
from pcp_p2p.net.capabilities import Capabilities

logs.configure("INFO")

# Capabilities measured once: probing (a short matmul benchmark) in every test node adds up.
TEST_CAPS = Capabilities(("local-task",), "test-cpu", "x86_64", ("avx2",), 2, 1 << 30, (), 1.0, {"pcp": "test"}, False)


@pytest.fixture
def caps() -> Capabilities:
    return TEST_CAPS


@pytest.fixture
async def swarm3(tmp_path: Path) -> AsyncIterator[tuple]:
    """A bootstrap server and two workers in this process, over real libp2p on 127.0.0.1."""
    from pcp_p2p.node.node import NodeConfig, open_node

    def cfg(name: str, **kw: object) -> NodeConfig:
        return NodeConfig(tmp_path / name, listen=("/ip4/127.0.0.1/tcp/0",), capabilities=TEST_CAPS,
                          op_timeout=2.0, **kw)  # type: ignore[arg-type]  # kw: any other NodeConfig field

    async with _origin_named(), AsyncExitStack() as stack:
        boot = await stack.enter_async_context(open_node(cfg("boot", role="bootstrap")))
        a = await stack.enter_async_context(open_node(cfg("a", bootstrap=(boot.addrs()[0],))))
        b = await stack.enter_async_context(open_node(cfg("b", bootstrap=(boot.addrs()[0],))))
        ids = {a.peer_id, b.peer_id}
        for n in (a, b):
            await n.wait_until(lambda n=n: {m.record.peer_id for m in n.membership.live()} == ids, timeout=30)
        yield boot, a, b


@asynccontextmanager
async def _origin_named() -> AsyncIterator[None]:
    """A failure while nodes stop arrives as an exception group nested a dozen deep (every
    py-libp2p service is a nursery), and the test summary names only the leaf's type: this
    names the frames it was raised in too, so a rare teardown race can be traced from one line."""
    try:
        yield
    except BaseExceptionGroup as group:
        leaf: BaseException = group
        while isinstance(leaf, BaseExceptionGroup):
            leaf = leaf.exceptions[0]
        if isinstance(leaf, trio.Cancelled):
            raise
        frames = traceback.extract_tb(leaf.__traceback__)[-4:]
        where = " < ".join(f"{Path(f.filename).name}:{f.lineno} {f.name}" for f in reversed(frames))
        raise AssertionError(f"raised at {where} while the swarm stopped: {leaf!r}") from group
