"""Tensor payloads: round trips within each codec's stated bound; hostile input refused."""

from __future__ import annotations

import struct

import msgpack
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

from pcp_p2p.blob.tensor_codec import MAGIC, MAX_TENSORS, decode_tensors, encode_tensors
from pcp_p2p.core.errors import InvalidInput, MalformedMessage, OversizedMessage, PcpError

LIMIT = 1 << 24

shapes = hnp.array_shapes(min_dims=0, max_dims=3, min_side=0, max_side=40)
f32 = hnp.arrays(np.float32, shapes, elements=st.floats(-1e6, 1e6, width=32))


@settings(max_examples=60, deadline=None)
@given(f32)
def test_fp32_is_exact(x: np.ndarray) -> None:
    y = decode_tensors(encode_tensors({"w": x}, "fp32"), max_bytes=LIMIT)["w"]
    assert y.dtype == x.dtype and y.shape == x.shape
    np.testing.assert_array_equal(y, x)


@settings(max_examples=60, deadline=None)
@given(hnp.arrays(np.float32, shapes, elements=st.floats(-60000, 60000, width=32)))
def test_fp16_error_bound(x: np.ndarray) -> None:
    y = decode_tensors(encode_tensors({"w": x}, "fp16"), max_bytes=LIMIT)["w"]
    bound = np.maximum(np.abs(x.astype(np.float64)) * 2.0**-11, 2.0**-25)
    assert np.all(np.abs(y.astype(np.float64) - x) <= bound)


@settings(max_examples=80, deadline=None)
@given(f32, st.sampled_from([1, 7, 256, 1024]))
def test_int8_error_bound_per_block(x: np.ndarray, block: int) -> None:
    data = encode_tensors({"g": x}, "int8", block=block)
    y = decode_tensors(data, max_bytes=LIMIT)["g"]
    assert y.shape == x.shape
    flat = x.reshape(-1).astype(np.float64)
    err = np.abs(y.reshape(-1).astype(np.float64) - flat)
    for b in range(0, flat.size, block):
        blk = flat[b : b + block]
        scale = float(np.float32(np.max(np.abs(blk)) / 127.0))
        assert np.all(err[b : b + block] <= scale / 2 + np.abs(blk) * 2.0**-23 + 1e-30)


def test_int8_is_about_four_times_smaller() -> None:
    x = np.random.default_rng(0).standard_normal(100_000).astype(np.float32)
    assert len(encode_tensors({"g": x}, "int8")) < 0.27 * len(encode_tensors({"g": x}, "fp32"))


def test_many_named_tensors_keep_names_dtypes_shapes() -> None:
    rng = np.random.default_rng(1)
    named = {
        "a": rng.standard_normal((3, 4)).astype(np.float32),
        "b.bias": rng.standard_normal(5).astype(np.float16),
        "c": np.float64(2.5) * np.ones(()),
        "empty": np.zeros((0, 7), np.float32),
    }
    for codec in ("fp32", "fp16", "int8"):
        out = decode_tensors(encode_tensors(named, codec), max_bytes=LIMIT)
        assert list(out) == list(named)
        for k, v in named.items():
            assert out[k].shape == v.shape and out[k].dtype == v.dtype


@pytest.mark.parametrize("bad", [np.nan, np.inf, -np.inf])
@pytest.mark.parametrize("codec", ["fp32", "fp16", "int8"])
def test_non_finite_input_is_refused(bad: float, codec: str) -> None:
    x = np.ones(10, np.float32)
    x[3] = bad
    with pytest.raises(InvalidInput):
        encode_tensors({"x": x}, codec)


def test_fp16_overflow_and_bad_dtype_are_refused() -> None:
    with pytest.raises(InvalidInput):
        encode_tensors({"x": np.array([1e6], np.float32)}, "fp16")
    with pytest.raises(InvalidInput):
        encode_tensors({"x": np.array([1, 2], np.int32)}, "fp32")
    with pytest.raises(InvalidInput):
        encode_tensors({"x": np.ones(2, np.float32)}, "bf7")


def _payload(entries: list[dict], data: bytes) -> bytes:
    header = msgpack.packb([1, "blob.tensors", {"tensors": entries}], use_bin_type=True)
    return MAGIC + struct.pack(">I", len(header)) + header + data


def test_declared_shape_must_match_bytes_present() -> None:
    e = {"name": "w", "dtype": "float32", "shape": [1000, 1000], "codec": "fp32", "block": 0}
    with pytest.raises(MalformedMessage):
        decode_tensors(_payload([e], b"\0" * 16), max_bytes=LIMIT)
    e["shape"] = [2, 2]
    decode_tensors(_payload([e], b"\0" * 16), max_bytes=LIMIT)
    with pytest.raises(MalformedMessage):  # trailing bytes
        decode_tensors(_payload([e], b"\0" * 17), max_bytes=LIMIT)


def test_declared_size_above_limit_is_oversized() -> None:
    e = {"name": "w", "dtype": "float64", "shape": [10**9, 10**9], "codec": "int8", "block": 256}
    with pytest.raises(OversizedMessage):
        decode_tensors(_payload([e], b""), max_bytes=LIMIT)
    small = encode_tensors({"w": np.ones(1000, np.float32)}, "fp32")
    with pytest.raises(OversizedMessage):
        decode_tensors(small, max_bytes=1000)


