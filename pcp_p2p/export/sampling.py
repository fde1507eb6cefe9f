"""The one token sampler, written so a WebAssembly guest can repeat it bit for bit.

``pcp generate`` samples in Python and the wasi-nn guest (``guest/generate.c``)
samples in C; for one seed both must pick the same tokens from the same logits.
numpy's generator (PCG64 plus its ``choice``) and libm's ``exp`` cannot be
reproduced exactly in a guest, so the rule here uses only what IEEE 754 fixes
bit for bit everywhere: integer arithmetic modulo 2**64 and double-precision
``+ - * /``, ``floor`` and scaling by a power of two.

The rule, which ``generate.c`` mirrors line for line:

1. **PRNG**: SplitMix64 (Steele, Lea, Flood 2014). The state starts at the seed
   (mod 2**64); each draw adds ``0x9E3779B97F4A7C15`` and mixes. A uniform
   double in ``[0, 1)`` is the top 53 bits of a draw times ``2**-53``.
2. Logits must all be finite (NaN compares differently across languages).
   **Greedy** when ``temperature <= 0``: the first index of the largest logit.
3. Otherwise, with ``m`` the largest logit (float32 widened to double),
   weights ``w_i = exp_det((l_i - m) / temperature)``, ``total`` their sum from
   index 0 up, ``target = u * total`` for one uniform ``u``; the token is the
   first ``i`` whose running sum exceeds ``target`` (the last index of positive
   weight if rounding leaves none).
4. ``exp_det(x)`` for ``x <= 0``: 0 below -700; else ``k = floor(x * INV_LN2 + 0.5)``,
   ``r = (x - k*LN2_HI) - k*LN2_LO`` (Cody and Waite), a degree-13 Taylor
   polynomial in Horner form with coefficients ``1/n!`` computed by division,
   scaled by ``2**k`` (``ldexp``; exact, since the result stays normal).

Text from the two engines can still differ where their *logits* differ (JAX
against ONNX Runtime, about 1e-7 apart) and a draw falls that close to a
boundary between two tokens' shares. Measured: 4,500 characters from the tiny
preset at temperature 1 (three seeds, 1,500 each) came out identical.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

from pcp_p2p.core.errors import InvalidInput

MASK64 = (1 << 64) - 1
GOLDEN = 0x9E3779B97F4A7C15
LN2_HI = 6.93147180369123816490e-01  # ln 2 split in two (fdlibm's constants): k*LN2_HI is exact
LN2_LO = 1.90821492927058770002e-10
INV_LN2 = 1.44269504088896338700e00
EXP_FLOOR = -700.0  # below this a weight is 0 (keeps 2**k normal, so ldexp is exact)
TAYLOR_DEGREE = 13
# 1/n! for n = 0..13, each one IEEE division of exact integers (n! < 2**53).
_INV_FACT = tuple(1.0 / float(math.factorial(n)) for n in range(TAYLOR_DEGREE + 1))


class SplitMix64:
    """SplitMix64: a 64-bit state, one add and two multiply-xorshift mixes per draw."""

    __slots__ = ("state",)

    def __init__(self, seed: int) -> None:
        self.state = seed & MASK64

    def next_u64(self) -> int:
        self.state = (self.state + GOLDEN) & MASK64
        z = self.state
        z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & MASK64
        z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & MASK64
        return z ^ (z >> 31)

    def uniform(self) -> float:
        """A double in ``[0, 1)`` from the draw's top 53 bits."""
        return (self.next_u64() >> 11) * (1.0 / 9007199254740992.0)


def exp_det(x: float) -> float:
    """``e**x`` for ``x <= 0`` from IEEE basic operations only (see the module docstring)."""
    if x < EXP_FLOOR:
        return 0.0
    k = math.floor(x * INV_LN2 + 0.5)
    r = (x - k * LN2_HI) - k * LN2_LO
    p = _INV_FACT[TAYLOR_DEGREE]
    for n in range(TAYLOR_DEGREE - 1, -1, -1):
        p = p * r + _INV_FACT[n]
    return math.ldexp(p, k)


def sample_token(logits: Sequence[float], temperature: float, rng: SplitMix64) -> int:
    """The next token id from one row of float32 logits (see the module docstring's rule)."""
    row = [float(v) for v in logits]
    if not all(math.isfinite(v) for v in row):  # max() and comparisons with NaN differ between languages
        raise InvalidInput("the model's logits are not finite (a diverged θ?)")
    m = max(row)
    if temperature <= 0:
        return row.index(m)
    weights = [exp_det((v - m) / temperature) for v in row]
    total = 0.0
    for w in weights:
        total += w
    target = rng.uniform() * total
    acc = 0.0
    for i, w in enumerate(weights):
        acc += w
        if target < acc:
            return i
    return max(i for i, w in enumerate(weights) if w > 0)
