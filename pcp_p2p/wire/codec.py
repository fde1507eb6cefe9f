"""One msgpack codec for every PCP message.

Why a codec of our own around msgpack rather than raw ``msgpack.packb`` of
dicts: every message that crosses the network must be *typed* (a frozen
dataclass with a protocol version), *bounded* (a size limit per message type,
enforced before a byte is unpacked, and passed to msgpack so a declared
string or array length cannot make it allocate beyond the limit) and
*checked* (every field has the type its annotation says, recursively), so that
the code behind the codec never meets a surprise. Anything else raises a
:class:`~pcp_p2p.core.errors.ProtocolError` subclass, and nothing else escapes:
the property tests feed random and mutated bytes to :func:`decode` to hold
that line.

On the wire a message is the msgpack array ``[version, tag, {field: value}]``.
Fields are a map so a later version can add optional fields; the version lets
a node refuse what it does not speak instead of misreading it.

Signed messages keep their signature in a ``signature: bytes`` field;
:func:`signing_bytes` is the encoding with that field emptied, so the signed
bytes are exactly what the codec would produce for the same content.
"""

from __future__ import annotations

import dataclasses
import types
import typing
from collections.abc import Callable
from typing import Any, ClassVar, TypeVar, Union, dataclass_transform, get_args, get_origin

import msgpack

from pcp_p2p import PROTOCOL_VERSION
from pcp_p2p.core.errors import (
    MalformedMessage,
    OversizedMessage,
    UnknownMessageType,
    UnknownVersion,
)

DEFAULT_MAX_SIZE = 64 * 1024
HARD_MAX_SIZE = 8 * 1024 * 1024  # nothing framed goes above this; blobs are chunked

_REGISTRY: dict[str, type[Message]] = {}
M = TypeVar("M", bound="Message")


class Message:
    """Base of every wire message. Subclasses are declared with :func:`wire_message`."""

    TAG: ClassVar[str]
    MAX_SIZE: ClassVar[int]
    VERSION: ClassVar[int] = PROTOCOL_VERSION
    # Set by the decorators; declared so the type checker sees every message as
    # a dataclass instance (``dataclasses.fields`` and ``replace`` accept it).
    __dataclass_fields__: ClassVar[dict[str, dataclasses.Field[Any]]]


# ``dataclass_transform`` tells a type checker that these decorators make
# frozen dataclasses, so ``Lease(run_id=..., term=...)`` is checked field by
# field (names, types, required fields) like a plain ``@dataclass`` would be.
@dataclass_transform(frozen_default=True)
def wire_message(tag: str, max_size: int = DEFAULT_MAX_SIZE) -> Callable[[type[M]], type[M]]:
    """Declare a frozen, slotted wire message with a tag and a size limit."""
    if max_size > HARD_MAX_SIZE:
        raise ValueError(f"{tag}: max_size above HARD_MAX_SIZE; chunk the payload instead")

    def wrap(cls: type[M]) -> type[M]:
        if tag in _REGISTRY:
            raise ValueError(f"wire tag {tag!r} declared twice")
        dc = dataclasses.dataclass(frozen=True, slots=True)(cls)
        dc.TAG = tag
        dc.MAX_SIZE = max_size
        _REGISTRY[tag] = dc
        return dc

    return wrap


@dataclass_transform(frozen_default=True)
def wire_struct(cls: type[M]) -> type[M]:
    """Declare a frozen struct nested inside messages (no tag, no own size limit)."""
    return dataclasses.dataclass(frozen=True, slots=True)(cls)


def encode(msg: Message) -> bytes:
    """Bytes for ``msg``; raises :class:`OversizedMessage` above its limit."""
    data: bytes = msgpack.packb([msg.VERSION, msg.TAG, _to_wire(msg)], use_bin_type=True)
    if len(data) > msg.MAX_SIZE:
        raise OversizedMessage(f"{msg.TAG}: {len(data)} bytes > limit {msg.MAX_SIZE}")
    return data


def decode(data: bytes | bytearray | memoryview, *expected: type[M]) -> M:
    """Decode one message, optionally requiring one of ``expected`` types.

    Raises only :class:`~pcp_p2p.core.errors.ProtocolError` subclasses.
    """
    limit = max((cls.MAX_SIZE for cls in expected), default=HARD_MAX_SIZE)
    if not isinstance(data, (bytes, bytearray, memoryview)):
        raise MalformedMessage("message is not bytes")
    if len(data) > limit:
        raise OversizedMessage(f"{len(data)} bytes > limit {limit}")
    try:
        obj = msgpack.unpackb(
            data,
            raw=False,
            strict_map_key=True,
            use_list=True,
            max_str_len=limit,
            max_bin_len=limit,
            max_array_len=limit,
            max_map_len=limit,
            max_ext_len=0,
        )
    except (msgpack.ExtraData, msgpack.FormatError, msgpack.StackError) as exc:
        raise MalformedMessage(f"not one msgpack value: {exc}") from exc
    except (ValueError, TypeError, UnicodeDecodeError, OverflowError) as exc:
        raise MalformedMessage(f"undecodable msgpack: {exc}") from exc
    except Exception as exc:  # msgpack's C extension raises a few odd types
        raise MalformedMessage(f"undecodable msgpack: {type(exc).__name__}") from exc
    if not isinstance(obj, list) or len(obj) != 3:
        raise MalformedMessage("message is not [version, tag, body]")
    version, tag, body = obj
    if not isinstance(tag, str):
        raise MalformedMessage("message tag is not a string")
    cls = _REGISTRY.get(tag)
    if cls is None:
        raise UnknownMessageType(f"unknown message tag {tag!r:.60}")
    if expected and cls not in expected:
        names = ", ".join(c.TAG for c in expected)
        raise UnknownMessageType(f"got {tag!r}, expected one of: {names}")
    if type(version) is not int or version != cls.VERSION:
        raise UnknownVersion(f"{tag}: version {version!r:.20} (this node speaks {cls.VERSION})")
    if len(data) > cls.MAX_SIZE:
        raise OversizedMessage(f"{tag}: {len(data)} bytes > limit {cls.MAX_SIZE}")
    return typing.cast(M, _from_wire_message(cls, body, tag))


