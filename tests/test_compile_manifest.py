"""Signed manifests and the artifact cache (no compiler needed: artifacts are made-up bytes)."""

from __future__ import annotations

import dataclasses
import os

import pytest

from pcp_p2p.compile.cache import ArtifactCache, cache_key
from pcp_p2p.compile.manifest import Manifest, read_manifest, sign_manifest, verify_manifest, write_manifest
from pcp_p2p.compile.signature import TensorSpec, check_array
from pcp_p2p.compile.targets import compile_flags, get_target
from pcp_p2p.core.cid import cid_of
from pcp_p2p.core.errors import BadSignature, ConfigError, HashMismatch, InvalidInput, MalformedMessage
from pcp_p2p.core.identity import Identity
from pcp_p2p.wire import decode, encode

ART = os.urandom(4096)
ALICE, MALLORY = Identity.generate(), Identity.generate()


def make_manifest(for_target: str = "cpu-x86_64-v3", data: bytes = ART, signer: Identity = ALICE,
                  **changes) -> Manifest:
    t = get_target(for_target)
    m = Manifest(
        program="train", model="tiny", model_config={"n_layer": 4, "n_embd": 64},
        options={"inner_steps": 10, "beta1": 0.9}, stablehlo_hash=cid_of(b"module {}"),
        target=t.name, driver=t.driver, compiler_version="3.13.0@abc", flags=compile_flags(t),
        artifact_cid=cid_of(data), artifact_size=len(data),
        inputs=(TensorSpec("param/wte", (65, 64), "float32"), TensorSpec("lr", (), "float32")),
        outputs=(TensorSpec("losses", (10,), "float32"),), signer="",
    )
    return sign_manifest(dataclasses.replace(m, **changes), signer)


def test_sign_verify_and_round_trip():
    m = make_manifest()
    assert m.signer == ALICE.peer_id and len(m.signature) == 64
    verify_manifest(m, ART, expected_signer=ALICE.peer_id)
    again = decode(encode(m), Manifest)
    assert again == m
    verify_manifest(again, ART)
    assert m.to_json_dict()["inputs"][0] == {"name": "param/wte", "shape": [65, 64], "dtype": "float32"}


def test_manifest_file_round_trip(tmp_path):
    m = make_manifest()
    write_manifest(tmp_path / "a.manifest", m)
    assert read_manifest(tmp_path / "a.manifest") == m
    assert (tmp_path / "a.json").exists()
    with pytest.raises(ConfigError):
        read_manifest(tmp_path / "missing.manifest")
    (tmp_path / "bad.manifest").write_bytes(b"\x93garbage")
    with pytest.raises(MalformedMessage):
        read_manifest(tmp_path / "bad.manifest")


def test_truncated_or_altered_artifact_is_refused():
    m = make_manifest()
    with pytest.raises(HashMismatch):
        verify_manifest(m, ART[:-1])
    altered = bytearray(ART)
    altered[100] ^= 1
    with pytest.raises(HashMismatch):
        verify_manifest(m, bytes(altered))


def test_manifest_for_another_artifact_is_refused():
    """A validly signed manifest does not vouch for different bytes of the same size."""
    other = os.urandom(len(ART))
    with pytest.raises(HashMismatch):
        verify_manifest(make_manifest(), other)


def test_signed_by_another_key_is_refused():
    m = make_manifest(signer=MALLORY)
    verify_manifest(m, ART)  # a valid signature, but...
    with pytest.raises(BadSignature):
        verify_manifest(m, ART, expected_signer=ALICE.peer_id)
    # ...claiming Alice as signer with Mallory's signature
    forged = dataclasses.replace(m, signer=ALICE.peer_id)
    with pytest.raises(BadSignature):
        verify_manifest(forged, ART)


@pytest.mark.parametrize("field", ["artifact_cid", "target", "flags", "compiler_version",
                                   "stablehlo_hash", "options", "inputs"])
