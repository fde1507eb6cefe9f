"""A node's identity: one Ed25519 key, on disk, that is also its libp2p peer id.

The same 32-byte seed drives two views of one key:

- a ``cryptography`` Ed25519 key, which signs everything that confers
  authority in PCP (member records, run specs, manifests, leases, commits);
- a py-libp2p ``KeyPair``, which the host uses for Noise, so the peer id a
  connection is authenticated as *is* the key that signs records. A record
  can then be checked against the peer id it claims with no key lookup: an
  Ed25519 peer id embeds its public key (identity multihash).

The key lives in ``<data-dir>/identity.key`` (mode 0600), created on first start
and reused afterwards, so a restarted node keeps its peer id.
"""

from __future__ import annotations

import os
import stat
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path

import platformdirs
from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives.asymmetric.ed25519 import (
    Ed25519PrivateKey,
    Ed25519PublicKey,
)
from cryptography.hazmat.primitives.serialization import (
    Encoding,
    NoEncryption,
    PrivateFormat,
    PublicFormat,
)
from libp2p.crypto.ed25519 import Ed25519PrivateKey as Libp2pEd25519PrivateKey
from libp2p.crypto.ed25519 import Ed25519PublicKey as Libp2pEd25519PublicKey
from libp2p.crypto.keys import KeyPair
from libp2p.peer.id import ID

from pcp_p2p.core.errors import BadSignature, IdentityError

KEY_FILE = "identity.key"
_SEED_LEN = 32
_FILE_MAGIC = b"pcp-ed25519-v1\n"


def default_data_dir() -> Path:
    """The platform's per-user data directory for PCP."""
    return Path(platformdirs.user_data_dir("pcp", appauthor=False))


@dataclass(frozen=True)
class Identity:
    """An Ed25519 signing key and the libp2p peer id it defines."""

    seed: bytes

    def __post_init__(self) -> None:
        if len(self.seed) != _SEED_LEN:
            raise IdentityError("an Ed25519 seed has 32 bytes")

    @classmethod
    def generate(cls) -> Identity:
        key = Ed25519PrivateKey.generate()
        return cls(key.private_bytes(Encoding.Raw, PrivateFormat.Raw, NoEncryption()))

    @property
    def private_key(self) -> Ed25519PrivateKey:
        return _private_key(self.seed)

    @property
    def public_key_bytes(self) -> bytes:
        return self.private_key.public_key().public_bytes(Encoding.Raw, PublicFormat.Raw)

    @property
    def key_pair(self) -> KeyPair:
        """The same key as py-libp2p wants it for the host."""
        priv = Libp2pEd25519PrivateKey.from_bytes(self.seed)
        return KeyPair(priv, priv.get_public_key())

    @property
    def libp2p_id(self) -> ID:
        return _peer_id(self.seed)

    @property
    def peer_id(self) -> str:
        """The peer id in its usual base58 form (``12D3KooW...``)."""
        return self.libp2p_id.to_base58()

    def sign(self, data: bytes) -> bytes:
        return self.private_key.sign(data)

    def __repr__(self) -> str:  # never print the seed
        return f"Identity({self.peer_id})"


@lru_cache(maxsize=64)
def _private_key(seed: bytes) -> Ed25519PrivateKey:
    return Ed25519PrivateKey.from_private_bytes(seed)


@lru_cache(maxsize=64)
def _peer_id(seed: bytes) -> ID:
    priv = Libp2pEd25519PrivateKey.from_bytes(seed)
    return ID.from_pubkey(priv.get_public_key())


def load_or_create_identity(data_dir: Path) -> Identity:
    """Read ``<data_dir>/identity.key``, creating it (mode 0600) on first start.

    A key file readable by others is refused rather than silently used: whoever
    can read it can sign as this node.
    """
    data_dir = Path(data_dir)
    path = data_dir / KEY_FILE
    if path.exists():
        mode = stat.S_IMODE(path.stat().st_mode)
        if mode & 0o077:
            raise IdentityError(
                f"{path} is accessible by other users (mode {mode:o}); "
                f"run `chmod 600 {path}` if that was not intended"
            )
        raw = path.read_bytes()
        if not raw.startswith(_FILE_MAGIC) or len(raw) != len(_FILE_MAGIC) + _SEED_LEN:
            raise IdentityError(f"{path} is not a PCP identity key file")
        return Identity(raw[len(_FILE_MAGIC) :])
    try:
        data_dir.mkdir(parents=True, exist_ok=True)
        ident = Identity.generate()
        tmp = path.with_suffix(".tmp")
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(fd, "wb") as f:
            f.write(_FILE_MAGIC + ident.seed)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except OSError as exc:
        raise IdentityError(f"cannot create {path}: {exc}") from exc
    return ident


@lru_cache(maxsize=4096)
def public_key_of(peer_id: str) -> Ed25519PublicKey:
    """The Ed25519 public key embedded in a peer id; :class:`BadSignature` if none."""
    try:
        key = ID.from_base58(peer_id).extract_public_key()
    except Exception as exc:  # base58 / multihash / protobuf errors of many types
        raise BadSignature(f"not a valid peer id: {peer_id!r:.80}") from exc
    if not isinstance(key, Libp2pEd25519PublicKey):
        raise BadSignature(f"peer id {peer_id!r:.80} does not embed an Ed25519 key")
    return Ed25519PublicKey.from_public_bytes(key.to_bytes())


def verify_signature(peer_id: str, data: bytes, signature: bytes) -> None:
    """Raise :class:`BadSignature` unless ``signature`` is ``peer_id``'s over ``data``."""
    if not isinstance(signature, bytes) or len(signature) != 64:
        raise BadSignature("missing or malformed signature")
    try:
        public_key_of(peer_id).verify(signature, data)
    except InvalidSignature as exc:
        raise BadSignature(f"signature does not verify for {peer_id}") from exc
