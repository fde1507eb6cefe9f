"""The wire codec: round trips, limits, and 'nothing but our own errors' on garbage."""

from __future__ import annotations

import msgpack
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pcp_p2p.core.errors import (
    MalformedMessage,
    OversizedMessage,
    ProtocolError,
    UnknownMessageType,
    UnknownVersion,
)
from pcp_p2p.wire import Message, decode, encode, registered_types, signing_bytes, wire_message, wire_struct


@wire_struct
class _Inner(Message):
    names: tuple[str, ...]
    size: int | None = None


@wire_message("test.sample", max_size=4096)
class _Sample(Message):
    n: int
    x: float
    label: str
    blob: bytes
    flag: bool
    inner: _Inner
    table: dict[str, float]
    signature: bytes = b""


@wire_message("test.other", max_size=128)
class _Other(Message):
    n: int


SAMPLE = _Sample(7, 1.5, "héllo", b"\x00\x01", True, _Inner(("a", "b"), 3), {"k": 2.0})


def test_round_trip() -> None:
    assert decode(encode(SAMPLE), _Sample) == SAMPLE


def test_messages_are_frozen() -> None:
    with pytest.raises(AttributeError):
        SAMPLE.n = 3  # type: ignore[misc]


def test_signing_bytes_ignore_the_signature() -> None:
    import dataclasses

    signed = dataclasses.replace(SAMPLE, signature=b"x" * 64)
    assert signing_bytes(signed) == signing_bytes(SAMPLE) == encode(SAMPLE)


def test_encode_refuses_oversized() -> None:
    big = _Sample(1, 1.0, "x" * 5000, b"", False, _Inner(()), {})
    with pytest.raises(OversizedMessage):
        encode(big)


def test_decode_refuses_oversized_before_unpacking() -> None:
    data = encode(_Other(1)) + b"\x00" * 200
    with pytest.raises(OversizedMessage):
        decode(data, _Other)


def test_unknown_version() -> None:
    data = msgpack.packb([99, "test.other", {"n": 1}])
    with pytest.raises(UnknownVersion):
        decode(data, _Other)


def test_unknown_tag_and_unexpected_tag() -> None:
    with pytest.raises(UnknownMessageType):
        decode(msgpack.packb([1, "no.such", {}]))
    with pytest.raises(UnknownMessageType):
        decode(encode(_Other(1)), _Sample)


@pytest.mark.parametrize(
    "body",
    [
        {"n": "1"},  # wrong type
        {"n": True},  # bool is not int
        {},  # missing field
        [1],  # body not a map
    ],
)
def test_field_types_are_checked(body: object) -> None:
    with pytest.raises(MalformedMessage):
        decode(msgpack.packb([1, "test.other", body]), _Other)


def test_nested_types_are_checked() -> None:
    obj = msgpack.unpackb(encode(SAMPLE))
    obj[2]["inner"]["names"] = ["a", 5]
    with pytest.raises(MalformedMessage):
        decode(msgpack.packb(obj, use_bin_type=True), _Sample)


def test_trailing_bytes_are_refused() -> None:
    with pytest.raises(MalformedMessage):
        decode(encode(_Other(1)) + b"\xc0", _Other)


def test_every_registered_type_has_a_limit() -> None:
    for tag, cls in registered_types().items():
        assert 0 < cls.MAX_SIZE <= 8 * 1024 * 1024, tag


@settings(max_examples=400, deadline=None)
@given(st.binary(max_size=600))
def test_random_bytes_raise_only_protocol_errors(data: bytes) -> None:
    try:
        decode(data)
    except ProtocolError:
        pass


@settings(max_examples=400, deadline=None)
@given(st.data())
def test_mutated_messages_raise_only_protocol_errors(data: st.DataObject) -> None:
    raw = bytearray(encode(SAMPLE))
    for _ in range(data.draw(st.integers(1, 6))):
        op = data.draw(st.sampled_from(["flip", "cut", "insert"]))
        if op == "flip" and raw:
            i = data.draw(st.integers(0, len(raw) - 1))
            raw[i] = data.draw(st.integers(0, 255))
        elif op == "cut" and raw:
            i = data.draw(st.integers(0, len(raw) - 1))
            del raw[i:]
        else:
            i = data.draw(st.integers(0, len(raw)))
            raw[i:i] = data.draw(st.binary(min_size=1, max_size=8))
    try:
        out = decode(bytes(raw), _Sample)
    except ProtocolError:
        return
    assert isinstance(out, _Sample)


@settings(max_examples=200, deadline=None)
@given(st.recursive(
    st.none() | st.booleans() | st.integers(-(2**63), 2**64 - 1) | st.floats() | st.text(max_size=8)
    | st.binary(max_size=8),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=4), inner, max_size=4),
    max_leaves=20,
))
def test_well_formed_msgpack_of_any_shape_raises_only_protocol_errors(value: object) -> None:
    for wrapped in (value, [1, "test.sample", value], [1, "test.other", value]):
        try:
            decode(msgpack.packb(wrapped, use_bin_type=True))
        except ProtocolError:
            pass


def test_int_in_a_float_field_encodes_identically_after_a_round_trip() -> None:
    """Signatures cover encodings: decode(encode(m)) must re-encode to the same bytes."""
    m = _Sample(7, 2, "x", b"", False, _Inner(()), {"k": 3})  # ints where floats are declared
    data = encode(m)
    assert encode(decode(data, _Sample)) == data
