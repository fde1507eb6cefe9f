"""RunPins: a run keeps its own blobs for its life and a round's for the next two commits."""

from __future__ import annotations

from pcp_p2p.diloco.pins import RunPins


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
