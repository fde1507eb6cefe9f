"""Prometheus metrics: built from a status dict, scraped over HTTP on 127.0.0.1."""

from __future__ import annotations

import json
import re
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
from pcp_p2p.core.errors import ConfigError
from pcp_p2p.node.local_swarm import local_swarm
from pcp_p2p.node.metrics import phase_code, serve_metrics

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
    obj["network"]["local_fault_kinds"] = {"message:ZeroDivisionError": 2}  # our bugs (pcp_p2p.core.faults)
    s = scrape(lambda: obj)
    assert s[("pcp_local_faults_total", (("error", "ZeroDivisionError"), ("kind", "message")))] == 2
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
    run = (("run_id", obj["run"]["run_id"]),)
    assert s[("pcp_run_round", run)] == obj["run"]["round"] == 30  # the last committed round, from 1
    assert s[("pcp_run_loss", run)] == pytest.approx(obj["run"]["loss"])
    assert s[("pcp_run_val_loss", run)] == pytest.approx(obj["run"]["val_loss"])
    assert s[("pcp_run_tokens_per_second", run)] == 41250
    assert s[("pcp_run_outer_lr", run)] == pytest.approx(0.7)
    assert s[("pcp_run_participants", run)] == 4 and s[("pcp_run_quorum", run)] == 3
    assert s[("pcp_run_deadline_seconds", run)] == 87.5
    assert s[("pcp_run_tokens_total", run)] == sum(h["tokens"] for h in obj["run"]["history"])
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
        # /healthz beside them: 503 "starting" until the node has bootstrapped, then 200 with its fields
        with trio.fail_after(30):
            while (health := await trio.to_thread.run_sync(get_health, port))[0] != 200:
                assert health == (503, {**health[1], "status": "starting", "bootstrapped": False})
                await trio.sleep(0.2)
        body = health[1]
        assert body["status"] == "ok" and body["bootstrapped"] is True and body["role"] == "worker"
        assert node.addr.endswith(body["peer_id"]) and body["connected_peers"] >= 1 and body["runs"] == []
        assert body["uptime_s"] >= 0
        assert s[("pcp_node_info", (("peer_id", node.peer_id), ("role", "worker"), ("version", "0.1.0")))] == 1
        assert s[("pcp_members", ())] >= 1 and ("pcp_routing_table_size", ()) in s
        # SIGTERM stops the exporter with the node
        await swarm.kill(node, 15)
        assert node.process is not None and node.process.returncode == 0
        with pytest.raises(urllib.error.URLError):
            await trio.to_thread.run_sync(get, f"http://127.0.0.1:{port}/metrics")


# -- run metrics: run_id on every series, phase as a value ------------------------------


def run_series(samples: Samples) -> set[tuple[str, tuple[tuple[str, str], ...]]]:
    return {key for key in samples if key[0].startswith("pcp_run_")}


def test_run_metrics_carry_run_id_and_phase_changes_no_series() -> None:
    obj = snapshot("run")
    run_id = obj["run"]["run_id"]
    seen: list[Samples] = []
    for phase in ("compiling", "training", "submitted", "training (shepherd lost)", "finished"):
        obj["run"]["phase"] = phase
        seen.append(scrape(lambda: obj))
    series = run_series(seen[0])
    assert series and all(run_series(s) == series for s in seen)  # the same series in every phase
    assert all(("run_id", run_id) in labels for _, labels in series)
    assert not any(name == "phase" for _, labels in series for name, _ in labels)
    run = (("run_id", run_id),)
    assert [s[("pcp_run_phase", run)] for s in seen] == [4, 8, 9, 8, 10]
    assert [s[("pcp_run_shepherd_lost", run)] for s in seen] == [0, 0, 0, 1, 0]
    assert seen[0][("pcp_run_info", (("name", obj["run"].get("name") or ""), ("owner", obj["run"].get("owner") or ""),
                                     ("run_id", run_id)))] == 1
    assert seen[0][("pcp_run_shepherd_info", (("run_id", run_id), ("shepherd", obj["run"]["shepherd"])))] == 1


