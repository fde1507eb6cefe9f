"""An owner's run lifecycle, sans-IO: the stop order's checks, its DHT record, the phase a run shows,
and what ``pcp run status`` makes of what it finds. The same over real libp2p: tests/test_run_stop.py."""

from __future__ import annotations

import dataclasses
import threading
from pathlib import Path
from types import SimpleNamespace

import pytest
import trio

from pcp_p2p.core.errors import BadSignature, ConfigError, ExpiredRecord, PcpError, StaleMessage, VerificationError
from pcp_p2p.core.identity import Identity
from pcp_p2p.dht.records import CLOCK_SKEW_S, verify_record
from pcp_p2p.diloco.algorithm.data import check_dataset
from pcp_p2p.diloco.protocol.lifecycle import (
    STOP_FILE,
    STOP_KIND,
    NotOwner,
    PhaseInputs,
    StopLatch,
    StopOrder,
    describe_run,
    run_phase,
    sign_stop,
    status_line,
    stop_name,
    stop_record,
)
from pcp_p2p.diloco.protocol.spec import parse_spec
from pcp_p2p.diloco.run.engine import ShiftSlot
from pcp_p2p.diloco.run.reputation import ReputationLedger
from pcp_p2p.diloco.run.run_blobs import RunBlobs
from pcp_p2p.diloco.run.run_machine import RunMachine
from pcp_p2p.diloco.run.runtime import RunRuntime
from pcp_p2p.node.record_kinds import RECORD_KINDS
from pcp_p2p.wire import encode

OWNER, STRANGER = Identity.generate(), Identity.generate()
RUN, OTHER_RUN = "bafkrei-run-a", "bafkrei-run-b"
NOW = 1_700_000_000.0


def forged(stop: StopOrder) -> StopOrder:
    """The owner's order with a stranger's signature over it."""
    return dataclasses.replace(stop, signature=sign_stop(STRANGER, RUN, now=stop.issued).signature)


# What every node refuses, and with which typed error; nothing changes on a refusal.
REFUSED = [
    ("another run's stop", sign_stop(OWNER, OTHER_RUN, now=NOW), VerificationError),
    ("a stranger's stop, well signed", sign_stop(STRANGER, RUN, now=NOW), NotOwner),
    ("the owner's stop, forged signature", forged(sign_stop(OWNER, RUN, now=NOW)), BadSignature),
    ("the owner's stop, reason changed", dataclasses.replace(sign_stop(OWNER, RUN, now=NOW), reason="x"), BadSignature),
    ("unsigned", dataclasses.replace(sign_stop(OWNER, RUN, now=NOW), signature=b""), BadSignature),
    ("dated beyond the clock skew", sign_stop(OWNER, RUN, now=NOW + CLOCK_SKEW_S + 60), ExpiredRecord),
]


@pytest.mark.parametrize("case, stop, error", REFUSED, ids=[c[0] for c in REFUSED])
def test_a_stop_not_signed_by_the_runs_owner_for_this_run_is_refused(case: str, stop: StopOrder, error: type) -> None:
    latch = StopLatch(RUN, OWNER.peer_id)
    with pytest.raises(error):
        latch.apply(stop, NOW)
    assert not latch.stopped
    latch.apply(sign_stop(OWNER, RUN, now=NOW), NOW)  # the owner's own order still counts
    assert latch.stopped


def test_the_owners_stop_counts_once_and_a_replay_is_stale() -> None:
    latch = StopLatch(RUN, OWNER.peer_id)
    order = sign_stop(OWNER, RUN, now=NOW, reason="enough")
    latch.apply(order, NOW + 5)
    assert latch.order == order
    with pytest.raises(StaleMessage):
        latch.apply(order, NOW + 6)
    with pytest.raises(StaleMessage):
        latch.apply(sign_stop(OWNER, RUN, now=NOW + 7), NOW + 7)
    assert latch.order == order


def test_a_stop_order_is_bounded() -> None:
    with pytest.raises(ValueError):
        sign_stop(OWNER, RUN, now=NOW, reason="x" * 201)
    with pytest.raises(ValueError):
        StopOrder(run_id=RUN, owner=OWNER.peer_id, issued=float("nan"))
    assert len(encode(sign_stop(OWNER, RUN, now=NOW, reason="x" * 200))) < 2048


