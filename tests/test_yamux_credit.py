"""go-yamux's credit rule (pcp_p2p/net/yamux_credit.py): fewer frames, flow control intact."""

from __future__ import annotations

import multiaddr
import trio
from libp2p import new_host
from libp2p.custom_types import TProtocol
from libp2p.peer.peerinfo import info_from_p2p_addr
from libp2p.stream_muxer.yamux import yamux

from pcp_p2p.core.identity import Identity
from pcp_p2p.net import yamux_credit

PROTO = TProtocol("/pcp-test/sink/1")
LISTEN = [multiaddr.Multiaddr("/ip4/127.0.0.1/tcp/0")]


async def _transfer(total: int, read_size: int) -> int:
    """Send ``total`` bytes over one stream, read ``read_size`` at a time; return WINDOW_UPDATE frames sent."""
    updates = 0
    original = yamux.YamuxStream.send_window_update

    async def counting(self, increment, skip_lock=False):  # type: ignore[no-untyped-def]
        nonlocal updates
        updates += 1
        await original(self, increment, skip_lock=skip_lock)

    got = trio.Event()
    received = 0

    async def sink(stream) -> None:  # type: ignore[no-untyped-def]
        nonlocal received
        while received < total:
            chunk = await stream.read(read_size)
            if not chunk:
                break
            received += len(chunk)
        await stream.close()
        got.set()

    a, b = new_host(key_pair=Identity.generate().key_pair), new_host(key_pair=Identity.generate().key_pair)
    yamux.YamuxStream.send_window_update = counting  # type: ignore[method-assign]
    try:
        async with a.run(listen_addrs=LISTEN), b.run(listen_addrs=LISTEN):
            b.set_stream_handler(PROTO, sink)
            await a.connect(info_from_p2p_addr(multiaddr.Multiaddr(f"{b.get_addrs()[0]}")))
            stream = await a.new_stream(b.get_id(), [PROTO])
            with trio.fail_after(60):
                for _ in range(total // 65536):
                    await stream.write(b"x" * 65536)
                await got.wait()
            await stream.close()
    finally:
        yamux.YamuxStream.send_window_update = original  # type: ignore[method-assign]
    assert received == total
    return updates


async def test_a_transfer_far_beyond_the_window_completes_with_credit_in_halves() -> None:
    yamux_credit.install()
    try:
        # 4 MiB through a 256 KiB initial window, read in small pieces: a sender
        # starved of credit would hang here (fail_after).
        updates = await _transfer(4 << 20, 4096)
    finally:
        yamux_credit.uninstall()
    assert 0 < updates < 200  # credit in large grants, not one per 4 KiB read


async def test_small_reads_cost_a_window_update_each_without_it() -> None:
    yamux_credit.uninstall()
    assert not yamux_credit.installed()
    updates = await _transfer(1 << 20, 4096)
    assert updates >= 200  # py-libp2p's own rule: about one per read (256 reads)
