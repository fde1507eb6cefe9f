"""StableHLO lowering, the GPU rewrite, the target registry and CPU-variant choice."""

from __future__ import annotations

import pytest

from pcp_p2p.compile.lowering import gpu_compatible
from pcp_p2p.compile.targets import TARGETS, X86_64_V3_FLAGS, X86_64_V4_FLAGS, get_target, parse_targets
from pcp_p2p.core.errors import ConfigError
from pcp_p2p.executor.cpu import (
    CpuInfo,
    best_cpu_target,
    cpu_can_run,
    cpu_of,
    parse_cpuinfo,
    runnable_cpu_targets,
)

NEG_REDUCE = """\
module @jit_f {
  func.func public @main(%arg0: tensor<4x8xf32>) -> (tensor<4xf32>) {
    %cst = stablehlo.constant dense<0.000000e+00> : tensor<f32>
    %0 = stablehlo.negate %arg0 : tensor<4x8xf32>
    %1 = stablehlo.reduce(%0 init: %cst) applies stablehlo.add across dimensions = [1] : (tensor<4x8xf32>, tensor<f32>) -> tensor<4xf32>
    return %1 : tensor<4xf32>
  }
  func.func private @other(%arg0: tensor<4x8xf32>) -> (tensor<4xf32>) {
    %cst = stablehlo.constant dense<1.000000e+00> : tensor<f32>
    %0 = stablehlo.negate %arg0 : tensor<4x8xf32>
    %1 = stablehlo.reduce(%0 init: %cst) applies stablehlo.add across dimensions = [1] : (tensor<4x8xf32>, tensor<f32>) -> tensor<4xf32>
    return %1 : tensor<4xf32>
  }
}"""  # noqa: E501  (StableHLO prints an op on one line; the rewrite matches that text)


def test_gpu_rewrite_moves_negate_out_of_zero_init_reduce():
    out = gpu_compatible(NEG_REDUCE)
    main, other = out.split("func.func private")
    assert "%pcp_pos_1 = stablehlo.reduce(%arg0 init: %cst) applies stablehlo.add" in main
    assert "%1 = stablehlo.negate %pcp_pos_1 : tensor<4xf32>" in main
    assert "return %1" in main
    # init 1.0 is not a neutral element: negate(reduce(x, 1)) != reduce(-x, 1); left alone.
    # (The %cst of @other is also a different value than @main's: names are per function.)
    assert "pcp_pos" not in other
    assert gpu_compatible(out) == out  # idempotent


def test_gpu_rewrite_leaves_other_reductions_alone():
    text = NEG_REDUCE.replace("stablehlo.negate %arg0", "stablehlo.exponential %arg0")
    assert gpu_compatible(text) == text
    text = NEG_REDUCE.replace("applies stablehlo.add", "applies stablehlo.maximum")
    assert gpu_compatible(text) == text


def test_lowering_is_deterministic_and_rewritten():
    pytest.importorskip("jax")
    from conftest_compile import lowered

    low = lowered("train")
    assert low.stablehlo.startswith("module @jit_train")
    assert "pcp_pos_" in low.stablehlo  # the backward pass has reduce(add, negate(x))
    assert "stablehlo.while" in low.stablehlo  # H inner steps are one loop, not H copies
    # lowering again (a fresh trace) gives the same text
    from pcp_p2p.compile.pipeline import lower_program

    again = lower_program("train", low.program.config, low.program.options)
    assert again.stablehlo_hash == low.stablehlo_hash


# --- targets ------------------------------------------------------------------------

NAMED = ["cpu-x86_64-v4", "cpu-x86_64-v3", "cpu-x86_64-generic", "cpu-aarch64", "cpu-apple-m1",
         "cuda-sm75", "cuda-sm80", "cuda-sm86", "cuda-sm89", "rocm-gfx90a", "rocm-gfx942",
         "rocm-gfx1100", "vulkan", "metal"]


def test_registry_has_every_named_target_with_driver_and_no_host_cpu():
    assert sorted(TARGETS) == sorted(NAMED)
    drivers = {t.driver for t in TARGETS.values()}
    assert drivers == {"local-task", "cuda", "hip", "vulkan", "metal"}
    for t in TARGETS.values():
        assert not any(f.endswith("=host") for f in t.flags), t.name
        assert any(f.startswith("--iree-hal-target-device=") for f in t.flags)
    assert "--iree-llvmcpu-target-cpu=x86-64-v4" in get_target("cpu-x86_64-v4").flags
    assert "--iree-cuda-target=sm_80" in get_target("cuda-sm80").flags
    assert "--iree-rocm-target=gfx942" in get_target("rocm-gfx942").flags


def test_parse_targets():
    assert [t.name for t in parse_targets("cpu-x86_64-v3, cuda-sm80,cpu-x86_64-v3")] == [
        "cpu-x86_64-v3", "cuda-sm80"]
    assert {t.name for t in parse_targets("cpu")} == {n for n in NAMED if n.startswith("cpu-")}
    assert len(parse_targets("all")) == len(NAMED)
    with pytest.raises(ConfigError):
        parse_targets("cuda-sm90")
    with pytest.raises(ConfigError):
        parse_targets(" , ")


# --- CPU variant choice ----------------------------------------------------------------

CPUINFO_V3 = """processor\t: 0
vendor_id\t: AuthenticAMD
flags\t\t: fpu vme sse sse2 ssse3 sse4_1 sse4_2 popcnt avx avx2 bmi1 bmi2 fma f16c abm movbe xsave
"""


def test_parse_cpuinfo():
    assert {"avx2", "abm", "sse4_2"} <= parse_cpuinfo(CPUINFO_V3)
    assert parse_cpuinfo("processor : 0\nFeatures : fp asimd evtstrm\n") == {"fp", "asimd", "evtstrm"}
    assert parse_cpuinfo("") == frozenset()


@pytest.mark.parametrize(
    ("cpu", "best"),
    [
        (CpuInfo("x86_64", frozenset(X86_64_V4_FLAGS)), "cpu-x86_64-v4"),
        (CpuInfo("x86_64", parse_cpuinfo(CPUINFO_V3)), "cpu-x86_64-v3"),
        (CpuInfo("x86_64", frozenset(X86_64_V4_FLAGS) - {"avx512vl"}), "cpu-x86_64-v3"),
        (CpuInfo("x86_64", frozenset(X86_64_V3_FLAGS) - {"movbe"}), "cpu-x86_64-generic"),
        (CpuInfo("x86_64", frozenset()), "cpu-x86_64-generic"),
        (cpu_of("aarch64", ["fp", "asimd"]), "cpu-aarch64"),
        (cpu_of("arm64", []), "cpu-apple-m1"),
    ],
)
def test_best_cpu_variant(cpu, best):
    assert best_cpu_target(cpu).name == best
    for t in runnable_cpu_targets(cpu):
        assert cpu_can_run(t, cpu) is None


def test_cpu_can_run_explains_refusals():
    v3 = CpuInfo("x86_64", parse_cpuinfo(CPUINFO_V3))
    assert "avx512f" in cpu_can_run(get_target("cpu-x86_64-v4"), v3)
    assert "aarch64" in cpu_can_run(get_target("cpu-aarch64"), v3)
    assert "not a CPU target" in cpu_can_run(get_target("cuda-sm80"), v3)
    assert cpu_can_run(get_target("cpu-aarch64"), cpu_of("arm64", [])) is None  # Macs run it too
    with pytest.raises(ConfigError):
        best_cpu_target(CpuInfo("riscv64", frozenset()))