def signing_bytes(msg: Message) -> bytes:
    """The bytes a signature covers: the encoding with ``signature`` emptied."""
    return encode(dataclasses.replace(msg, signature=b""))


def registered_types() -> dict[str, type[Message]]:
    """Every declared message type by tag (for docs and tests)."""
    return dict(_REGISTRY)


# --- conversion ---------------------------------------------------------------


def _to_wire(value: Any, tp: Any = Any) -> Any:
    """Plain msgpack-able data for ``value``, coerced to its annotation ``tp``.

    The coercion matters for signatures: a Python ``int`` in a ``float`` field
    would encode as a msgpack int, decode as a float, and re-encode as
    different bytes, so a signature over the sender's bytes would not verify.
    """
    if isinstance(value, Message):
        hints = _hints(type(value))
        return {f.name: _to_wire(getattr(value, f.name), hints[f.name]) for f in dataclasses.fields(value)}
    if type(value) is int and _wants_float(tp):
        return float(value)
    if isinstance(value, tuple):
        args = get_args(tp) if get_origin(tp) is tuple else ()
        if len(args) == 2 and args[1] is Ellipsis:
            return [_to_wire(v, args[0]) for v in value]
        if len(args) == len(value):
            return [_to_wire(v, a) for v, a in zip(value, args)]
        return [_to_wire(v) for v in value]
    if isinstance(value, dict):
        vt = get_args(tp)[1] if get_origin(tp) is dict else Any
        return {k: _to_wire(v, vt) for k, v in value.items()}
    return value


def _wants_float(tp: Any) -> bool:
    if tp is float:
        return True
    if get_origin(tp) in (Union, types.UnionType):
        arms = get_args(tp)
        return float in arms and int not in arms
    return False


_HINTS: dict[type[Message], dict[str, Any]] = {}


def _hints(cls: type[Message]) -> dict[str, Any]:
    """The resolved field annotations of ``cls``, computed once per class.

    A plain dict rather than ``functools.cache``: the type checker does not
    accept a class object as the cache's ``Hashable`` argument.
    """
    hints = _HINTS.get(cls)
    if hints is None:
        hints = _HINTS[cls] = typing.get_type_hints(cls)
    return hints


def _from_wire_message(cls: type[Message], body: Any, where: str) -> Message:
    if not isinstance(body, dict):
        raise MalformedMessage(f"{where}: body is not a map")
    hints = _hints(cls)
    kwargs: dict[str, Any] = {}
    for f in dataclasses.fields(cls):
        if f.name in body:
            kwargs[f.name] = _check(hints[f.name], body[f.name], f"{where}.{f.name}")
        elif f.default is not dataclasses.MISSING:
            kwargs[f.name] = f.default
        elif f.default_factory is not dataclasses.MISSING:
            kwargs[f.name] = f.default_factory()
        else:
            raise MalformedMessage(f"{where}: missing field {f.name!r}")
    try:
        return cls(**kwargs)
    except (ValueError, TypeError) as exc:  # __post_init__ range checks
        raise MalformedMessage(f"{where}: {exc}") from exc


def _check(tp: Any, value: Any, where: str) -> Any:
    """Check ``value`` against annotation ``tp``; return it in its Python form."""
    origin = get_origin(tp)
    if tp is Any:
        return value
    if tp is type(None):
        if value is not None:
            raise MalformedMessage(f"{where}: expected nil")
        return None
    if origin in (Union, types.UnionType):
        for arm in get_args(tp):
            try:
                return _check(arm, value, where)
            except MalformedMessage:
                continue
        raise MalformedMessage(f"{where}: matches none of {tp}")
    if tp is bool:
        if type(value) is not bool:
            raise MalformedMessage(f"{where}: expected bool")
        return value
    if tp is int:
        if type(value) is not int:
            raise MalformedMessage(f"{where}: expected int")
        return value
    if tp is float:
        if type(value) is float:
            return value
        if type(value) is int and abs(value) < 2**53:
            return float(value)
        raise MalformedMessage(f"{where}: expected float")
    if tp is str:
        if type(value) is not str:
            raise MalformedMessage(f"{where}: expected str")
        return value
    if tp is bytes:
        if type(value) is not bytes:
            raise MalformedMessage(f"{where}: expected bytes")
        return value
    if origin is tuple:
        args = get_args(tp)
        if not isinstance(value, list):
            raise MalformedMessage(f"{where}: expected array")
        if len(args) == 2 and args[1] is Ellipsis:
            return tuple(_check(args[0], v, f"{where}[{i}]") for i, v in enumerate(value))
        if len(args) != len(value):
            raise MalformedMessage(f"{where}: expected {len(args)} items")
        return tuple(_check(a, v, f"{where}[{i}]") for i, (a, v) in enumerate(zip(args, value)))
    if origin is dict:
        kt, vt = get_args(tp)
        if not isinstance(value, dict):
            raise MalformedMessage(f"{where}: expected map")
        return {
            _check(kt, k, f"{where}<key>"): _check(vt, v, f"{where}[{k!r:.20}]")
            for k, v in value.items()
        }
    if isinstance(tp, type) and issubclass(tp, Message):
        return _from_wire_message(tp, value, where)
    raise TypeError(f"codec cannot check annotation {tp!r} at {where}")  # a bug in a message class
