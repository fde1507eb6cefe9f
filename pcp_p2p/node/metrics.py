"""Prometheus metrics for a node, built from its status JSON.

Why from the status dict and not from counters sprinkled through the code:
``pcp status --json`` is already the one place where a node says what it
knows, and other parts of PCP (DiLoCo rounds, shepherd leases, artifacts) add
their sections to it. A collector that reads the same dict at scrape time
exports every section the moment it appears, with no second bookkeeping that
could drift from what ``pcp status`` shows. Sections a node does not have yet
(no run, no lease) simply produce no samples.

Scrapes happen on the exporter's HTTP thread; ``status_fn`` is called there,
so a node passes a function that hops into its trio thread
(``trio.from_thread.run_sync`` with the run's token, see
``pcp_p2p.commands.node_commands._serve``). A ``status_fn`` that raises gives
``pcp_status_up 0`` instead of a failed scrape.

The same server answers ``GET /healthz`` (:func:`health_reply`): 200 and a
small JSON object when the node is up and bootstrapped, 503 otherwise, for
load balancers, container health checks and service managers that want a
yes/no rather than a scrape.

Run metrics carry a ``run_id`` label, and the run's phase is a value
(``pcp_run_phase``, codes in :data:`PHASE_CODES`) rather than a label, so a
run has the same few series from its first round to its last.

Metric names are listed in ``docs/tui.md``.
"""

from __future__ import annotations

import json
import logging
import math
import socket
import threading
from collections import Counter, defaultdict
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass
from http import HTTPStatus
from socketserver import ThreadingMixIn
from typing import Any
from wsgiref.simple_server import WSGIRequestHandler, WSGIServer, make_server

from prometheus_client import CollectorRegistry, make_wsgi_app
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from pcp_p2p.core.errors import ConfigError

log = logging.getLogger("pcp.metrics")

PREFIX = "pcp"
# network.rejected keys are "<what>:<ErrorClass>"; these <what>s are submitted updates.
SUBMISSION_KINDS = frozenset({"submission", "submit", "update", "delta", "pseudo_gradient"})
StatusFn = Callable[[], Mapping[str, Any]]
HealthFn = Callable[[], Mapping[str, Any]]
HEALTH_PATH = "/healthz"

# pcp_run_phase's values, by the first word of the run's phase ("idle: no allowed
# target" is idle, "stopped: <why>" stopped). 0 is any phase not listed here.
# Append new codes; never renumber (dashboards and alerts compare these numbers).
PHASE_CODES: dict[str, int] = {
    "starting": 1,
    "joining": 2,
    "electing": 3,
    "compiling": 4,
    "waiting": 5,  # waiting for quorum
    "idle": 6,
    "fetching": 7,
    "training": 8,
    "submitted": 9,
    "finished": 10,
    "stopped": 11,
    "failed": 12,
    "error": 12,
}
SHEPHERD_LOST = "(shepherd lost)"


def phase_code(phase: Any) -> int:
    """``pcp_run_phase``'s value for a status ``run.phase`` string (0: unknown)."""
    if not isinstance(phase, str) or not phase.strip():
        return 0
    word = phase.strip().split()[0].rstrip(":,;").lower()
    return PHASE_CODES.get(word, 0)


