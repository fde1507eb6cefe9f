"""A worker takes the announced dataset from the bundled corpus when it is the same blob, else fetches it."""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest
import trio

from pcp_p2p.core.cid import cid_of
from pcp_p2p.core.errors import VerificationError
from pcp_p2p.diloco.algorithm.data import SHAKESPEARE, CharDataset, encode_dataset
from pcp_p2p.diloco.run.runtime import RunRuntime


class _Io:
    def __init__(self, blobs: dict[str, bytes]) -> None:
        self.blobs, self.fetched, self.kept, self.pinned = blobs, [], [], []
        self.pins = SimpleNamespace(for_dataset=self.pinned.append)

    async def fetch_bytes(self, cid: str, hint: str | None = None, **kw: object) -> bytes:
        self.fetched.append(cid)
        return self.blobs[cid]

    async def keep(self, data: bytes, *, for_run: bool = False) -> str:
        self.kept.append(cid_of(data))
        return cid_of(data)


def runtime(io: _Io, dataset: str) -> RunRuntime:
    rt = RunRuntime.__new__(RunRuntime)
    rt.io, rt.spec = io, SimpleNamespace(dataset=dataset)  # type: ignore[assignment]
    rt.node = SimpleNamespace(log_once=lambda *a: None)  # type: ignore[assignment]
    rt.machine = SimpleNamespace(worker=None)  # type: ignore[assignment]
    rt._bundled, rt._bundled_ready = None, None
    return rt


def announcing(cid: str) -> SimpleNamespace:
    return SimpleNamespace(dataset_cid=cid, shepherd="shepherd")


async def test_the_bundled_corpus_is_encoded_here_and_not_fetched() -> None:
    io = _Io({})
    rt = runtime(io, SHAKESPEARE)
    rt._bundled_ready = trio.Event()
    async with trio.open_nursery() as n:
        n.start_soon(rt._encode_bundled)
        ds = await rt._announced_dataset(announcing(cid_of(encode_dataset(CharDataset.load(SHAKESPEARE)))))
    assert io.fetched == [] and len(io.kept) == 1 and io.pinned == io.kept  # kept, pinned and served
    assert np.array_equal(ds.train, CharDataset.load(SHAKESPEARE).train)


async def test_another_blob_than_the_bundled_one_is_fetched() -> None:
    """A shepherd that announces another encoding (another corpus under the name, another
    version): the announced blob is fetched, the local one is not used."""
    other = encode_dataset(CharDataset.from_text("to be or not to be, that is the question " * 8))
    io = _Io({cid_of(other): other})
    rt = runtime(io, SHAKESPEARE)
    rt._bundled_ready = trio.Event()
    async with trio.open_nursery() as n:
        n.start_soon(rt._encode_bundled)
        ds = await rt._announced_dataset(announcing(cid_of(other)))
    assert io.fetched == [cid_of(other)] and io.kept == [] and io.pinned == [cid_of(other)]
    assert ds.vocab_size == CharDataset.from_text("to be or not to be, that is the question").vocab_size


async def test_a_dataset_path_is_never_read_here_and_a_missing_cid_is_refused(tmp_path) -> None:  # type: ignore[no-untyped-def]
    """A run's path names a file on its owner's machine: a worker fetches the blob and reads
    nothing local (a stranger's spec must not make it read its files)."""
    blob = encode_dataset(CharDataset.from_text("abcdefgh" * 40))
    io = _Io({cid_of(blob): blob})
    rt = runtime(io, str(tmp_path / "corpus.txt"))
    await rt._announced_dataset(announcing(cid_of(blob)))
    assert io.fetched == [cid_of(blob)]
    with pytest.raises(VerificationError):
        await rt._announced_dataset(announcing(""))
