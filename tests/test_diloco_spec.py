"""Run specs: TOML parsing with clear errors, signing, verification, run ids."""

from __future__ import annotations

import dataclasses

import pytest

from pcp_p2p.core.errors import BadSignature, ConfigError, MalformedMessage
from pcp_p2p.core.identity import Identity
from pcp_p2p.diloco.protocol.spec import (
    RunSpec,
    SignedRunSpec,
    load_spec,
    parse_spec,
    run_id_of,
    sign_spec,
    verify_spec,
)
from pcp_p2p.wire import decode, encode

FULL = """
name = "shakespeare-tiny"
seed = 3
[model]
preset = "small"
[inner]
lr = 6e-4
beta1 = 0.9
beta2 = 0.95
weight_decay = 0.1
grad_clip = 1.0
batch_size = 32
seq_len = 128
[outer]
lr = 0.7
momentum = 0.9
[round]
time_budget_s = 30
deadline_s = 60.0
max_inner_steps = 200
rounds = 10
min_quorum = 3
delta_codec = "int8"
[data]
dataset = "/tmp/corpus"
[targets]
allowed = ["cpu-x86_64-v3"]
"""


def test_defaults_follow_diloco():
    spec = parse_spec("")
    assert spec == RunSpec()
    assert (spec.outer.lr, spec.outer.momentum) == (0.7, 0.9)
    assert spec.dataset == "shakespeare" and spec.model == "tiny"


def test_full_spec_parses():
    spec = parse_spec(FULL)
    assert spec.model == "small" and spec.seed == 3
    assert spec.inner.batch_size == 32 and spec.inner.lr == 6e-4
    assert spec.round.time_budget_s == 30.0 and isinstance(spec.round.time_budget_s, float)
    assert spec.round.min_quorum == 3 and spec.dataset == "/tmp/corpus"
    assert spec.targets == ("cpu-x86_64-v3",) and spec.tokens_per_step == 32 * 128


def test_load_spec_from_file(tmp_path):
    p = tmp_path / "run.toml"
    p.write_text(FULL)
    assert load_spec(p) == parse_spec(FULL)
    with pytest.raises(ConfigError, match="cannot read"):
        load_spec(tmp_path / "missing.toml")


@pytest.mark.parametrize(
    "text, key",
    [
        ("[inner]\nlr = -1.0", "inner.lr"),
        ("[inner]\nlr = nan", "inner.lr"),
        ("[inner]\nbeta2 = 1.0", "inner.beta2"),
        ("[inner]\nbatch_size = 0", "inner.batch_size"),
        ("[inner]\nbatch_size = 1.5", "inner.batch_size"),
        ("[outer]\nmomentum = 1.0", "outer.momentum"),
        ("[outer]\nlr = 0", "outer.lr"),
        ("[round]\ndeadline_s = 10.0\ntime_budget_s = 20.0", "round.deadline_s"),
        ("[round]\nmin_quorum = 0", "round.min_quorum"),
        ("[round]\ndelta_codec = \"zip\"", "round.delta_codec"),
        ("[round]\ntoken_slack = 0.5", "round.token_slack"),
        ("[model]\npreset = \"huge\"", "model.preset"),
        ("[targets]\nallowed = []", "targets.allowed"),
        ("[inner]\nlearning_rate = 0.1", "inner.learning_rate"),
        ("colour = 1", "colour"),
        ("name = 5", "name"),
        ("[data]\ndataset = 3", "[data]"),
    ],
)
def test_bad_values_name_the_key(text, key):
    with pytest.raises(ConfigError, match=key.replace("[", r"\[").replace("]", r"\]")):
        parse_spec(text)


def test_invalid_toml_is_a_config_error():
    with pytest.raises(ConfigError, match="not valid TOML"):
        parse_spec("[inner\nlr = 1")


def test_sign_verify_round_trip_and_run_id():
    owner = Identity(b"\x05" * 32)
    spec = parse_spec(FULL)
    signed = sign_spec(spec, owner)
    assert signed.owner == owner.peer_id
    back = decode(encode(signed), SignedRunSpec)
    assert verify_spec(back) == spec
    assert run_id_of(back) == run_id_of(signed)  # the id survives the wire
    other = sign_spec(dataclasses.replace(spec, seed=4), owner)
    assert run_id_of(other) != run_id_of(signed)


def test_tampered_or_misattributed_spec_is_refused():
    owner, mallory = Identity(b"\x05" * 32), Identity(b"\x06" * 32)
    signed = sign_spec(parse_spec(FULL), owner)
    tampered = dataclasses.replace(signed, spec=dataclasses.replace(signed.spec, seed=99))
    with pytest.raises(BadSignature):
        verify_spec(tampered)
    with pytest.raises(BadSignature):
        verify_spec(dataclasses.replace(signed, owner=mallory.peer_id))


def test_signed_spec_with_out_of_range_values_is_a_remote_fault():
    owner = Identity(b"\x05" * 32)
    bad = RunSpec(outer=dataclasses.replace(RunSpec().outer, momentum=1.5))
    unsigned = SignedRunSpec(spec=bad, owner=owner.peer_id)
    from pcp_p2p.wire import signing_bytes

    signed = dataclasses.replace(unsigned, signature=owner.sign(signing_bytes(unsigned)))
    with pytest.raises(MalformedMessage, match=r"outer\.momentum"):
        verify_spec(signed)
    with pytest.raises(ConfigError):
        sign_spec(bad, owner)