def _num(value: Any) -> float | None:
    """A finite number from a status field, or None (absent, null, a string, NaN)."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return None
    f = float(value)
    return f if math.isfinite(f) else None


def _section(obj: Mapping[str, Any], name: str) -> Mapping[str, Any]:
    value = obj.get(name)
    return value if isinstance(value, Mapping) else {}


def _split_reason(key: str) -> tuple[str, str]:
    what, sep, reason = str(key).partition(":")
    return (what, reason) if sep else ("", what)


class StatusCollector(Collector):
    """A prometheus_client collector that turns one status dict into metric families."""

    def __init__(self, status_fn: StatusFn) -> None:
        self.status_fn = status_fn

    def collect(self) -> Iterator[Metric]:
        try:
            obj = self.status_fn()
            if not isinstance(obj, Mapping):
                raise TypeError(f"status_fn returned {type(obj).__name__}, not a mapping")
        except Exception as exc:  # a scrape must never fail: report "down" instead
            log.debug("status for metrics failed: %s", exc)
            yield _gauge("status_up", "1 if the node answered its status for this scrape", 0.0)
            return
        yield _gauge("status_up", "1 if the node answered its status for this scrape", 1.0)
        yield from families(obj)


def _gauge(name: str, doc: str, value: float | None = None, labels: tuple[str, ...] = ()) -> GaugeMetricFamily:
    if labels:
        return GaugeMetricFamily(f"{PREFIX}_{name}", doc, labels=list(labels))
    return GaugeMetricFamily(f"{PREFIX}_{name}", doc, value=value if value is not None else 0.0)


def families(obj: Mapping[str, Any]) -> Iterator[Metric]:
    """The metric families for one status dict (pure: easy to test without HTTP)."""
    info = _gauge("node_info", "constant 1, labelled with the node's identity", labels=("peer_id", "role", "version"))
    info.add_metric([str(obj.get("peer_id", "")), str(obj.get("role", "")), str(obj.get("version", ""))], 1.0)
    yield info
    if (v := _num(obj.get("uptime_s"))) is not None:
        yield _gauge("uptime_seconds", "seconds since the node started", v)
    caps = _section(obj, "capabilities")
    if (v := _num(caps.get("throughput_gflops"))) is not None:
        yield _gauge("throughput_gflops", "measured fp32 matmul rate of this node", v)
    group = _section(obj, "group")  # rank 0 of an MPI worker group (docs/clusters.md)
    if (v := _num(group.get("live"))) is not None:
        yield _gauge("group_ranks", "live ranks of this node's MPI worker group", v)
    if (v := _num(group.get("gflops"))) is not None:
        yield _gauge("group_gflops", "summed matmul rate of the worker group's live ranks", v)

    members = obj.get("members")
    if isinstance(members, list):
        yield _gauge("members", "live members in this node's view (itself included)", float(len(members)))
        by_state: Counter[str] = Counter()
        for m in members:
            if isinstance(m, Mapping):
                by_state[str(m.get("state") or m.get("role") or "unknown")] += 1
        fam = _gauge("members_by_state", "live members by state (role where no state is reported)", labels=("state",))
        for state, n in sorted(by_state.items()):
            fam.add_metric([state], float(n))
        yield fam

    yield from _network(_section(obj, "network"), obj)
    yield from _storage(_section(obj, "storage"))
    yield from _run(_section(obj, "run"))
    yield from _shepherd(obj)
    yield from _artifacts(obj.get("artifacts"))


def _storage(store: Mapping[str, Any]) -> Iterator[Metric]:
    for key, doc in (
        ("used_bytes", "bytes of blobs in this node's store"),
        ("max_bytes", "the store's size limit"),
        ("pinned_bytes", "bytes of pinned blobs (never evicted)"),
        ("blobs", "blobs in the store"),
        ("pinned_blobs", "pinned blobs in the store"),
    ):
        if (v := _num(store.get(key))) is not None:
            yield _gauge(f"store_{key}", doc, v)


def _network(net: Mapping[str, Any], obj: Mapping[str, Any]) -> Iterator[Metric]:
    for key, name, doc in (
        ("connected_peers", "connected_peers", "open libp2p connections"),
        ("routing_table_size", "routing_table_size", "peers in the Kademlia routing table"),
    ):
        if (v := _num(net.get(key))) is not None:
            yield _gauge(name, doc, v)
    for key, name, doc in (
        ("bytes_in", "network_received_bytes", "bytes received by this node"),
        ("bytes_out", "network_sent_bytes", "bytes sent by this node"),
        ("blob_bytes_in", "network_blob_received_bytes", "of the bytes received, blob data (side channels)"),
        ("blob_bytes_out", "network_blob_sent_bytes", "of the bytes sent, blob data (side channels)"),
        ("swarm_fetches", "blob_swarm_fetches", "blobs fetched down a relay tree (ancestors first, the origin last)"),
        ("swarm_fetches_from_origin", "blob_swarm_fetches_from_origin",
         "of those, served by the origin though ancestors were named"),
        ("swarm_waits_missed", "blob_swarm_waits_missed",
         "relay-tree requests answered not found: no fetch of ours had started within the wait"),
    ):
        if (v := _num(net.get(key))) is not None:
            yield CounterMetricFamily(f"{PREFIX}_{name}", doc, value=v)

    rejected = net.get("rejected")
    rejected = rejected if isinstance(rejected, Mapping) else {}
    fam = CounterMetricFamily(f"{PREFIX}_rejected_inputs", "bad inputs refused, by what they were and why",
                              labels=["kind", "reason"])
    for key, n in sorted(rejected.items()):
        if (v := _num(n)) is not None:
            fam.add_metric(list(_split_reason(key)), v)
    yield fam

    # This node's own bugs met while handling peers' input (pcp_p2p.core.faults), apart from the peers' faults.
    faults = net.get("local_fault_kinds")
    faults = faults if isinstance(faults, Mapping) else {}
    fam = CounterMetricFamily(f"{PREFIX}_local_faults", "bugs of this node's met while handling peers' input, "
                              "by where and exception type (never counted as the peer's rejection)",
                              labels=["kind", "error"])
    for key, n in sorted(faults.items()):
        if (v := _num(n)) is not None:
            fam.add_metric(list(_split_reason(key)), v)
    yield fam

    # Submissions: accepted ones are the participants of committed rounds (or
    # run.accepted when the run reports a running total); rejected ones are the
    # network.rejected entries about updates plus run.rejected when present.
    run = _section(obj, "run")
    accepted = _num(run.get("accepted"))
    if accepted is None:
        history = run.get("history")
        if isinstance(history, list) and history:
            accepted = sum(_num(h.get("participants")) or 0.0 for h in history if isinstance(h, Mapping))
    sub_rejected: defaultdict[str, float] = defaultdict(float)
    for key, n in rejected.items():
        what, reason = _split_reason(key)
        if what in SUBMISSION_KINDS and (v := _num(n)) is not None:
            sub_rejected[reason] += v
    run_rejected = run.get("rejected")
    if isinstance(run_rejected, Mapping):
        for reason, n in run_rejected.items():
            if (v := _num(n)) is not None:
                sub_rejected[str(reason)] += v
    if accepted is not None or sub_rejected:
        sub = CounterMetricFamily(f"{PREFIX}_submissions", "pseudo-gradient submissions by outcome and reason",
                                  labels=["outcome", "reason"])
        if accepted is not None:
            sub.add_metric(["accepted", ""], accepted)
        for reason, n in sorted(sub_rejected.items()):
            sub.add_metric(["rejected", reason], float(n))
        yield sub


def _run_gauge(name: str, doc: str, run_id: str, value: float) -> GaugeMetricFamily:
    fam = _gauge(name, doc, labels=("run_id",))
    fam.add_metric([run_id], value)
    return fam


def _run(run: Mapping[str, Any]) -> Iterator[Metric]:
    if not run:
        return
    run_id = str(run.get("run_id") or "")
    info = _gauge("run_info", "constant 1, labelled with the run this node takes part in",
                  labels=("run_id", "name", "owner"))
    info.add_metric([run_id, str(run.get("name") or ""), str(run.get("owner") or "")], 1.0)
    yield info
    phase = run.get("phase")
    yield _run_gauge("run_phase", "the run's phase as a number (docs/tui.md: 1 starting, 2 joining, 3 electing, "
                     "4 compiling, 5 waiting for quorum, 6 idle, 7 fetching, 8 training, 9 submitted, 10 finished, "
                     "11 stopped, 12 failed; 0 other)", run_id, float(phase_code(phase)))
    lost = isinstance(phase, str) and phase.rstrip().endswith(SHEPHERD_LOST)
    yield _run_gauge("run_shepherd_lost", "1 while this node has lost sight of the run's shepherd", run_id,
                     1.0 if lost else 0.0)
    if run.get("shepherd"):  # an identity, not a state: changes only on a failover or rotation
        shepherd = _gauge("run_shepherd_info", "constant 1, labelled with the run's current shepherd",
                          labels=("run_id", "shepherd"))
        shepherd.add_metric([run_id, str(run["shepherd"])], 1.0)
        yield shepherd
    if isinstance(run.get("is_shepherd"), bool):
        yield _run_gauge("run_is_shepherd", "1 if this node is the run's shepherd", run_id,
                         1.0 if run["is_shepherd"] else 0.0)
    for key, name, doc in (
        ("round", "run_round", "last committed outer round, counted from 1"),
        ("loss", "run_loss", "training loss of the last committed round"),
        ("val_loss", "run_val_loss", "validation loss of the last committed round"),
        ("tokens_per_s", "run_tokens_per_second", "tokens per second, swarm-wide"),
        ("outer_lr", "run_outer_lr", "outer Nesterov learning rate"),
        ("participants", "run_participants", "workers taking part in the current round"),
        ("quorum", "run_quorum", "submissions needed to commit the round"),
        ("deadline_s", "run_deadline_seconds", "seconds left until the round deadline"),
    ):
        if (v := _num(run.get(key))) is not None:
            yield _run_gauge(name, doc, run_id, v)
    history = run.get("history")
    if isinstance(history, list) and history:
        tokens = sum(_num(h.get("tokens")) or 0.0 for h in history if isinstance(h, Mapping))
        fam = CounterMetricFamily(f"{PREFIX}_run_tokens", "tokens processed in committed rounds", labels=["run_id"])
        fam.add_metric([run_id], tokens)
        yield fam


def _shepherd(obj: Mapping[str, Any]) -> Iterator[Metric]:
    if (v := _num(obj.get("term"))) is not None:
        yield _gauge("shepherd_term", "current shepherd term", v)
    if (v := _num(obj.get("lease_expires_s"))) is not None:
        yield _gauge("shepherd_lease_expires_seconds", "seconds until the shepherd's lease lapses", v)
    history = obj.get("shepherd_history")
    if isinstance(history, list):
        ended: Counter[str] = Counter()
        for h in history:
            if isinstance(h, Mapping) and h.get("ended"):
                ended[str(h["ended"])] += 1
        fam = CounterMetricFamily(f"{PREFIX}_shepherd_terms_ended", "shepherd terms ended, by how (rotation, failover)",
                                  labels=["ended"])
        for how, n in sorted(ended.items()):
            fam.add_metric([how], float(n))
        yield fam


def _artifacts(artifacts: Any) -> Iterator[Metric]:
    if not isinstance(artifacts, list):
        return
    fam = _gauge("artifact_bytes", "size of each compiled artifact this node holds",
                 labels=("target", "cid", "cache_hit"))
    for a in artifacts:
        if isinstance(a, Mapping) and (v := _num(a.get("size"))) is not None:
            fam.add_metric([str(a.get("target", "")), str(a.get("cid", "")), "1" if a.get("cache_hit") else "0"], v)
    yield fam


@dataclass
class MetricsServer:
    """A running exporter; ``close()`` stops it."""

    server: WSGIServer
    thread: threading.Thread
    registry: CollectorRegistry

    @property
    def port(self) -> int:
        return int(self.server.server_address[1])

    @property
    def host(self) -> str:
        return str(self.server.server_address[0])

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()
        self.thread.join(timeout=5)


def build_registry(status_fn: StatusFn) -> CollectorRegistry:
    """A registry of its own (not prometheus_client's global one: tests and nodes in one process stay apart)."""
    registry = CollectorRegistry(auto_describe=False)
    registry.register(StatusCollector(status_fn))
    return registry


def health_reply(health_fn: HealthFn | None) -> tuple[int, dict[str, Any]]:
    """``GET /healthz``'s status code and JSON body.

    200 with ``status: "ok"`` when ``health_fn`` answers and says
    ``bootstrapped: true``; 503 with ``status: "starting"`` before that, and
    with ``status: "down"`` (and the error) when it cannot answer at all (the
    node is stopping). ``health_fn`` gives the node's fields (see
    ``pcp_p2p.commands.node_commands.node_health``): peer id, uptime, bootstrapped,
    connected peers, runs.
    """
    if health_fn is None:
        return 404, {"status": "unknown", "error": "this server has no health check"}
    try:
        obj = health_fn()
        if not isinstance(obj, Mapping):
            raise TypeError(f"health_fn returned {type(obj).__name__}, not a mapping")
    except Exception as exc:  # a probe must get an answer, never a dropped connection
        return 503, {"status": "down", "error": " ".join(str(exc).split()) or type(exc).__name__}
    ok = obj.get("bootstrapped") is True
    return (200 if ok else 503), {"status": "ok" if ok else "starting", **obj}


def _app(registry: CollectorRegistry, health_fn: HealthFn | None) -> Callable[..., Iterable[bytes]]:
    """The WSGI app: ``/healthz`` here, every other path the Prometheus exposition."""
    metrics_app = make_wsgi_app(registry)

    def app(environ: dict[str, Any], start_response: Callable[..., Any]) -> Iterable[bytes]:
        if environ.get("PATH_INFO") != HEALTH_PATH:
            return metrics_app(environ, start_response)  # type: ignore[no-any-return]  # prometheus_client: untyped
        code, body = health_reply(health_fn)
        data = json.dumps(body).encode() + b"\n"
        start_response(f"{code} {HTTPStatus(code).phrase}", [
            ("Content-Type", "application/json"), ("Content-Length", str(len(data))), ("Cache-Control", "no-store"),
        ])
        return [data] if environ.get("REQUEST_METHOD") != "HEAD" else []

    return app


class _QuietHandler(WSGIRequestHandler):
    def log_message(self, format: str, *args: Any) -> None:
        pass


class _ThreadingWSGIServer(ThreadingMixIn, WSGIServer):
    """One thread per request, so a slow scrape cannot hold up a health probe."""

    daemon_threads = True


def serve_metrics(port: int, status_fn: StatusFn, host: str = "127.0.0.1",
                  health_fn: HealthFn | None = None) -> MetricsServer:
    """Start the Prometheus HTTP exporter on ``host:port`` (port 0: any free one; see ``.port``),
    with ``GET /healthz`` answered from ``health_fn`` (404 without one).

    ``host`` is 127.0.0.1 by default: metrics name peers and runs, so exposing
    them beyond the machine (``0.0.0.0``) is a decision the operator makes.
    Raises ConfigError when the port cannot be bound.
    """
    if not 0 <= port <= 65535:
        raise ConfigError(f"metrics port out of range: {port}")
    registry = build_registry(status_fn)
    try:
        family = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)[0][0]

        class MetricsHTTPServer(_ThreadingWSGIServer):
            address_family = family  # IPv6 when ``host`` is an IPv6 address

        server = make_server(host, port, _app(registry, health_fn), MetricsHTTPServer, handler_class=_QuietHandler)
    except OSError as exc:
        raise ConfigError(f"cannot serve metrics on {host}:{port}: {exc.strerror or exc}".rstrip()) from exc
    thread = threading.Thread(target=server.serve_forever, name="pcp-metrics", daemon=True)
    thread.start()
    log.info("metrics on http://%s:%d/metrics, health on %s", host, int(server.server_address[1]), HEALTH_PATH)
    return MetricsServer(server, thread, registry)
