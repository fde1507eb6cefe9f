"""Node identity: one Ed25519 key on disk that is also the libp2p peer id."""

from __future__ import annotations

import os
import stat
from pathlib import Path

import pytest

from pcp_p2p.core.errors import BadSignature, IdentityError
from pcp_p2p.core.identity import KEY_FILE, Identity, load_or_create_identity, verify_signature


def test_created_with_mode_0600_and_reused(tmp_path: Path) -> None:
    a = load_or_create_identity(tmp_path / "d")
    path = tmp_path / "d" / KEY_FILE
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    b = load_or_create_identity(tmp_path / "d")
    assert a.peer_id == b.peer_id
    assert a.peer_id.startswith("12D3KooW")
    assert load_or_create_identity(tmp_path / "other").peer_id != a.peer_id


def test_refuses_a_key_others_can_read(tmp_path: Path) -> None:
    load_or_create_identity(tmp_path)
    os.chmod(tmp_path / KEY_FILE, 0o644)
    with pytest.raises(IdentityError, match="chmod 600"):
        load_or_create_identity(tmp_path)


def test_refuses_a_corrupt_key_file(tmp_path: Path) -> None:
    (tmp_path / KEY_FILE).write_bytes(b"garbage")
    os.chmod(tmp_path / KEY_FILE, 0o600)
    with pytest.raises(IdentityError):
        load_or_create_identity(tmp_path)


def test_libp2p_peer_id_is_the_signing_key() -> None:
    ident = Identity.generate()
    assert ident.libp2p_id.to_base58() == ident.peer_id
    assert ident.key_pair.public_key.to_bytes() == ident.public_key_bytes


def test_signatures_verify_only_for_their_signer() -> None:
    a, b = Identity.generate(), Identity.generate()
    sig = a.sign(b"data")
    verify_signature(a.peer_id, b"data", sig)
    with pytest.raises(BadSignature):
        verify_signature(b.peer_id, b"data", sig)
    with pytest.raises(BadSignature):
        verify_signature(a.peer_id, b"other", sig)
    with pytest.raises(BadSignature):
        verify_signature(a.peer_id, b"data", b"")
    with pytest.raises(BadSignature):
        verify_signature("not-a-peer-id", b"data", sig)


def test_repr_hides_the_seed() -> None:
    ident = Identity.generate()
    assert ident.seed.hex() not in repr(ident)
