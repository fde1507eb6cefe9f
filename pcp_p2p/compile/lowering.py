"""JAX program → StableHLO text, made acceptable to every IREE GPU backend.

Lowering is pinned to the ``cpu`` platform whatever accelerator the compiling
node has, so two shepherds with different hardware produce the same text (and
hence the same StableHLO hash and artifact CIDs).

**The GPU rewrite.** IREE 3.13's CUDA, HIP, Vulkan and Metal pipelines fail
on a raw JAX training graph with "failed to get neutral element for
reduction". The culprit is ``reduce(add, negate(x))``, which the backward
pass of LayerNorm and softmax emits. Since the init value is zero,
``reduce(add, negate(x), 0) == negate(reduce(add, x, 0))`` exactly (negation
is exact in IEEE arithmetic and commutes with rounding), so we rewrite::

    %n = stablehlo.negate %x : T
    %r = stablehlo.reduce(%n init: %zero) applies stablehlo.add across dimensions = D : (T, S) -> R

into::

    %n = stablehlo.negate %x : T                      (dead unless used elsewhere)
    %pcp_pos_r = stablehlo.reduce(%x init: %zero) applies stablehlo.add across dimensions = D : (T, S) -> R
    %r = stablehlo.negate %pcp_pos_r : R

The rewrite works on the printed text (one reduce per line, the form JAX
prints), per function (SSA names are scoped by ``func.func``), and only where
the init value is a literal zero constant. It leaves CPU numerics unchanged
and is applied to every target so all artifacts of a program share one
StableHLO hash.
"""

from __future__ import annotations

import re

from pcp_p2p.compile.programs import Program
from pcp_p2p.core.errors import CompileError

_FUNC = re.compile(r"^\s*func\.func\b")
_NEGATE = re.compile(r"^\s*(%[\w$.-]+) = stablehlo\.negate (%[\w$.-]+) : (.+)$")
_ZERO = re.compile(
    r"^\s*(%[\w$.-]+) = stablehlo\.constant dense<(?:0\.0+e\+00|0\.0|-?0)> : tensor<[a-z0-9]+>$"
)
_REDUCE_ADD = re.compile(
    r"^(\s*)(%[\w$.-]+) = stablehlo\.reduce\((%[\w$.-]+) init: (%[\w$.-]+)\) "
    r"applies stablehlo\.add across dimensions = (\[[\d, ]*\]) : \((.+)\) -> (tensor<[^>]*>)$"
)


def gpu_compatible(stablehlo: str) -> str:
    """Rewrite every ``reduce(add, negate(x), 0)`` into ``negate(reduce(add, x, 0))``."""
    negated: dict[str, str] = {}  # %n -> %x, for negates in the current function
    zeros: set[str] = set()
    out: list[str] = []
    for line in stablehlo.split("\n"):
        if _FUNC.match(line):
            negated.clear()
            zeros.clear()
        elif m := _NEGATE.match(line):
            negated[m.group(1)] = m.group(2)
        elif m := _ZERO.match(line):
            zeros.add(m.group(1))
        elif (m := _REDUCE_ADD.match(line)) and m.group(3) in negated and m.group(4) in zeros:
            indent, result, operand, init, dims, types, rtype = m.groups()
            positive = f"%pcp_pos_{result[1:]}"
            out.append(
                f"{indent}{positive} = stablehlo.reduce({negated[operand]} init: {init}) "
                f"applies stablehlo.add across dimensions = {dims} : ({types}) -> {rtype}"
            )
            out.append(f"{indent}{result} = stablehlo.negate {positive} : {rtype}")
            continue
        out.append(line)
    return "\n".join(out)


def lower(program: Program) -> str:
    """StableHLO text of ``program`` (lowered for the cpu platform, GPU rewrite applied)."""
    import jax

    try:
        traced = jax.jit(program.fn).trace(*program.input_structs())
        text = traced.lower(lowering_platforms=("cpu",)).as_text(dialect="stablehlo")
    except Exception as exc:  # JAX raises many types for a bad program
        raise CompileError(f"lowering {program.name} failed: {exc}") from exc
    return gpu_compatible(text)
