"""The pure combining rules of :mod:`pcp_p2p.diloco.algorithm.robust`, against hand computations."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from pcp_p2p.core.errors import ConfigError, RejectedUpdate
from pcp_p2p.diloco.algorithm import robust
from pcp_p2p.diloco.algorithm.robust import (
    AggregationPolicy,
    aggregate,
    capped_weights,
    centered_clip,
    combine,
    coordinate_median,
    norm_allowance,
    screen_by_norm,
    trimmed_mean,
    weighted_mean,
)

POLICY = AggregationPolicy()


def vec(*xs: float) -> dict[str, np.ndarray]:
    return {"x": np.array(xs, dtype=np.float32)}


# --- weight capping ---------------------------------------------------------------


def test_weights_under_the_cap_stay_proportional():
    np.testing.assert_allclose(capped_weights([30, 20, 50], 0.5), [0.3, 0.2, 0.5])


def test_one_big_claim_is_capped_and_the_rest_share_the_remainder():
    # a 1e12 claim against three honest workers: pinned at 0.5, the others split 0.5 by tokens
    np.testing.assert_allclose(capped_weights([1e12, 20, 20, 10], 0.5), [0.5, 0.2, 0.2, 0.1])


def test_water_filling_cascades():
    # 100 is pinned at 0.4; then 50 of the remaining 0.6 would get 0.577 -> pinned too; 1 and 1 share 0.2
    w = capped_weights([100, 50, 1, 1], 0.4)
    np.testing.assert_allclose(w, [0.4, 0.4, 0.1, 0.1])
    assert w.sum() == pytest.approx(1.0)


@pytest.mark.parametrize("n, cap", [(3, 0.25), (4, 0.25), (2, 0.5)])
def test_cap_that_cannot_be_met_gives_equal_shares(n, cap):
    np.testing.assert_allclose(capped_weights([1e12] + [1] * (n - 1), cap), [1 / n] * n)


def test_random_claims_never_exceed_the_cap():
    rng = np.random.default_rng(0)
    for _ in range(200):
        n = int(rng.integers(3, 12))
        cap = float(rng.uniform(1.05 / n, 1.0))
        w = capped_weights(rng.lognormal(0, 3, n), cap)
        assert w.sum() == pytest.approx(1.0) and w.max() <= cap + 1e-12


# --- norm screening ---------------------------------------------------------------


def test_screen_refuses_norms_far_above_the_median():
    norms = {"a": 1.0, "b": 1.2, "c": 0.9, "d": 10.0}
    out = screen_by_norm(norms, 3.0)
    assert list(out) == ["d"] and isinstance(out["d"], RejectedUpdate)
    assert "median 1.1" in str(out["d"]) and "9.1x" in str(out["d"])
    assert screen_by_norm(norms, 0.0) == {}  # off


def test_screen_with_two_submissions_never_fires():
    # the documented limit: with two, the median is their mean, and a <= 3 (a + h) / 2 always
    assert screen_by_norm({"a": 1.0, "h": 1e9}, 3.0) == {}


def test_more_work_buys_the_square_root_in_norm():
    assert norm_allowance(3.0, 10, 20) == 3.0  # less work than the median: no extra room
    assert norm_allowance(3.0, 80, 20) == pytest.approx(6.0)  # 4x the steps: 2x the room
    norms = {"slow": 1.0, "mid": 1.0, "mid2": 1.1, "fast": 3.5}
    tokens = {"slow": 10, "mid": 20, "mid2": 20, "fast": 40}
    assert list(screen_by_norm(norms, 3.0)) == ["fast"]
    assert screen_by_norm(norms, 3.0, tokens) == {}  # honest fast hardware passes (allowed 4.2x)
    tokens["fast"] = 4000  # an inflated claim: 200x the median's work buys 3x more room, not 200x
    assert norm_allowance(3.0, 4000, 20) == 9.0
    assert list(screen_by_norm({**norms, "fast": 10.0}, 3.0, tokens)) == ["fast"]


# --- coordinate-wise rules -----------------------------------------------------


def test_trimmed_mean_equal_weights_is_the_mean_of_the_middle():
    ds = [vec(0, 5), vec(1, 6), vec(2, 7), vec(100, -100)]
    w = np.full(4, 0.25)
    # trim 25 % of the weight from each end = drop min and max per coordinate
    np.testing.assert_allclose(trimmed_mean(ds, w, 0.25)["x"], [(1 + 2) / 2, (5 + 6) / 2])


def test_weighted_trimmed_mean_by_hand():
    # sorted: 0 holds weight [0, .5), 1 holds [.5, .75), 10 holds [.75, 1]
    # keep [.25, .75]: 0 keeps .25, 1 keeps .25, 10 keeps 0 -> (0*.25 + 1*.25) / .5 = 0.5
    ds = [vec(0.0), vec(1.0), vec(10.0)]
    np.testing.assert_allclose(trimmed_mean(ds, np.array([0.5, 0.25, 0.25]), 0.25)["x"], [0.5])
    # trim 0.1: 0 keeps [.1,.5) = .4, 1 keeps .25, 10 keeps [.75,.9] = .15 -> (0 + .25 + 1.5) / .8
    np.testing.assert_allclose(trimmed_mean(ds, np.array([0.5, 0.25, 0.25]), 0.1)["x"], [1.75 / 0.8], rtol=1e-6)


def test_trim_zero_is_the_weighted_mean_and_two_equal_workers_average():
    rng = np.random.default_rng(1)
    ds = [{"x": rng.normal(size=(3, 5)).astype(np.float32)} for _ in range(5)]
    w = capped_weights(rng.uniform(1, 5, 5), 1.0)
    np.testing.assert_allclose(trimmed_mean(ds, w, 0.0)["x"], weighted_mean(ds, w)["x"], rtol=1e-5, atol=1e-6)
    two = [vec(1.0, 2.0), vec(3.0, -2.0)]
    np.testing.assert_allclose(trimmed_mean(two, np.array([0.5, 0.5]), 0.25)["x"], [2.0, 0.0])


def test_trimmed_mean_stays_in_the_honest_range_when_the_attacker_weighs_less_than_the_trim():
    rng = np.random.default_rng(2)
    honest = [{"x": rng.normal(size=200).astype(np.float32)} for _ in range(4)]
    evil = {"x": rng.normal(size=200).astype(np.float32) * 1e6}
    w = np.array([0.2, 0.2, 0.2, 0.2, 0.2])  # attacker share 0.2 < trim 0.25
    out = trimmed_mean([*honest, evil], w, 0.25)["x"]
    stack = np.stack([h["x"] for h in honest])
    assert np.all(out >= stack.min(0) - 1e-6) and np.all(out <= stack.max(0) + 1e-6)


def test_weighted_median():
    ds = [vec(0.0, 3.0), vec(1.0, 1.0), vec(10.0, 2.0)]
    np.testing.assert_allclose(coordinate_median(ds, np.full(3, 1 / 3))["x"], [1.0, 2.0])
    # the first worker holds more than half the weight: its values are the median
    np.testing.assert_allclose(coordinate_median(ds, np.array([0.6, 0.2, 0.2]))["x"], [0.0, 3.0])
    # two equal workers: the midpoint
    np.testing.assert_allclose(coordinate_median(ds[:2], np.array([0.5, 0.5]))["x"], [0.5, 2.0])


def test_centered_clip_ignores_an_outlier_when_the_majority_agrees():
    # three identical honest Δs: the median is theirs, tau = median distance = 0, the outlier is clipped to 0
    h = {"a": np.full((2, 2), 0.3, np.float32), "b": np.full(3, -0.1, np.float32)}
    evil = {"a": np.full((2, 2), 1e4, np.float32), "b": np.full(3, 1e4, np.float32)}
    out = centered_clip([h, h, h, evil], np.full(4, 0.25), iters=3)
    for k in h:
        np.testing.assert_array_equal(out[k], h[k])


def test_centered_clip_moves_at_most_iters_times_weight_times_tau():
    rng = np.random.default_rng(3)
    honest = [{"x": (1 + 0.1 * rng.normal(size=50)).astype(np.float32)} for _ in range(4)]
    evil = {"x": np.full(50, 1e3, np.float32)}
    w = np.full(5, 0.2)
    clean = centered_clip(honest, np.full(4, 0.25), iters=3)["x"]
    attacked = centered_clip([*honest, evil], w, iters=3)["x"]
    spread = max(float(np.linalg.norm(h["x"] - clean)) for h in honest)
    # the attacker pulls by <= w * tau per pass, tau being about the honest spread
    assert float(np.linalg.norm(attacked - clean)) < 3 * 0.2 * 3 * spread
    assert float(np.linalg.norm(attacked - clean)) < 1e-3 * float(np.linalg.norm(evil["x"]))


# --- combine / aggregate ---------------------------------------------------------


def test_combine_mean_with_cap_one_is_the_plain_token_weighted_mean():
    policy = dataclasses.replace(POLICY, max_share=1.0)
    out = combine("mean", {"a": vec(0.01), "b": vec(0.04)}, {"a": 15, "b": 5}, policy)
    np.testing.assert_allclose(out["x"], [(15 * 0.01 + 5 * 0.04) / 20], rtol=1e-6)


@pytest.mark.parametrize("rule", ["mean", "trimmed_mean", "centered_clip"])
def test_combine_is_bit_identical_whatever_the_order_of_arrival(rule):
    rng = np.random.default_rng(4)
    deltas = {f"w{i}": {"x": rng.normal(size=(7, 3)).astype(np.float32)} for i in range(5)}
    tokens = {k: float(rng.integers(1, 100)) for k in deltas}
    a = combine(rule, deltas, tokens, POLICY)
    b = combine(rule, dict(reversed(deltas.items())), dict(reversed(tokens.items())), POLICY)
    assert a["x"].tobytes() == b["x"].tobytes()


def test_chunked_columns_give_the_same_bits(monkeypatch):
    rng = np.random.default_rng(5)
    deltas = [{"x": rng.normal(size=(33, 9)).astype(np.float32)} for _ in range(4)]
    for w in (np.full(4, 0.25), np.array([0.1, 0.2, 0.3, 0.4])):
        whole = trimmed_mean(deltas, w, 0.25)["x"]
        with monkeypatch.context() as m:
            m.setattr(robust, "FLAT_CHUNK", 7)
            assert trimmed_mean(deltas, w, 0.25)["x"].tobytes() == whole.tobytes()
        with monkeypatch.context() as m:  # rows sorted, 4 coordinates at a time
            m.setattr(robust, "COLUMNS_MAX_WORKERS", 0)
            sorted_rows = trimmed_mean(deltas, w, 0.25)["x"]
            m.setattr(robust, "CHUNK_ELEMENTS", 16)
            assert trimmed_mean(deltas, w, 0.25)["x"].tobytes() == sorted_rows.tobytes()
        np.testing.assert_allclose(whole, sorted_rows, rtol=2**-22, atol=0)


@pytest.mark.parametrize("threads", [2, 3])
def test_the_column_kernel_gives_the_same_bits_in_threads(monkeypatch, threads):
    """The combine's chunks dealt to threads (each with buffers of its own) give the bits of one
    thread: the shepherd's CIDs and an aggregator's replayed partial must not depend on cores."""
    rng = np.random.default_rng(6)
    deltas = [{"x": rng.normal(size=(33, 9)).astype(np.float32), "y": rng.normal(size=50).astype(np.float32)}
              for _ in range(4)]
    monkeypatch.setattr(robust, "FLAT_CHUNK", 7)  # many chunks: every thread gets some of each tensor
    for w in (np.full(4, 0.25), np.array([0.1, 0.2, 0.3, 0.4])):
        monkeypatch.setattr(robust, "COMBINE_THREADS", 1)
        one = trimmed_mean(deltas, w, 0.25)
        monkeypatch.setattr(robust, "COMBINE_THREADS", threads)
        many = trimmed_mean(deltas, w, 0.25)
        assert all(many[k].tobytes() == one[k].tobytes() for k in one)


@pytest.mark.parametrize("bad_chunk", [1, 8])  # in the caller's thread, in the other
def test_a_kernel_failing_in_any_thread_fails_the_combine(bad_chunk):
    def kernel(cols):
        if cols[0][0] == 4 * bad_chunk:
            raise FloatingPointError("from a kernel")
        return cols[0]

    with pytest.raises(FloatingPointError, match="from a kernel"):
        robust._flatwise([{"x": np.arange(40, dtype=np.float32)}], [kernel, kernel], chunk=4)
    assert np.array_equal(robust._flatwise([{"x": np.arange(40, dtype=np.float32)}], [lambda c: c[0]] * 2,
                                           chunk=4)["x"], np.arange(40))


@pytest.mark.parametrize("k", [1, 2, 3, 4, 5, 8, 16])
@pytest.mark.parametrize("equal", [True, False])
def test_the_column_kernel_gives_the_sorting_kernels_values(k, equal):
    """The trimmed mean without a sort (a network of minima and maxima for equal weights,
    ranks for unequal ones) against the kernel that sorts each coordinate's K values, ties
    included (broken in worker order, as the stable sort breaks them): with equal weights the
    same bits; with unequal ones within a float32 rounding, as the ranked sums go in worker
    order, not in the order of the values (only the shepherd combines, so only determinism
    on its own code matters, which the order-of-arrival test checks)."""
    rng = np.random.default_rng(k)
    deltas = [{"x": rng.standard_normal(5_003).astype(np.float32), "y": rng.standard_normal((3, 2)).astype(np.float32)}
              for _ in range(k)]
    for d in deltas[1:]:
        d["x"][:800] = deltas[0]["x"][:800]  # ties between every worker
        d["x"][800:900] = np.float32(0.5) * (d["x"][800:900] > 0)
    w = np.full(k, 1 / k) if equal else capped_weights(list(rng.uniform(0.2, 2.0, k)), 1.0)
    for trim in (0.0, 0.1, 0.25, 0.4):
        fast = trimmed_mean(deltas, w, trim)
        for name in ("x", "y"):
            rows = np.stack([d[name].reshape(-1) for d in deltas], axis=1)
            slow = robust.trimmed_mean_block(rows, w, trim).reshape(deltas[0][name].shape)
            if equal:
                assert fast[name].tobytes() == slow.tobytes(), (trim, name)
            else:
                np.testing.assert_allclose(fast[name], slow, rtol=2**-22, atol=1e-30)


def test_unknown_rule_is_a_config_error():
    with pytest.raises(ConfigError):
        combine("median_of_means", {"a": vec(1.0)}, {"a": 1}, POLICY)


def test_aggregate_screens_then_caps_then_combines():
    deltas = {"a": vec(1.0, 1.0), "b": vec(1.2, 0.8), "c": vec(0.9, 1.1), "d": vec(50.0, -50.0)}
    tokens = {"a": 10, "b": 10, "c": 10, "d": 1e9}
    agg = aggregate(deltas, tokens, POLICY)
    assert list(agg.screened) == ["d"]
    assert agg.weights == pytest.approx({"a": 1 / 3, "b": 1 / 3, "c": 1 / 3})
    assert set(agg.norms) == set(deltas)
    # trimmed mean of the three: per coordinate, 1/12 of the extremes and 1/3 of the middle, over 1/2
    np.testing.assert_allclose(agg.delta["x"], [(0.9 / 12 + 1.0 / 3 + 1.2 / 12) / 0.5,
                                                (0.8 / 12 + 1.0 / 3 + 1.1 / 12) / 0.5], rtol=1e-6)
