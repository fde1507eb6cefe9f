"""RunPins: a run keeps its own blobs for its life and a round's for the next two commits."""

from __future__ import annotations

from pathlib import Path

from pcp_p2p.diloco.run.pins import RunPins


def test_run_pins_keep_the_runs_blobs_and_let_old_rounds_go() -> None:
    pins = RunPins(keep_rounds=2)
    pins.for_run("dataset")
    pins.for_round("theta-start")  # the term's starting θ, before any commit
    assert pins.on_commit(0) == []
    pins.for_round("theta0")  # a worker fetches θ after the commit is accepted
    pins.for_round("theta1")  # the shepherd stores θ before its commit is processed
    assert pins.on_commit(1) == []
    assert pins.on_commit(2) == ["theta-start"]  # older than the last two commits
    assert pins.on_commit(2) == [] and pins.on_commit(1) == []  # a repeated or stale commit
    pins.for_round("theta0")  # pinned again: renewed
    assert pins.on_commit(3) == ["theta1"]
    assert pins.on_commit(100) == ["theta0"]
    assert "dataset" in pins and "theta0" not in pins  # the run's own blobs stay
    pins.for_round("dataset")  # a run blob is never demoted to a round blob
    assert pins.on_commit(200) == [] and "dataset" in pins


def test_the_ledger_survives_a_restart_and_a_bad_file_loses_nothing(tmp_path: Path) -> None:
    path = tmp_path / "pins.json"
    assert RunPins.load(path).committed == -1  # none yet
    pins = RunPins()
    pins.for_run("artifact")
    pins.on_commit(5)
    pins.for_round("theta5")
    pins.save(path)
    again = RunPins.load(path)
    assert again.committed == 5 and "artifact" in again and "theta5" in again
    assert again.on_commit(8) == ["theta5"]  # released by the restarted node
    for bad in (b"{not json", b'{"committed": "x", "for_run": [], "since": {}}', b"[]", b"\xff"):
        path.write_bytes(bad)
        fresh = RunPins.load(path)  # a fresh ledger: the old pins stay pinned, nothing is lost
        assert fresh.committed == -1 and "artifact" not in fresh
