"""The function signature of a compiled program: named, shaped, typed tensors.

A signature travels inside a signed manifest, so a worker knows what to feed
an artifact without JAX, and checks every input against it before a call: a
wrong shape or dtype becomes :class:`~pcp_p2p.core.errors.InvalidInput` in Python
instead of undefined behaviour in native code.
"""

from __future__ import annotations

import numpy as np

from pcp_p2p.core.errors import InvalidInput
from pcp_p2p.wire import Message, wire_struct

# Element types a program may take or return, by numpy name.
DTYPES = ("float32", "int32")
MAX_RANK = 8


@wire_struct
class TensorSpec(Message):
    """One input or output: a name (``param/h.0.ln_1.g``, ``lr``...), a shape, a dtype."""

    name: str
    shape: tuple[int, ...]
    dtype: str

    def __post_init__(self) -> None:
        if self.dtype not in DTYPES:
            raise ValueError(f"{self.name}: dtype {self.dtype!r} not one of {DTYPES}")
        if len(self.shape) > MAX_RANK or any(d < 0 for d in self.shape):
            raise ValueError(f"{self.name}: bad shape {self.shape}")

    @property
    def nbytes(self) -> int:
        return int(np.prod(self.shape, dtype=np.int64)) * np.dtype(self.dtype).itemsize

    def __str__(self) -> str:
        return f"{self.name}: {self.dtype}{list(self.shape)}"


def check_array(spec: TensorSpec, value: object) -> np.ndarray:
    """``value`` as a C-contiguous array of ``spec``'s shape and dtype, or :class:`InvalidInput`.

    Python scalars are accepted for rank-0 specs (``lr=3e-4``, ``step=0``); an
    array of another dtype is refused rather than cast, so int64 token ids or
    float64 parameters are caught where they are made.
    """
    if isinstance(value, (bool, np.bool_)):
        raise InvalidInput(f"{spec.name}: expected {spec.dtype}, got bool")
    if spec.shape == () and isinstance(value, (int, float)):
        # a Python scalar for a rank-0 input: lr=3e-4, step=0
        if spec.dtype == "int32" and not (isinstance(value, int) and -(2**31) <= value < 2**31):
            raise InvalidInput(f"{spec.name}: expected an int32, got {value!r}")
        return np.asarray(value, dtype=spec.dtype)
    arr = np.asarray(value)
    if arr.dtype != np.dtype(spec.dtype):
        raise InvalidInput(f"{spec.name}: expected dtype {spec.dtype}, got {arr.dtype}")
    if arr.shape != tuple(spec.shape):
        raise InvalidInput(f"{spec.name}: expected shape {tuple(spec.shape)}, got {arr.shape}")
    return arr