def test_any_changed_field_breaks_the_signature(field):
    m = make_manifest()
    changes = {
        "artifact_cid": cid_of(b"other"),
        "target": "cpu-x86_64-v4",
        "flags": compile_flags(get_target("cpu-x86_64-v4")),
        "compiler_version": "3.14.0@def",
        "stablehlo_hash": cid_of(b"module { }"),
        "options": {"inner_steps": 11, "beta1": 0.9},
        "inputs": (TensorSpec("param/wte", (65, 64), "float32"), TensorSpec("lr", (1,), "float32")),
    }
    tampered = dataclasses.replace(m, **{field: changes[field]})
    if field in ("target", "flags"):  # flags and target disagree: caught before the key
        with pytest.raises(MalformedMessage):
            verify_manifest(tampered)
        return
    with pytest.raises(BadSignature):
        verify_manifest(tampered)


def test_unsigned_manifest_is_refused():
    with pytest.raises(BadSignature):
        verify_manifest(dataclasses.replace(make_manifest(), signature=b""))


@pytest.mark.parametrize(
    "changes",
    [
        {"target": "cuda-sm90"},
        {"driver": "cuda"},
        {"flags": (*compile_flags(get_target("cpu-x86_64-v3"))[:-1], "--iree-llvmcpu-target-cpu=x86-64-v4")},
        {"program": "finetune"},
        {"artifact_size": 0},
        {"artifact_cid": "not-a-cid"},
        {"inputs": ()},
    ],
)
def test_malformed_fields_are_refused_even_when_signed(changes):
    """A manifest cannot call AVX-512 code "x86-64-v3", even with a good signature."""
    with pytest.raises(MalformedMessage):
        verify_manifest(make_manifest(**changes))


def test_check_array():
    spec = TensorSpec("xs", (2, 3), "int32")
    import numpy as np

    assert check_array(spec, np.zeros((2, 3), np.int32)).shape == (2, 3)
    with pytest.raises(InvalidInput):
        check_array(spec, np.zeros((2, 3), np.int64))
    with pytest.raises(InvalidInput):
        check_array(spec, np.zeros((3, 2), np.int32))
    lr = TensorSpec("lr", (), "float32")
    assert check_array(lr, 3e-4).dtype == np.float32
    with pytest.raises(InvalidInput):
        check_array(lr, True)
    step = TensorSpec("step", (), "int32")
    assert int(check_array(step, 7)) == 7
    with pytest.raises(InvalidInput):
        check_array(step, 2**40)
    with pytest.raises(InvalidInput):
        check_array(step, 1.5)


# --- cache --------------------------------------------------------------------------


def test_cache_round_trip_and_damage(tmp_path):
    cache = ArtifactCache(tmp_path)
    flags = compile_flags(get_target("cpu-x86_64-v3"))
    key = cache_key(cid_of(b"module {}"), "cpu-x86_64-v3", "3.13.0@abc", flags)
    assert cache.get(key) is None
    assert cache.put(key, ART) == cid_of(ART)
    assert cache.get(key) == ART
    # every part of the key matters
    assert key != cache_key(cid_of(b"module {}"), "cpu-x86_64-v3", "3.13.1@abc", flags)
    assert key != cache_key(cid_of(b"module {}"), "cpu-x86_64-v3", "3.13.0@abc", (*flags, "-O3"))
    assert key != cache_key(cid_of(b"module { }"), "cpu-x86_64-v3", "3.13.0@abc", flags)
    # a damaged entry is a miss and is dropped, never a wrong artifact
    vmfb = next(tmp_path.rglob("*.vmfb"))
    vmfb.write_bytes(ART[:-10])
    assert cache.get(key) is None
    assert not vmfb.exists()
    assert not list(tmp_path.rglob("*.tmp"))
    with pytest.raises(ConfigError):
        cache.get("../../etc/passwd")
