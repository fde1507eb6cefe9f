"""A deterministic character tokenizer, the one nanoGPT's ``shakespeare_char`` uses.

The vocabulary is the *sorted* set of characters of a text, so every node that
builds it from the same text gets the same ids in the same order, and the
tokenizer itself is small enough to ship inside a run spec (:meth:`to_dict`).

This module imports only numpy: workers use it without JAX.
"""

from __future__ import annotations

from collections.abc import Iterable

import numpy as np

from pcp_p2p.core.errors import InvalidInput, MalformedMessage

MAX_VOCAB = 1 << 16  # a char vocabulary above this is almost surely a mistake (binary data)


class CharTokenizer:
    """Maps each character of a fixed, sorted vocabulary to its index (``int32``)."""

    __slots__ = ("_index", "vocab")

    def __init__(self, vocab: Iterable[str]) -> None:
        vocab = tuple(vocab)
        if not vocab:
            raise InvalidInput("a tokenizer needs at least one character")
        if len(vocab) > MAX_VOCAB:
            raise InvalidInput(f"vocabulary of {len(vocab)} characters > {MAX_VOCAB}")
        if any(not isinstance(c, str) or len(c) != 1 for c in vocab):
            raise InvalidInput("every vocabulary entry must be one character")
        if list(vocab) != sorted(set(vocab)):
            raise InvalidInput("vocabulary must be sorted and without duplicates")
        self.vocab: tuple[str, ...] = vocab
        self._index = {c: i for i, c in enumerate(vocab)}

    @classmethod
    def from_text(cls, text: str) -> CharTokenizer:
        """The tokenizer whose vocabulary is the sorted set of ``text``'s characters."""
        if not isinstance(text, str):
            raise InvalidInput("from_text takes a str")
        return cls(sorted(set(text)))

    @property
    def vocab_size(self) -> int:
        return len(self.vocab)

    def encode(self, text: str) -> np.ndarray:
        """Token ids (``int32``, shape ``(len(text),)``); unknown characters raise."""
        index = self._index
        try:
            return np.fromiter((index[c] for c in text), dtype=np.int32, count=len(text))
        except KeyError as exc:
            raise InvalidInput(f"character {exc.args[0]!r} is not in the vocabulary") from None

    def decode(self, ids: Iterable[int] | np.ndarray) -> str:
        """The text for a sequence of ids; ids out of range raise :class:`InvalidInput`."""
        arr = np.asarray(ids)
        if arr.ndim != 1 or (arr.size and not np.issubdtype(arr.dtype, np.integer)):
            raise InvalidInput("decode takes a 1-d sequence of integer ids")
        if arr.size and (arr.min() < 0 or arr.max() >= len(self.vocab)):
            raise InvalidInput(f"token id out of range [0, {len(self.vocab)})")
        vocab = self.vocab
        return "".join(vocab[i] for i in arr.tolist())

    def to_dict(self) -> dict[str, str]:
        """A msgpack/JSON-able description: ``{"kind": "char", "vocab": "<chars>"}``."""
        return {"kind": "char", "vocab": "".join(self.vocab)}

    @classmethod
    def from_dict(cls, d: object) -> CharTokenizer:
        """Inverse of :meth:`to_dict`; a malformed dict raises :class:`MalformedMessage`."""
        if not isinstance(d, dict) or d.get("kind") != "char" or not isinstance(d.get("vocab"), str):
            raise MalformedMessage("not a char tokenizer description")
        try:
            return cls(d["vocab"])
        except InvalidInput as exc:
            raise MalformedMessage(f"bad tokenizer vocabulary: {exc}") from exc

    def __eq__(self, other: object) -> bool:
        return isinstance(other, CharTokenizer) and other.vocab == self.vocab

    def __hash__(self) -> int:
        return hash(self.vocab)

    def __repr__(self) -> str:
        return f"CharTokenizer(vocab_size={self.vocab_size})"