def test_only_the_owner_can_store_a_stop_where_readers_look() -> None:
    order = sign_stop(OWNER, RUN, now=NOW)
    rec = stop_record(order, OWNER, now=NOW)
    assert verify_record(encode(rec), key=rec.key, now=NOW, kinds=RECORD_KINDS).payload == order
    # A stranger storing the owner's order (or its own) under the owner's key is refused.
    from pcp_p2p.dht.records import sign_record

    for signer, payload in ((STRANGER, order), (STRANGER, sign_stop(STRANGER, RUN, now=NOW))):
        bad = sign_record(signer, STOP_KIND, stop_name(RUN, OWNER.peer_id), payload, ttl_s=60, now=NOW)
        with pytest.raises(PcpError):
            verify_record(encode(bad), key=bad.key, now=NOW, kinds=RECORD_KINDS)
    # An order stored under another run's key is refused too.
    moved = sign_record(OWNER, STOP_KIND, stop_name(OTHER_RUN, OWNER.peer_id), order, ttl_s=60, now=NOW)
    with pytest.raises(VerificationError):
        verify_record(encode(moved), key=moved.key, now=NOW, kinds=RECORD_KINDS)


# --- the phase -----------------------------------------------------------------------------

PHASES = [
    (PhaseInputs(base="idle", members=3, quorum=2, started=True), "idle"),
    (PhaseInputs(base="idle", compiling=True, members=3, quorum=2), "compiling"),
    (PhaseInputs(base="idle", shepherd_state="compiling", members=3, quorum=2), "compiling"),
    (PhaseInputs(base="idle", shepherd_state="set-up failed: dataset 'x'", members=3, quorum=2),
     "set-up failed: dataset 'x'"),
    (PhaseInputs(base="idle", setup_error="dataset 'x'", members=3, quorum=2), "set-up failed: dataset 'x'"),
    (PhaseInputs(base="idle", shepherd_state="training", members=1, quorum=2), "waiting for quorum (1/2)"),
    (PhaseInputs(base="electing", members=2, quorum=2), "electing"),
    (PhaseInputs(base="training", shepherd_state="compiling", started=True, members=3, quorum=2), "training"),
    (PhaseInputs(base="stopped", ended=True, compiling=True, setup_error="x", members=0, quorum=2), "stopped"),
    (PhaseInputs(base="finished", ended=True, members=0, quorum=2), "finished"),
]


@pytest.mark.parametrize("inputs, shown", PHASES)
def test_the_phase_says_compiling_waiting_for_quorum_and_setup_errors(inputs: PhaseInputs, shown: str) -> None:
    assert run_phase(inputs) == shown


def test_run_status_counts_rounds_from_one_and_says_why_it_ended() -> None:
    base = dict(run_id=RUN, name="n", owner=OWNER.peer_id, rounds=12, quorum=2, val_loss=2.5,
                members=["a", "b", "c"], shepherd="12D3KooWshepherd", term=1)
    view = describe_run(**base, committed=2, stopped=None, reported={"phase": "training"})
    assert (view["phase"], view["round"], view["committed"], view["members"]) == ("training", 3, 2, 3)
    assert status_line(view) == ("training · round 3/12 (2 committed) · shepherd shepherd · members 3/2 · "
                                 "val loss 2.5000")
    assert describe_run(**base, committed=12, stopped=None, reported=None)["phase"] == "finished"
    assert describe_run(**base, committed=12, stopped=None, reported=None)["round"] == 12
    late_stop = sign_stop(OWNER, RUN, now=NOW)
    assert describe_run(**base, committed=12, stopped=late_stop, reported=None)["phase"] == "finished"
    stopped = describe_run(**base, committed=5, stopped=sign_stop(OWNER, RUN, now=NOW, reason="r"),
                           reported={"phase": "training"})
    assert (stopped["phase"], stopped["stop_reason"]) == ("stopped", "r")
    assert describe_run(**{**base, "members": []}, committed=0, stopped=None, reported=None)["phase"] \
        == "no node is taking part"


# --- the dataset, checked at create time --------------------------------------------------------


def test_a_dataset_that_cannot_be_read_is_refused_naming_the_key(tmp_path: Path) -> None:
    for bad in (str(tmp_path / "missing.txt"), str(tmp_path)):  # a missing file; a folder without .txt
        with pytest.raises(ConfigError, match=r"^run spec: data\.dataset: "):
            check_dataset(bad)
    (tmp_path / "short.txt").write_text("too short")
    with pytest.raises(ConfigError, match=r"data\.dataset.*too short"):
        check_dataset(str(tmp_path / "short.txt"))
    (tmp_path / "ok.txt").write_text("to be or not to be, that is the question " * 4)
    check_dataset(str(tmp_path / "ok.txt"))


