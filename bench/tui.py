"""What one refresh of ``pcp status`` costs: fetch, render, metrics scrape.

The TUI refreshes every second on a machine that is also running a node (2
cores here), so a frame has to be cheap next to that second. Measured:

- **render**: one full 80x24 frame of the dashboard (cache invalidated first,
  as a refresh does), from a status dict scaled up to a large swarm: 200
  members, 1000 committed rounds in the chart, 40 artifacts, 30 shepherd terms;
  also at 200x60;
- **baseline** in the same run: ``render_text``, the plain-text summary that
  ``pcp status`` prints into a pipe, on the same dict — the floor for turning
  the JSON into something a person reads;
- **metrics**: building the Prometheus exposition from the same dict, and a
  scrape over HTTP on 127.0.0.1;
- **fetch**: one ``fetch_status`` round trip to a live node in this process on
  127.0.0.1 (throwaway host per call, as the TUI does every second).

    .venv/bin/python bench/tui.py [--frames 200] [--fetches 10]
"""

from __future__ import annotations

import argparse
import copy
import json
import statistics
import tempfile
import time
import urllib.request
from pathlib import Path
from typing import Any

import trio

ROOT = Path(__file__).resolve().parents[1]
TARGET_MS = 50.0  # a frame must stay far below the 1 s refresh period


def big_status(members: int = 200, rounds: int = 1000, artifacts: int = 40, terms: int = 30) -> dict[str, Any]:
    obj: dict[str, Any] = json.loads((ROOT / "tests/fixtures/status_run.json").read_text())
    proto = obj["members"]
    obj["members"] = []
    for i in range(members):
        m = copy.deepcopy(proto[i % len(proto)])
        m["peer_id"] = m["peer_id"][:-6] + f"{i:06d}"
        obj["members"].append(m)
    hist = obj["run"]["history"]
    obj["run"]["history"] = [
        {**hist[i % len(hist)], "round": i + 1, "loss": 4.0 / (1 + i / 50) + 1.4, "val_loss": 4.0 / (1 + i / 50) + 1.5}
        for i in range(rounds)
    ]
    obj["artifacts"] = [dict(obj["artifacts"][i % len(obj["artifacts"])], target=f"t{i}") for i in range(artifacts)]
    obj["shepherd_history"] = [
        {"term": t, "holder": obj["members"][t % members]["peer_id"], "rounds_served": 8, "ended": "rotation"}
        for t in range(1, terms + 1)
    ]
    obj["network"]["rejected"] = {f"heartbeat:Reason{i}": i for i in range(20)}
    return obj


def timed(fn: Any, n: int) -> list[float]:
    out = []
    for _ in range(n):
        t0 = time.perf_counter()
        fn()
        out.append(time.perf_counter() - t0)
    return out


def ms(x: float) -> float:
    return round(x * 1000, 3)


def p95(xs: list[float]) -> float:
    return sorted(xs)[int(0.95 * (len(xs) - 1))]


async def fetch_times(n: int) -> list[float]:
    from pcp_p2p.core import logs
    from pcp_p2p.net.capabilities import Capabilities
    from pcp_p2p.node.node import NodeConfig, open_node
    from pcp_p2p.node.status import fetch_status

    logs.configure("WARNING")
    caps = Capabilities(("local-task",), "bench-cpu", "x86_64", (), 2, 1 << 30, (), 1.0, {}, False)
    out = []
    with tempfile.TemporaryDirectory() as tmp:
        async with open_node(NodeConfig(Path(tmp), listen=("/ip4/127.0.0.1/tcp/0",), capabilities=caps)) as node:
            addr = node.addrs()[0]
            await fetch_status(addr, timeout=10)  # warm-up
            for _ in range(n):
                t0 = time.perf_counter()
                await fetch_status(addr, timeout=10)
                out.append(time.perf_counter() - t0)
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--frames", type=int, default=200)
    ap.add_argument("--fetches", type=int, default=10)
    args = ap.parse_args()

    from prometheus_client import generate_latest

    from pcp_p2p.commands.node_commands import render_text
    from pcp_p2p.node.metrics import build_registry, serve_metrics
    from pcp_p2p.tui.fmt import UNICODE, Style
    from pcp_p2p.tui.view import StatusView

    obj = big_status()
    view = StatusView("/ip4/127.0.0.1/tcp/4001/p2p/x", Style(256, UNICODE))
    view.apply_status(obj)

    def frame(size: tuple[int, int]) -> None:
        view.refresh()
        view.render(size)

    frame((80, 24))  # warm-up
    render = timed(lambda: frame((80, 24)), args.frames)
    render_big = timed(lambda: frame((200, 60)), args.frames // 2)
    baseline = timed(lambda: render_text(obj), args.frames)
    registry = build_registry(lambda: obj)
    expo = timed(lambda: generate_latest(registry), args.frames // 2)
    server = serve_metrics(0, lambda: obj)
    try:
        url = f"http://127.0.0.1:{server.port}/metrics"
        scrape = timed(lambda: urllib.request.urlopen(url, timeout=10).read(), 30)
    finally:
        server.close()
    fetch = trio.run(fetch_times, args.fetches)

    med = statistics.median(render)
    base = statistics.median(baseline)
    print(json.dumps({
        "headline": ms(med),
        "target": TARGET_MS,
        "better": "lower",
        "unit": "ms per 80x24 frame (200 members, 1000 rounds)",
        "render_80x24_median_ms": ms(med),
        "render_80x24_p95_ms": ms(p95(render)),
        "render_200x60_median_ms": ms(statistics.median(render_big)),
        "baseline_render_text_median_ms": ms(base),
        "render_vs_baseline": round(med / base, 1),
        "metrics_exposition_median_ms": ms(statistics.median(expo)),
        "metrics_http_scrape_median_ms": ms(statistics.median(scrape)),
        "fetch_status_median_ms": ms(statistics.median(fetch)),
        "fetch_status_p95_ms": ms(p95(fetch)),
        "frame_share_of_refresh_period": round(med / 1.0, 4),
        "frames": args.frames,
        "fetches": args.fetches,
    }))


if __name__ == "__main__":
    main()
