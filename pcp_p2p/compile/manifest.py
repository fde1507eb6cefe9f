"""Signed manifests: what an artifact is, who built it, and from what.

An artifact (a ``.vmfb``) is named by its CID, the hash of its bytes. The
manifest binds that CID to everything a worker needs to trust and run it:
the program and model it computes, the StableHLO it was compiled from (by
hash), the target, compiler version and exact flags, the function signature,
and the peer id of the node that compiled it. The compiling node signs the
manifest with its identity key; a worker runs an artifact only after
:func:`verify_manifest` has checked the signature, the signer it expected,
the artifact's size and hash, and that the flags are the ones its own target
registry gives for that target name (so a manifest cannot call code built
for AVX-512 "x86-64-v3").

This module imports neither JAX nor the compiler: workers use it.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any

from pcp_p2p.compile.signature import TensorSpec
from pcp_p2p.compile.targets import TARGETS, allowed_flag_lists
from pcp_p2p.core.cid import check_cid, digest_of_cid
from pcp_p2p.core.errors import BadSignature, ConfigError, HashMismatch, MalformedMessage
from pcp_p2p.core.identity import Identity, verify_signature
from pcp_p2p.wire import Message, decode, encode, signing_bytes, wire_message

MAX_ARTIFACT_SIZE = 1 << 30  # 1 GiB: far above any vmfb (weights are inputs, not constants)
MANIFEST_MAX_SIZE = 1 << 20  # medium's signature lists ~470 tensors; this leaves room


@wire_message("compile.manifest", max_size=MANIFEST_MAX_SIZE)
class Manifest(Message):
    """A signed description of one compiled artifact."""

    program: str  # train | eval | sample
    model: str  # preset name (tiny, small, medium) or "custom"
    model_config: dict[str, int]  # GPTConfig fields
    options: dict[str, int | float]  # ProgramOptions fields (H, B, T, AdamW constants)
    stablehlo_hash: str  # CID of the StableHLO text compiled
    target: str  # name in pcp_p2p.compile.targets.TARGETS
    driver: str  # IREE runtime driver the artifact needs
    compiler_version: str  # iree-compile --version
    flags: tuple[str, ...]  # exact iree-compile flags (input on stdin)
    artifact_cid: str  # CID of the vmfb bytes
    artifact_size: int
    inputs: tuple[TensorSpec, ...]
    outputs: tuple[TensorSpec, ...]
    signer: str  # peer id of the compiling node
    signature: bytes = b""

    def to_bytes(self) -> bytes:
        return encode(self)

    @classmethod
    def from_bytes(cls, data: bytes) -> Manifest:
        return decode(data, cls)

    def to_json_dict(self) -> dict[str, Any]:
        """A readable view (signature in hex), for ``--json`` output and humans."""
        d = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}
        d["inputs"] = [dict(name=s.name, shape=list(s.shape), dtype=s.dtype) for s in self.inputs]
        d["outputs"] = [dict(name=s.name, shape=list(s.shape), dtype=s.dtype) for s in self.outputs]
        d["flags"] = list(self.flags)
        d["signature"] = self.signature.hex()
        return d


def sign_manifest(manifest: Manifest, identity: Identity) -> Manifest:
    """``manifest`` with ``signer`` set to ``identity``'s peer id and signed by it."""
    unsigned = dataclasses.replace(manifest, signer=identity.peer_id, signature=b"")
    return dataclasses.replace(unsigned, signature=identity.sign(signing_bytes(unsigned)))


def check_fields(manifest: Manifest) -> None:
    """Field-level checks that need no key: raise :class:`MalformedMessage`."""
    if not isinstance(manifest, Manifest):
        raise MalformedMessage(f"not a manifest: {type(manifest).__name__}")
    target = TARGETS.get(manifest.target)
    if target is None:
        raise MalformedMessage(f"manifest names an unknown target {manifest.target!r:.40}")
    if manifest.driver != target.driver:
        raise MalformedMessage(f"driver {manifest.driver!r:.20} is not {target.name}'s")
    if manifest.flags not in allowed_flag_lists(target):
        raise MalformedMessage(f"flags do not match this node's definition of {target.name}")
    if manifest.program not in ("train", "eval", "sample"):
        raise MalformedMessage(f"unknown program {manifest.program!r:.40}")
    if not 0 < manifest.artifact_size <= MAX_ARTIFACT_SIZE:
        raise MalformedMessage(f"artifact size {manifest.artifact_size} out of range")
    digest_of_cid(manifest.artifact_cid)
    digest_of_cid(manifest.stablehlo_hash)
    if not manifest.inputs or not manifest.outputs:
        raise MalformedMessage("manifest has an empty signature")
    names = [s.name for s in manifest.inputs]
    if len(set(names)) != len(names):
        raise MalformedMessage("duplicate input names")


def verify_manifest(
    manifest: Manifest,
    artifact_bytes: bytes | bytearray | memoryview | None = None,
    expected_signer: str | None = None,
) -> None:
    """Check fields, signer, signature and (if given) the artifact's size and hash.

    Raises :class:`MalformedMessage`, :class:`BadSignature` or :class:`HashMismatch`.
    """
    check_fields(manifest)
    if expected_signer is not None and manifest.signer != expected_signer:
        raise BadSignature(f"manifest signed by {manifest.signer}, expected {expected_signer}")
    verify_signature(manifest.signer, signing_bytes(manifest), manifest.signature)
    if artifact_bytes is not None:
        if len(artifact_bytes) != manifest.artifact_size:
            raise HashMismatch(
                f"artifact has {len(artifact_bytes)} bytes, manifest says {manifest.artifact_size}"
            )
        check_cid(manifest.artifact_cid, artifact_bytes)


def write_manifest(path: Path, manifest: Manifest) -> None:
    """The encoded manifest at ``path``, plus a readable ``.json`` beside it."""
    from pcp_p2p.compile.cache import atomic_write

    atomic_write(Path(path), manifest.to_bytes())
    text = json.dumps(manifest.to_json_dict(), indent=1, sort_keys=True)
    atomic_write(Path(path).with_suffix(".json"), text.encode())


def read_manifest(path: Path) -> Manifest:
    try:
        data = Path(path).read_bytes()
    except OSError as exc:
        raise ConfigError(f"cannot read manifest {path}: {exc}") from exc
    return Manifest.from_bytes(data)