# --- a node restarted after a stop does not take the run up again -----------------------------


class Store:
    def __init__(self) -> None:
        self.unpinned: list[str] = []

    def unpin(self, cid: str) -> None:
        self.unpinned.append(cid)


def stopped_runtime(work_dir: Path) -> RunRuntime:
    """A runtime with only what stopping touches (no node, no network): a real run machine."""
    rt = RunRuntime.__new__(RunRuntime)
    rt.run_id, rt.work_dir, rt.clock = RUN, work_dir, lambda: NOW
    rt.run = SimpleNamespace(owner=OWNER.peer_id)  # type: ignore[assignment]
    rt.node = SimpleNamespace(leads={RUN}, log_once=lambda *a: None)  # type: ignore[assignment]
    rt.io = RunBlobs(None, SimpleNamespace(store=Store()), work_dir)  # type: ignore[arg-type]
    rt.io.pins.for_run("artifact")
    rt.io.pins.for_dataset("dataset")
    rt.machine = RunMachine.for_spec(parse_spec(""), run_id=RUN, owner=OWNER.peer_id, identity=Identity.generate(),
                                     ledger=ReputationLedger(work_dir / "ledger.json", RUN), target="cpu",
                                     tokens_per_s=1.0, started_at=NOW)
    rt.machine.shepherd, rt.machine.phase = object(), "training"  # type: ignore[assignment]
    rt._inner_jobs = {}
    rt.finished = trio.Event()
    rt._nursery = None
    rt._send, rt._inbox = trio.open_memory_channel[tuple](10)
    rt._machine_lock, rt._beats_in = threading.Lock(), []
    return rt


async def test_a_stopped_run_releases_its_pins_and_stays_stopped_after_a_restart(tmp_path: Path) -> None:
    import threading

    rt = stopped_runtime(tmp_path)
    inner = threading.Event()
    rt._inner_jobs[(3, 0)] = (inner, ShiftSlot())
    with pytest.raises(NotOwner):
        rt.stop(sign_stop(STRANGER, RUN, now=NOW), NOW)
    assert not rt.finished.is_set() and not (tmp_path / STOP_FILE).exists()

    rt.stop(sign_stop(OWNER, RUN, now=NOW), NOW)
    assert rt.finished.is_set() and rt.phase == "stopped" and rt.shepherd is None and inner.is_set()
    assert rt.io.store.unpinned == ["artifact"] and rt.io.pins.finished  # the dataset is kept, as on run end
    assert RUN not in rt.node.leads and (tmp_path / STOP_FILE).exists()

    with pytest.raises(StaleMessage):  # a replay
        rt.stop(sign_stop(OWNER, RUN, now=NOW), NOW)
    done = stopped_runtime(tmp_path / "done")
    (tmp_path / "done").mkdir()
    done.machine.finished = True  # finished by itself: a later stop changes nothing
    with pytest.raises(StaleMessage):
        done.stop(sign_stop(OWNER, RUN, now=NOW), NOW)
    assert done.phase == "training" and not done.io.pins.finished

    again = stopped_runtime(tmp_path)  # the node restarted: the kept order ends the run at once
    assert again._stopped_before() and again.finished.is_set() and again.phase == "stopped"
    (tmp_path / STOP_FILE).write_bytes(encode(sign_stop(STRANGER, RUN, now=NOW)))  # tampered: ignored
    assert not stopped_runtime(tmp_path)._stopped_before()


def test_run_status_text_names_each_field_on_its_own_line() -> None:
    from pcp_p2p.diloco.run.run_commands import render

    view = describe_run(run_id=RUN, name="n", owner=OWNER.peer_id, rounds=12, quorum=2, committed=2, val_loss=2.43125,
                        stopped=None, members=["a", "b", "c"], shepherd="12D3KooWshep", term=1,
                        reported={"phase": "waiting for quorum (1/2)"})
    lines = render(view).splitlines()
    assert [line.split()[0] for line in lines] == ["run", "owner", "phase", "round", "shepherd", "members", "val"]
    assert "waiting for quorum (1/2)" in lines[2] and "3/12  (2 committed)" in lines[3]
    assert "(term 1)" in lines[4] and "3  (quorum 2)" in lines[5] and lines[6].endswith("2.4312")
