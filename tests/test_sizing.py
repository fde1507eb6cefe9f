"""Memory-aware sizing: the model of a worker's need, the shepherd's plan, the refusal, free memory."""

from __future__ import annotations

import dataclasses
import subprocess
import sys

import numpy as np
import pytest

from pcp_p2p.compile.memory import (
    fit_micro_batch,
    micro_batch_choices,
    per_sample_bytes,
    train_memory_bytes,
)
from pcp_p2p.compile.model import PRESETS, GPTConfig, num_params, preset
from pcp_p2p.compile.programs import ProgramOptions
from pcp_p2p.core.errors import ConfigError, RejectedUpdate
from pcp_p2p.diloco.protocol.sizing import plan_memory
from pcp_p2p.diloco.protocol.spec import MODEL_PRESETS, InnerOptimizer, RunSpec

MIB = 1 << 20
KEPT = 4


def test_presets_span_tiny_to_100m() -> None:
    assert set(MODEL_PRESETS) == set(PRESETS)
    counts = {name: num_params(preset(name, 65)) for name in PRESETS}
    assert counts["tiny"] < counts["small"] < counts["medium"] < counts["large"]
    assert 95e6 <= counts["large"] <= 105e6


def test_need_grows_with_micro_batch_and_sequence() -> None:
    cfg = PRESETS["medium"]
    assert per_sample_bytes(cfg, 256) > 4 * per_sample_bytes(cfg, 64)  # the attention scores are T²
    needs = [train_memory_bytes(cfg, 64, m, KEPT) for m in (1, 2, 4, 8, 16)]
    assert needs == sorted(needs) and len(set(needs)) == 5
    assert train_memory_bytes(cfg, 64, 4, KEPT) < train_memory_bytes(cfg, 64, 4, KEPT + 1)  # kept states cost


def test_fit_picks_the_largest_divisor_that_fits() -> None:
    cfg = PRESETS["small"]
    assert micro_batch_choices(12) == (12, 6, 4, 3, 2, 1)
    roomy = train_memory_bytes(cfg, 128, 12, KEPT)
    assert fit_micro_batch(cfg, 12, 128, roomy, KEPT) == 12
    between = train_memory_bytes(cfg, 128, 5, KEPT)  # 5 does not divide 12: the next divisor below
    assert fit_micro_batch(cfg, 12, 128, between, KEPT) == 4
    assert fit_micro_batch(cfg, 12, 128, train_memory_bytes(cfg, 128, 1, KEPT), KEPT) == 1
    assert fit_micro_batch(cfg, 12, 128, train_memory_bytes(cfg, 128, 1, KEPT) - 1, KEPT) is None


def _spec(model: str, batch: int, seq: int) -> RunSpec:
    return dataclasses.replace(RunSpec(model=model), inner=InnerOptimizer(batch_size=batch, seq_len=seq)).validate()


def test_plan_sizes_for_the_smallest_member_that_can_train() -> None:
    cfg, spec = PRESETS["small"], _spec("small", 64, 128)
    big = train_memory_bytes(cfg, 128, 64, KEPT)
    mid = train_memory_bytes(cfg, 128, 8, KEPT) + MIB  # fits 8, not 16
    tiny_node = train_memory_bytes(cfg, 128, 1, KEPT) - MIB  # cannot train at all
    plan = plan_memory(spec, cfg, [big, mid, tiny_node, 0], KEPT)
    assert (plan.batch, plan.micro_batch, plan.sized) == (64, 8, True)
    assert plan.need_bytes == train_memory_bytes(cfg, 128, 8, KEPT) <= mid
    # everyone it was sized for is admitted, the one that cannot train is told why, in one line
    assert plan.why_not(big) is None and plan.why_not(mid) is None and plan.why_not(0) is None
    reason = plan.why_not(tiny_node)
    assert reason is not None and "\n" not in reason and "even at 1 sequence per pass" in reason
    # a later joiner that could train at 4 but not at this term's 8 is refused until the next term
    late = plan.why_not(train_memory_bytes(cfg, 128, 4, KEPT))
    assert late is not None and "micro-batch 8 of 64" in late
    # unmeasured or roomy members only: the batch stays whole (the artifacts of before sizing)
    assert plan_memory(spec, cfg, [0, 0], KEPT).micro_batch == 64
    assert not plan_memory(spec, cfg, [big], KEPT).sized


def test_one_member_cannot_shrink_everyones_micro_batch() -> None:
    """Free memory is each member's own word: on an open run a fresh key advertising just enough for
    one sequence per pass must not make every worker take B passes per step. Below a quarter of the
    members it is left out (and refused for the term); from a quarter on, the members decide."""
    cfg, spec = PRESETS["small"], _spec("small", 64, 128)
    big = train_memory_bytes(cfg, 128, 64, KEPT)
    one = train_memory_bytes(cfg, 128, 1, KEPT)  # just enough for one sequence per pass
    plan = plan_memory(spec, cfg, [big, big, big, one], KEPT)
    assert plan.micro_batch == 64 and plan.why_not(one) is not None
    assert plan_memory(spec, cfg, [big, big, one, one], KEPT).micro_batch == 1


