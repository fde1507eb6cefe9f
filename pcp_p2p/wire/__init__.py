"""The wire codec: typed, versioned, size-limited msgpack messages."""

from pcp_p2p.wire.codec import (
    DEFAULT_MAX_SIZE,
    HARD_MAX_SIZE,
    Message,
    decode,
    encode,
    registered_types,
    signing_bytes,
    wire_message,
    wire_struct,
)

__all__ = [
    "DEFAULT_MAX_SIZE",
    "HARD_MAX_SIZE",
    "Message",
    "decode",
    "encode",
    "registered_types",
    "signing_bytes",
    "wire_message",
    "wire_struct",
]