@pytest.mark.parametrize(("phase", "code"), [
    ("starting", 1), ("joining", 2), ("electing", 3), ("compiling", 4), ("waiting for quorum", 5),
    ("idle", 6), ("idle: no allowed target for this machine", 6), ("fetching", 7), ("training", 8),
    ("submitted", 9), ("finished", 10), ("stopped: ConfigError: no dataset", 11), ("failed: bad dataset", 12),
    ("Training (shepherd lost)", 8), ("something new", 0), ("", 0), (None, 0), (3, 0),
])
def test_phase_codes(phase: Any, code: int) -> None:
    assert phase_code(phase) == code


def test_every_worker_phase_has_a_code() -> None:
    from pcp_p2p.diloco.protocol.worker import WorkerPhase

    assert all(phase_code(p.value) > 0 for p in WorkerPhase)


# -- GET /healthz ---------------------------------------------------------------------


def get_health(port: int) -> tuple[int, dict[str, Any]]:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/healthz", timeout=10) as resp:
            assert resp.headers["Content-Type"] == "application/json"
            return resp.status, json.loads(resp.read())
    except urllib.error.HTTPError as exc:
        with exc:
            return exc.code, json.loads(exc.read())


HEALTHY = {"peer_id": "12D3KooWtest", "role": "worker", "uptime_s": 12.5, "bootstrapped": True,
           "connected_peers": 3, "runs": ["bafkreirun"]}


@pytest.mark.parametrize(("health", "code", "status"), [
    (lambda: HEALTHY, 200, "ok"),
    (lambda: {**HEALTHY, "bootstrapped": False}, 503, "starting"),
    (lambda: 1 / 0, 503, "down"),
    (None, 404, "unknown"),
])
def test_healthz_over_http(health: Callable[[], Mapping[str, Any]] | None, code: int, status: str) -> None:
    server = serve_metrics(0, lambda: snapshot("worker_idle"), health_fn=health)
    try:
        got_code, body = get_health(server.port)
        assert (got_code, body["status"]) == (code, status)
        if code == 200:
            assert {k: body[k] for k in HEALTHY} == HEALTHY
        if status == "down":
            assert "division by zero" in body["error"]
        # the metrics are still served beside it
        assert parse(get(f"http://127.0.0.1:{server.port}/metrics"))[("pcp_status_up", ())] == 1
    finally:
        server.close()


@pytest.mark.timeout(120)
def test_a_node_whose_bootstrap_never_answers_is_503_starting(tmp_path: Path) -> None:
    from test_cli_errors import Node

    from pcp_p2p.core.identity import Identity

    port = free_port()
    dead = f"/ip4/127.0.0.1/tcp/1/p2p/{Identity.generate().peer_id}"
    node = Node("node", "join", "--bootstrap", dead, "--listen", "/ip4/127.0.0.1/tcp/0", "--data-dir", str(tmp_path),
                "--metrics-port", str(port))  # returns once the node listens, the exporter already up
    try:
        code, body = get_health(port)
        assert (code, body["status"], body["bootstrapped"]) == (503, "starting", False)
        assert node.addr.endswith(body["peer_id"]) and body["runs"] == []
    finally:
        node.stop()


def test_the_grafana_dashboard_asks_only_for_metrics_a_node_exports() -> None:
    from pcp_p2p.node.metrics import PHASE_CODES

    dash = json.loads((Path(__file__).parent.parent / "examples" / "grafana-dashboard.json").read_text())
    exprs = [t["expr"] for p in dash["panels"] for t in p["targets"]]
    exprs += [v["query"] for v in dash["templating"]["list"] if v["type"] == "query"]
    asked = {name for e in exprs for name in re.findall(r"\bpcp_[a-z_]+", e)}
    obj = snapshot("run")
    obj["run"]["is_shepherd"] = True  # reported by RunRuntime.status; the recorded fixture predates it
    exported = names(scrape(lambda: obj))
    assert asked and asked <= exported, f"not exported: {sorted(asked - exported)}"
    phases = next(p for p in dash["panels"] if "pcp_run_phase" in p["targets"][0]["expr"])
    mapped = {int(k) for m in phases["fieldConfig"]["defaults"]["mappings"] for k in m["options"]}
    assert mapped == {0, *PHASE_CODES.values()}
