"""Round deadlines from observed arrivals (issue #14 item 4): pcp_p2p.diloco.protocol.deadlines, no network."""

from __future__ import annotations

import pytest

from pcp_p2p.diloco.protocol.deadlines import ArrivalDeadline


def test_unknown_workers_get_the_specs_full_deadline() -> None:
    d = ArrivalDeadline(time_budget_s=2.0, max_s=60.0)
    assert d.deadline_s(["a"]) == 60.0
    for t in (3.0, 3.1):
        d.observe("a", t)
    assert d.deadline_s(["a"]) == 60.0  # two arrivals are not a history yet
    d.observe("a", 3.2)
    assert d.deadline_s(["a"]) < 60.0
    assert d.deadline_s(["a", "newcomer"]) == 60.0  # one unknown worker: the round waits for it


def test_the_deadline_is_the_slowest_workers_median_plus_k_mad_inside_the_bounds() -> None:
    d = ArrivalDeadline(time_budget_s=2.0, max_s=60.0, k=5.0, min_spread_s=0.25, min_spread_share=0.0)
    for t in (3.0, 3.0, 3.0, 3.0):
        d.observe("fast", t)
    for t in (8.0, 9.0, 10.0, 9.0, 9.0):
        d.observe("slow", t)
    # fast: median 3, MAD 0 -> floored spread 0.25: 3 + 5 * 0.25
    assert d.expected_s("fast") == pytest.approx(4.25)
    # slow: median 9, MAD 0 (three of five at 9) -> floor; the slow home sets the round's deadline
    assert d.deadline_s(["fast", "slow"]) == pytest.approx(9.0 + 5 * 0.25)
    assert d.deadline_s(["fast"]) == pytest.approx(4.25)  # no slow home this round: no waiting for one
    # bounds: never below time budget + slack, never above the spec's deadline
    tiny = ArrivalDeadline(time_budget_s=2.0, max_s=60.0, min_spread_share=0.0)
    for _ in range(3):
        tiny.observe("x", 0.1)
    assert tiny.deadline_s(["x"]) == pytest.approx(4.0)
    capped = ArrivalDeadline(time_budget_s=2.0, max_s=20.0)
    for t in (18.0, 19.0, 25.0):
        capped.observe("y", t)
    assert capped.deadline_s(["y"]) == 20.0


def test_a_spread_of_arrivals_widens_the_allowance() -> None:
    d = ArrivalDeadline(time_budget_s=2.0, max_s=100.0, k=4.0, min_spread_share=0.0)
    for t in (4.0, 5.0, 6.0, 5.0, 12.0):  # median 5, |dev| 1,0,1,0,7 -> MAD 1 -> sigma 1.4826
        d.observe("w", t)
    assert d.expected_s("w") == pytest.approx(5.0 + 4 * 1.4826)


def test_a_missed_deadline_walks_the_workers_allowance_up_and_old_arrivals_age_out() -> None:
    d = ArrivalDeadline(time_budget_s=2.0, max_s=60.0, window=4, min_spread_share=0.0)
    for _ in range(4):
        d.observe("w", 3.0)
    first = d.deadline_s(["w"])
    for _ in range(3):  # the link got slower: each miss counts as an arrival at 1.5x the deadline
        d.missed("w", d.deadline_s(["w"]))
    assert d.deadline_s(["w"]) > 1.5 * first
    d.forget(["other"])
    assert d.expected_s("w") is None  # evicted workers are forgotten
    d.observe("z", float("nan"))
    d.observe("z", -1.0)
    assert d.expected_s("z") is None and "z" not in d._seen


def test_the_shepherd_shortens_its_deadline_once_it_has_seen_every_worker_arrive() -> None:
    """Through the real Shepherd: the spec's 20 s while arrivals are unknown, then what the
    workers showed (they always arrive 3 s after the announcement), held at the floor of
    time_budget_s (10 s) + 2 s."""
    from test_diloco_protocol import Round, sent

    from pcp_p2p.diloco.protocol.messages import RoundAnnouncement

    r = Round(n=2)
    now = r.shepherd.join_grace_s
    deadlines = []
    ann = r.ann
    for _ in range(4):
        deadlines.append(ann.deadline - now)
        effects = []
        for who in r.ids:
            effects += r.shepherd.on_submission(r.submission(who, ann=ann), now=now + 3.0)
        now += 3.0
        ann = sent(effects, RoundAnnouncement)[-1]
    deadlines.append(ann.deadline - now)
    assert deadlines[:3] == [20.0, 20.0, 20.0]  # fewer than 3 arrivals each: the spec's deadline
    # 3 s median, no spread -> 3 + 5 * max(0.25, 0.25 * 3) = 6.75, below the floor: 12 s
    assert deadlines[3] == pytest.approx(12.0) and deadlines[4] == pytest.approx(12.0)