def test_the_shepherd_refuses_a_join_it_cannot_fit() -> None:
    """The plan's reason reaches the worker as a typed, one-line RejectedUpdate from on_join."""
    from pcp_p2p.core.identity import Identity
    from pcp_p2p.diloco.algorithm.outer import OuterState
    from pcp_p2p.diloco.protocol.messages import Join, sign
    from pcp_p2p.diloco.protocol.shepherd import Shepherd

    cfg, spec = PRESETS["tiny"], _spec("tiny", 16, 64)
    roomy, short = Identity.generate(), Identity.generate()
    free = {roomy.peer_id: train_memory_bytes(cfg, 64, 16, KEPT),
            short.peer_id: train_memory_bytes(cfg, 64, 1, KEPT) // 2}
    plan = plan_memory(spec, cfg, free.values(), KEPT)
    shepherd = Shepherd(spec=spec, run_id="run", identity=Identity.generate(), term=1,
                        state=OuterState.initial({"w": np.zeros(2, np.float32)}),
                        admit=lambda peer: plan.why_not(free[peer]))
    assert shepherd.on_join(sign(Join("run", roomy.peer_id, "cpu-x86_64-v3", 1000.0), roomy), 0.0) == []
    (rejected,) = shepherd.on_join(sign(Join("run", short.peer_id, "cpu-x86_64-v3", 1000.0), short), 0.0)
    assert isinstance(rejected.error, RejectedUpdate)
    assert "out of memory" in str(rejected.error) and "\n" not in str(rejected.error)
    assert roomy.peer_id in shepherd.roster
    assert short.peer_id not in shepherd.roster


def test_program_options_micro_batch_must_divide_the_batch() -> None:
    assert ProgramOptions(batch=16, micro_batch=4).micro_batches == 4
    assert ProgramOptions(batch=16).micro_batches == 1
    with pytest.raises(ConfigError, match="micro_batch"):
        ProgramOptions(batch=16, micro_batch=5)


@pytest.mark.slow
def test_micro_batches_take_the_same_step() -> None:
    """B/M passes accumulate the gradient of one pass: losses and weights agree to float rounding."""
    import jax

    from pcp_p2p.compile.model import init_params, param_names
    from pcp_p2p.compile.programs import build_program

    cfg = GPTConfig(vocab_size=17, block_size=16, n_layer=1, n_head=2, n_embd=8)  # jit in seconds
    names = param_names(cfg)
    p = init_params(cfg, 0)
    rng = np.random.default_rng(0)
    xs = rng.integers(0, cfg.vocab_size, (2, 8, 16)).astype(np.int32)
    ys = rng.integers(0, cfg.vocab_size, (2, 8, 16)).astype(np.int32)
    args = [*(p[n] for n in names), *(np.zeros_like(p[n]) for n in names), *(np.zeros_like(p[n]) for n in names),
            np.int32(0), np.float32(1e-3), xs, ys]
    outs = [jax.jit(build_program("train", cfg, ProgramOptions(inner_steps=2, batch=8, seq=16, micro_batch=m)).fn)(
        *args) for m in (0, 2)]
    whole, split = ([np.asarray(a) for a in o] for o in outs)
    np.testing.assert_allclose(split[-1], whole[-1], atol=1e-5)
    moved = max(float(np.max(np.abs(whole[i] - p[n]))) for i, n in enumerate(names))
    worst = max(float(np.max(np.abs(split[i] - whole[i]))) for i in range(len(names)))
    assert moved > 1e-3 and worst < 1e-4  # the weights moved, identically up to rounding


def test_free_memory_sees_a_data_rlimit() -> None:
    """A node under ``ulimit -d`` advertises at most that (the executor child inherits the limit)."""
    code = ("import resource; resource.setrlimit(resource.RLIMIT_DATA, (700 << 20, resource.RLIM_INFINITY)); "
            "from pcp_p2p.net.capabilities import free_memory_bytes; print(free_memory_bytes())")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=True)
    assert int(out.stdout.strip()) == 700 << 20
    from pcp_p2p.net.capabilities import free_memory_bytes

    assert free_memory_bytes() > 0


def test_the_term_set_up_sizes_from_the_runs_member_records() -> None:
    """Members of other runs and peers the run does not admit do not count (a stranger cannot shrink
    everyone's micro-batch); a member's refusal comes from its own record."""
    from types import SimpleNamespace

    from pcp_p2p.diloco.run.engine import KEEP_STATES
    from pcp_p2p.diloco.run.run_setup import TermSetUp

    cfg, spec = PRESETS["small"], _spec("small", 64, 128)

    def member(peer: str, free: int, runs: tuple[str, ...] = ("run",)) -> SimpleNamespace:
        return SimpleNamespace(record=SimpleNamespace(peer_id=peer, runs=runs,
                                                      capabilities=SimpleNamespace(memory_free_bytes=free)))

    members = {"a": member("a", train_memory_bytes(cfg, 128, 64, KEEP_STATES)),
               "b": member("b", train_memory_bytes(cfg, 128, 16, KEEP_STATES)),
               "other-run": member("other-run", train_memory_bytes(cfg, 128, 2, KEEP_STATES), runs=("another",)),
               "banned": member("banned", train_memory_bytes(cfg, 128, 1, KEEP_STATES)),
               "short": member("short", 1 << 20)}
    admission = SimpleNamespace(why_not=lambda peer: "banned" if peer == "banned" else None)
    rt = SimpleNamespace(run_id="run", spec=spec, dataset=SimpleNamespace(vocab_size=cfg.vocab_size),
                         machine=SimpleNamespace(admission=admission),
                         node=SimpleNamespace(membership=SimpleNamespace(live=lambda: list(members.values()),
                                                                         get=members.get)))
    setup = TermSetUp(rt)  # type: ignore[arg-type]  # only the fields the plan reads
    plan = setup.memory_plan()
    assert plan.micro_batch == 16
    assert setup.memory_refusal(plan, "a") is None and setup.memory_refusal(plan, "unknown") is None
    assert "out of memory" in (setup.memory_refusal(plan, "short") or "")
    assert "micro-batch 16 of 64" in (setup.memory_refusal(plan, "other-run") or "")