def test_tensor_count_is_bounded() -> None:
    e = [{"name": f"t{i}", "dtype": "float32", "shape": [0], "codec": "fp32", "block": 0}
         for i in range(MAX_TENSORS + 1)]
    with pytest.raises(OversizedMessage):
        decode_tensors(_payload(e, b""), max_bytes=LIMIT)


def test_non_finite_payload_and_negative_scale_are_refused() -> None:
    e = {"name": "w", "dtype": "float32", "shape": [2], "codec": "fp32", "block": 0}
    with pytest.raises(MalformedMessage):
        decode_tensors(_payload([e], np.array([1, np.nan], "<f4").tobytes()), max_bytes=LIMIT)
    e = {"name": "w", "dtype": "float32", "shape": [2], "codec": "int8", "block": 4}
    with pytest.raises(MalformedMessage):
        decode_tensors(_payload([e], np.array([-1.0], "<f4").tobytes() + b"\1\1"), max_bytes=LIMIT)


@settings(max_examples=300, deadline=None)
@given(st.binary(max_size=300))
def test_random_bytes_raise_only_pcp_errors(data: bytes) -> None:
    for blob in (data, MAGIC + data):
        try:
            decode_tensors(blob, max_bytes=LIMIT)
        except PcpError:
            pass


@settings(max_examples=300, deadline=None)
@given(st.sampled_from(["fp32", "fp16", "int8"]), st.integers(0, 10**6), st.integers(0, 255),
       st.integers(0, 40))
def test_mutated_payloads_raise_only_pcp_errors(codec: str, pos: int, byte: int, cut: int) -> None:
    x = {"a": np.linspace(-3, 3, 50, dtype=np.float32).reshape(5, 10), "b": np.ones(3, np.float16)}
    raw = bytearray(encode_tensors(x, codec, block=8))
    raw[pos % len(raw)] = byte
    try:
        decode_tensors(bytes(raw[: len(raw) - cut]), max_bytes=LIMIT)
    except PcpError:
        pass


@pytest.mark.parametrize("block", [256, 1000])
def test_int8_across_slabs_matches_the_per_block_definition(block: int) -> None:
    rng = np.random.default_rng(3)
    x = (rng.standard_normal(2_500_003) * np.exp(rng.uniform(-5, 5, 2_500_003))).astype(np.float32)
    y = decode_tensors(encode_tensors({"g": x}, "int8", block=block), max_bytes=1 << 26)["g"]
    pad = np.zeros(-(-x.size // block) * block)
    pad[: x.size] = x
    scale = (np.abs(pad.reshape(-1, block)).max(axis=1) / 127).astype(np.float32).astype(np.float64)
    bound = np.repeat(scale / 2, block)[: x.size] + np.abs(x) * 2.0**-23
    assert np.all(np.abs(y.astype(np.float64) - x) <= bound)


@settings(max_examples=80, deadline=None)
@given(st.integers(1, 3000), st.sampled_from([1, 7, 256, 1024]), st.sampled_from(["float16", "float32", "float64"]),
       st.integers(0, 2**32 - 1))
def test_int8_decodes_to_the_exact_product_rounded_once(n: int, block: int, dtype: str, seed: int) -> None:
    """Arbitrary int8 values and scales (subnormal to huge, as a sender may write them): each
    value decodes to q·s computed exactly (float64) and rounded once to the declared dtype, or
    the whole bundle is refused as non-finite — the float32 fast path is bit for bit that."""
    rng = np.random.default_rng(seed)
    nblocks = -(-n // block)
    scales = np.exp2(rng.uniform(-149, 128, nblocks)).astype(np.float32)
    q = rng.integers(-127, 128, n, dtype=np.int8)
    e = {"name": "w", "dtype": dtype, "shape": [n], "codec": "int8", "block": block}
    with np.errstate(over="ignore"):
        want = (q.astype(np.float64) * np.repeat(scales.astype(np.float64), block)[:n]).astype(dtype)
    data = _payload([e], scales.astype("<f4").tobytes() + q.tobytes())
    if not np.all(np.isfinite(want)):
        with pytest.raises(MalformedMessage):
            decode_tensors(data, max_bytes=LIMIT)
        return
    got = decode_tensors(data, max_bytes=LIMIT)["w"]
    assert got.dtype == np.dtype(dtype) and got.tobytes() == want.tobytes()


@pytest.mark.parametrize("n,block", [(2_500_003, 256), (1_000_001, 1000), (300, 1), (77, 7), (5, 256),
                                     (65536 * 3 + 5, 65536 * 2)])
def test_int8_of_float32_is_the_definitions_bytes(n: int, block: int) -> None:
    """The float32 encoder (cached slabs, float32 maxima) against the definition in float64:
    the same bytes, zero blocks, subnormals and a short last block included."""
    from pcp_p2p.blob.tensor_codec import _encode_int8, _encode_int8_exact

    rng = np.random.default_rng(n)
    x = (rng.standard_normal(n) * np.exp(rng.uniform(-30, 30, n))).astype(np.float32)
    x[:block] = 0
    x[block : block + 9] = np.float32(1e-41)
    assert _encode_int8(x, block) == _encode_int8_exact(x, block)
    y = x.astype(np.float64)  # other dtypes take the definition itself
    assert _encode_int8(y, block) == _encode_int8_exact(y, block)
