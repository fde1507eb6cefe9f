"""Prometheus metrics: built from a status dict, scraped over HTTP on 127.0.0.1."""

from __future__ import annotations

import json
import socket
import urllib.error
import urllib.request
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import pytest
import trio
from prometheus_client.parser import text_string_to_metric_families

from pcp_p2p.cli import build_parser
from pcp_p2p.errors import ConfigError
from pcp_p2p.node.local_swarm import local_swarm
from pcp_p2p.node.metrics import serve_metrics

FIXTURES = Path(__file__).parent / "fixtures"


def snapshot(name: str) -> dict[str, Any]:
    return json.loads((FIXTURES / f"status_{name}.json").read_text())


def get(url: str) -> str:
    with urllib.request.urlopen(url, timeout=10) as resp:
        assert resp.status == 200
        return resp.read().decode()


Samples = dict[tuple[str, tuple[tuple[str, str], ...]], float]


def parse(text: str) -> Samples:
    out: Samples = {}
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            out[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return out


def scrape(status_fn: Callable[[], Mapping[str, Any]]) -> Samples:
    server = serve_metrics(0, status_fn)
    try:
        assert server.host == "127.0.0.1" and server.port > 0
        return parse(get(f"http://127.0.0.1:{server.port}/metrics"))
    finally:
        server.close()


def names(samples: Samples) -> set[str]:
    return {name for name, _ in samples}


def test_full_status_over_http() -> None:
    obj = snapshot("run")
    s = scrape(lambda: obj)
    assert s[("pcp_status_up", ())] == 1
    assert s[("pcp_node_info", (("peer_id", obj["peer_id"]), ("role", "worker"), ("version", "0.1.0")))] == 1
    assert s[("pcp_members", ())] == 7
    assert s[("pcp_members_by_state", (("state", "training"),))] == 5
    assert s[("pcp_connected_peers", ())] == 6
    assert s[("pcp_network_received_bytes_total", ())] == 1873920512
    assert s[("pcp_network_sent_bytes_total", ())] == 412983296
    assert s[("pcp_rejected_inputs_total", (("kind", "heartbeat"), ("reason", "StaleMessage")))] == 12
    assert s[("pcp_store_used_bytes", ())] == obj["storage"]["used_bytes"]
    assert s[("pcp_store_max_bytes", ())] == 10737418240 and s[("pcp_store_pinned_blobs", ())] == 9
    # submissions: accepted = participants of committed rounds; rejected from network.rejected
    accepted = sum(h["participants"] for h in obj["run"]["history"])
    assert s[("pcp_submissions_total", (("outcome", "accepted"), ("reason", "")))] == accepted
    assert s[("pcp_submissions_total", (("outcome", "rejected"), ("reason", "RejectedUpdate")))] == 2
    assert s[("pcp_run_round", ())] == obj["run"]["round"] == 30  # the last committed round, from 1
    assert s[("pcp_run_loss", ())] == pytest.approx(obj["run"]["loss"])
    assert s[("pcp_run_val_loss", ())] == pytest.approx(obj["run"]["val_loss"])
    assert s[("pcp_run_tokens_per_second", ())] == 41250
    assert s[("pcp_run_outer_lr", ())] == pytest.approx(0.7)
    assert s[("pcp_run_participants", ())] == 4 and s[("pcp_run_quorum", ())] == 3
    assert s[("pcp_run_deadline_seconds", ())] == 87.5
    assert s[("pcp_run_tokens_total", ())] == sum(h["tokens"] for h in obj["run"]["history"])
    assert s[("pcp_shepherd_term", ())] == 4
    assert s[("pcp_shepherd_lease_expires_seconds", ())] == 42
    assert s[("pcp_shepherd_terms_ended_total", (("ended", "failover"),))] == 1
    assert s[("pcp_shepherd_terms_ended_total", (("ended", "rotation"),))] == 2
    hit = ("pcp_artifact_bytes", (("cache_hit", "1"), ("cid", obj["artifacts"][0]["cid"]), ("target", "cpu-x86_64-v4")))
    assert s[hit] == obj["artifacts"][0]["size"]


@pytest.mark.parametrize("name", ["worker_idle", "nulls"])
def test_no_run_means_no_run_metrics(name: str) -> None:
    s = scrape(lambda: snapshot(name))
    assert s[("pcp_status_up", ())] == 1 and s[("pcp_members", ())] == 2
    assert not {n for n in names(s) if n.startswith(("pcp_run_", "pcp_shepherd_", "pcp_submissions"))}
    assert "pcp_network_received_bytes_total" not in names(s)  # not reported by this node: absent, not 0
    assert "pcp_store_used_bytes" not in names(s)


def test_run_counters_from_run_fields_win() -> None:
    obj = snapshot("run")
    obj["run"]["accepted"] = 99
    obj["run"]["rejected"] = {"StaleMessage": 3}
    s = scrape(lambda: obj)
    assert s[("pcp_submissions_total", (("outcome", "accepted"), ("reason", "")))] == 99
    assert s[("pcp_submissions_total", (("outcome", "rejected"), ("reason", "StaleMessage")))] == 3


def test_a_failing_status_fn_gives_up_0_not_a_failed_scrape() -> None:
    def boom() -> Mapping[str, Any]:
        raise trio.RunFinishedError("node stopped")

    assert scrape(boom) == {("pcp_status_up", ()): 0.0}
    assert scrape(lambda: ["not", "a", "dict"]) == {("pcp_status_up", ()): 0.0}  # type: ignore[arg-type,return-value]


def test_bad_ports_are_config_errors() -> None:
    with pytest.raises(ConfigError):
        serve_metrics(70000, dict)
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        with pytest.raises(ConfigError, match="cannot serve metrics"):
            serve_metrics(taken.getsockname()[1], dict)


def test_node_commands_have_the_metrics_flags() -> None:
    parser = build_parser()
    for argv in (["node", "join"], ["bootstrap"]):
        args = parser.parse_args([*argv, "--metrics-port", "9101", "--log-json"])
        assert args.metrics_port == 9101 and args.metrics_host == "127.0.0.1" and args.log_json
        assert parser.parse_args(argv).metrics_port is None  # off by default


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@pytest.mark.timeout(120)
async def test_a_node_started_with_metrics_port_serves_them(tmp_path: Path) -> None:
    port = free_port()
    async with local_swarm(tmp_path) as swarm:
        await swarm.start_bootstrap()
        # The node prints its address only once the exporter is up: no waiting needed.
        node = await swarm.add_worker(["--metrics-port", str(port)])
        s = parse(await trio.to_thread.run_sync(get, f"http://127.0.0.1:{port}/metrics"))
        assert s[("pcp_status_up", ())] == 1
        assert s[("pcp_node_info", (("peer_id", node.peer_id), ("role", "worker"), ("version", "0.1.0")))] == 1
        assert s[("pcp_members", ())] >= 1 and ("pcp_routing_table_size", ()) in s
        # SIGTERM stops the exporter with the node
        await swarm.kill(node, 15)
        assert node.process is not None and node.process.returncode == 0
        with pytest.raises(urllib.error.URLError):
            await trio.to_thread.run_sync(get, f"http://127.0.0.1:{port}/metrics")
