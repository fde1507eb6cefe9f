"""The character tokenizer: deterministic, round-trips, refuses what it cannot encode."""

from __future__ import annotations

import json

import msgpack
import numpy as np
import pytest

from pcp_p2p.compile.tokenizer import CharTokenizer
from pcp_p2p.core.errors import InvalidInput, MalformedMessage

TEXT = "First Citizen:\nBefore we proceed any further, hear me speak.\n"


def test_vocab_is_sorted_set_of_chars():
    tok = CharTokenizer.from_text(TEXT)
    assert tok.vocab == tuple(sorted(set(TEXT)))
    assert tok.vocab_size == len(set(TEXT))
    # the same text in another order gives the same ids
    assert CharTokenizer.from_text(TEXT[::-1]) == tok


def test_encode_decode_round_trip():
    tok = CharTokenizer.from_text(TEXT)
    ids = tok.encode(TEXT)
    assert ids.dtype == np.int32 and ids.shape == (len(TEXT),)
    assert tok.decode(ids) == TEXT
    assert tok.decode(ids.tolist()) == TEXT
    assert tok.encode("").shape == (0,)
    assert tok.decode([]) == ""
    assert tok.encode("\n")[0] == 0  # '\n' sorts first


def test_unknown_char_and_bad_ids_raise():
    tok = CharTokenizer.from_text("abc")
    with pytest.raises(InvalidInput):
        tok.encode("abz")
    with pytest.raises(InvalidInput):
        tok.decode([0, 3])
    with pytest.raises(InvalidInput):
        tok.decode([-1])
    with pytest.raises(InvalidInput):
        CharTokenizer.from_text("")


def test_dict_round_trip_through_json_and_msgpack():
    tok = CharTokenizer.from_text(TEXT)
    d = tok.to_dict()
    assert CharTokenizer.from_dict(json.loads(json.dumps(d))) == tok
    assert CharTokenizer.from_dict(msgpack.unpackb(msgpack.packb(d))) == tok


@pytest.mark.parametrize(
    "bad",
    [None, {}, {"kind": "bpe", "vocab": "ab"}, {"kind": "char", "vocab": "ba"},
     {"kind": "char", "vocab": "aa"}, {"kind": "char", "vocab": ""}, {"kind": "char", "vocab": 3}],
)
def test_from_dict_refuses_malformed(bad):
    with pytest.raises(MalformedMessage):
        CharTokenizer.from_dict(bad)
