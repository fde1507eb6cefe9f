"""The planetary simulator's core at small N: real run machines on drawn home links, with churn.

What ``bench/sim.py`` runs at 1,000-10,000 nodes, here at 40 in about a second: the
run must reach its last round on one chain through the churn and a forced kill
of its shepherd, and the figures the bench reports must be computed and sane.
"""

from __future__ import annotations

import random
from pathlib import Path

from pcp_p2p.diloco.protocol import election, messages, worker
from pcp_p2p.diloco.protocol.messages import RoundAnnouncement
from pcp_p2p.testing.planet import LinkModel, PlanetConfig, simulate, verification_cache

ROUNDS = 4


def test_a_small_planet_commits_every_round_through_churn_and_a_shepherd_kill() -> None:
    r = simulate(PlanetConfig(nodes=40, rounds=ROUNDS, churn=0.3, shepherd_kills=1, pool=6, seed=3))
    assert r.finished and r.rounds_committed == ROUNDS
    assert ROUNDS <= r.rounds_attempted and r.goodput == round(ROUNDS / r.rounds_attempted, 4)
    assert r.kills >= 1 and r.departures >= r.kills  # the forced kill struck, churn ran
    assert r.leader_departures >= 1 and r.terms >= 2  # ... a leader, and another term took the run over
    assert r.round_time_s > 0 and r.virtual_s >= ROUNDS * r.round_time_s * 0.99
    assert r.shepherd_bytes_per_round > 1000  # an announcement and a commit to each worker, at least
    assert r.election_convergence_s and all(x >= 0 for x in r.election_convergence_s)
    assert 2 <= r.seated_mean <= 40
    assert r.val_loss_first is not None and r.val_loss_last is not None
    assert r.val_loss_last < 0.5 * r.val_loss_first  # the surrogate trained, and commits combined it
    # the commits reach the workers as their update, built into the checkpoint by the real code
    # (the run's first from its starting θ; a late joiner without the checkpoint before fetches whole)
    assert r.checkpoints_rebuilt > 4 * r.checkpoints_fetched and r.checkpoints_rebuilt >= ROUNDS


def test_a_small_planet_with_overlapped_rounds_commits_every_round_and_learns() -> None:
    # round.overlap: workers train round r+1 while their Δ of round r travels (docs/diloco.md)
    r = simulate(PlanetConfig(nodes=40, rounds=ROUNDS, churn=0.3, shepherd_kills=1, pool=6, seed=3, overlap=True))
    assert r.finished and r.rounds_committed == ROUNDS
    assert r.early_runs >= 20 * (ROUNDS - 1)  # most workers, every round after the first
    assert r.val_loss_first is not None and r.val_loss_last is not None
    assert r.val_loss_last < 0.5 * r.val_loss_first


def test_links_are_drawn_within_their_documented_bounds() -> None:
    rng = random.Random(0)
    draws = [LinkModel().draw(rng) for _ in range(2000)]
    assert all(2 * 125_000 <= d <= 1000 * 125_000 and 0 < u <= d and 0.002 <= lat <= 0.25 for d, u, lat in draws)
    downs = sorted(d for d, _, _ in draws)
    assert 60 * 125_000 < downs[len(downs) // 2] < 130 * 125_000  # the median near 90 Mbit/s


def test_the_verification_cache_is_put_back_and_never_caches_a_failure() -> None:
    real = messages.verify
    with verification_cache():
        assert worker.verify is not real and election.verify is not real
        bogus = RoundAnnouncement(run_id="r", term=0, round=0, attempt=0, theta_cid="c", artifacts={},
                                  time_budget_s=1.0, deadline=1.0, assignments=(), shepherd="x",
                                  signature=b"\0" * 64)
        for _ in range(2):  # refused both times: a failure is not remembered as a success
            try:
                worker.verify(bogus, "12D3KooWQLUzB5jKmbrQ9sDFUPSifZkCprDBrs4acxNJ5FHggu9h")
            except Exception as exc:  # BadSignature
                assert type(exc).__name__ == "BadSignature"
            else:
                raise AssertionError("a bad signature verified")
    assert worker.verify is real and election.verify is real


def test_pcp_sim_prints_the_figures_of_one_run(capsys) -> None:  # type: ignore[no-untyped-def]
    import json

    from pcp_p2p.cli import main

    assert main(["sim", "--nodes", "12", "--rounds", "2", "--pool", "4", "--shepherd-kills", "0", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["nodes"] == 12 and out["rounds_committed"] == 2 and 0 < out["goodput"] <= 1
    assert main(["sim", "--nodes", "12", "--rounds", "3", "--pool", "4", "--shepherd-kills", "0", "--churn", "0",
                 "--overlap", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["early_runs"] > 0
    assert main(["sim", "--nodes", "12", "--pool", "13"]) == 1  # a ConfigError, reported the CLI's way
    assert "--pool" in capsys.readouterr().err


def test_signing_is_shared_only_for_identical_content_and_really_verifies(tmp_path: Path) -> None:
    from pcp_p2p.core.identity import Identity
    from pcp_p2p.diloco.protocol.messages import Join
    from pcp_p2p.testing.planet import MemoryLedger

    me, other = Identity(b"\1" * 32), Identity(b"\2" * 32)
    join = Join(run_id="r", worker=me.peer_id, target="cpu", tokens_per_s=64.0)
    real_sign = messages.sign
    with verification_cache():
        assert worker.sign is not real_sign and election.sign is not real_sign
        first, again = worker.sign(join, me), worker.sign(join, me)
        assert again is first  # the same content and key: one signature, reused
        assert worker.sign(join, other) is not first  # another key signs for itself
        moved = worker.sign(Join(run_id="r", worker=me.peer_id, target="cpu", tokens_per_s=65.0), me)
        assert moved.signature != first.signature  # other content, another real signature
    assert worker.sign is real_sign and election.sign is real_sign
    messages.verify(first, me.peer_id)  # a real signature (raises BadSignature otherwise)
    assert first == real_sign(join, me)  # Ed25519 is deterministic: what the real sign gives

    ledger = MemoryLedger(tmp_path / "ledger.json", "r")
    ledger.strike("p", "RejectedUpdate", 0.0)
    ledger.ban("q", b"evidence", "caught", 1.0)
    assert ledger.score("p") < 0.5 and ledger.banned("q")  # the real ledger's bookkeeping
    assert not (tmp_path / "ledger.json").exists()  # ... kept in memory
