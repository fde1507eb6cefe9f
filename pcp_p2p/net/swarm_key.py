"""Private swarms: a libp2p pre-shared key shared by every member.

The file format is go-libp2p's ``swarm.key`` (so keys can be shared with other
libp2p tools)::

    /key/swarm/psk/1.0.0/
    /base16/
    <64 hex digits>

A bare line of 64 hex digits is accepted too. Connections from nodes without
the key fail during the handshake (see shared/notes/py-libp2p.md: it works and
costs about 30% throughput).
"""

from __future__ import annotations

import os
import secrets
from pathlib import Path

from pcp_p2p.core.errors import ConfigError

HEADER = "/key/swarm/psk/1.0.0/"


def read_swarm_key(path: Path) -> str:
    """The 64-hex-digit key in ``path``; ConfigError if absent or malformed."""
    try:
        lines = [ln.strip() for ln in Path(path).read_text().splitlines() if ln.strip()]
    except OSError as exc:
        raise ConfigError(f"cannot read swarm key {path}: {exc.strerror}") from exc
    if lines[:2] == [HEADER, "/base16/"]:
        lines = lines[2:]
    if len(lines) != 1 or len(lines[0]) != 64:
        raise ConfigError(f"{path} is not a swarm key (want {HEADER} /base16/ and 64 hex digits)")
    try:
        bytes.fromhex(lines[0])
    except ValueError as exc:
        raise ConfigError(f"{path}: the swarm key is not hexadecimal") from exc
    return lines[0].lower()


def write_swarm_key(path: Path) -> None:
    """Create a new random swarm key file (mode 0600)."""
    path = Path(path)
    if path.exists():
        raise ConfigError(f"{path} exists; refusing to overwrite a swarm key")
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(f"{HEADER}\n/base16/\n{secrets.token_hex(32)}\n")
