"""The AEAD side channel: keys bound to the transfer, tampering and garbage refused."""

from __future__ import annotations

import os
import socket
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest

from pcp_p2p.blob.chunks import hash_bytes
from pcp_p2p.blob.receiver import ChunkPool, ChunkSink, FileSink, MemorySink, accept_chunk, receive_batch
from pcp_p2p.blob.sidechannel import (
    HEADER,
    KIND_CHUNK,
    KIND_HELLO,
    RecordCipher,
    RecordReader,
    derive_key,
    send_record,
    transcript,
)
from pcp_p2p.blob.store import BlobStore
from pcp_p2p.core.cid import cid_of
from pcp_p2p.core.errors import (
    HashMismatch,
    LocalError,
    MalformedMessage,
    OversizedMessage,
    PcpError,
    PeerGone,
    PeerTimeout,
    VerificationError,
)

CS = 64 * 1024
CID = cid_of(b"blob")


def key_for(client: str, server: str, secret: bytes = b"s" * 32) -> bytes:
    return derive_key(secret, b"c" * 16, b"n" * 16, transcript(client, server, CID, CID, 0, 1))


@pytest.fixture
def pair() -> Iterator[tuple[socket.socket, socket.socket]]:
    a, b = socket.socketpair()
    a.settimeout(2)
    b.settimeout(0.3)  # the reader's stall limit
    try:
        yield a, b
    finally:
        a.close()
        b.close()


def test_records_round_trip(pair: tuple[socket.socket, socket.socket]) -> None:
    a, b = pair
    k = key_for("A", "B")
    tx = RecordCipher.for_direction(k, client_to_server=False)
    rx = RecordCipher.for_direction(k, client_to_server=False)
    out = bytearray(CS + 16)
    payloads = [os.urandom(CS), os.urandom(10), b""]
    threading.Thread(target=lambda: [send_record(a, tx, KIND_CHUNK, p, out) for p in payloads]).start()
    reader = RecordReader(b, rx, CS)
    buf = bytearray(CS)
    for p in payloads:
        n = reader.read_into(KIND_CHUNK, buf)
        assert bytes(buf[:n]) == p


def test_key_is_bound_to_both_peer_ids(pair: tuple[socket.socket, socket.socket]) -> None:
    a, b = pair
    # The server thinks it talks to "M" (a man in the middle relaying the secret): keys differ.
    send_record(a, RecordCipher.for_direction(key_for("M", "B"), client_to_server=True), KIND_HELLO, b"hi")
    reader = RecordReader(b, RecordCipher.for_direction(key_for("A", "B"), client_to_server=True), 100)
    with pytest.raises(VerificationError):
        reader.read(KIND_HELLO)


def test_direction_and_order_are_authenticated(pair: tuple[socket.socket, socket.socket]) -> None:
    a, b = pair
    k = key_for("A", "B")
    send_record(a, RecordCipher.for_direction(k, client_to_server=True), KIND_CHUNK, b"x" * 10)
    reader = RecordReader(b, RecordCipher.for_direction(k, client_to_server=False), 100)
    with pytest.raises(VerificationError):  # reflected back at its sender
        reader.read(KIND_CHUNK)


def test_flipped_bit_fails_authentication(pair: tuple[socket.socket, socket.socket]) -> None:
    a, b = pair
    k = key_for("A", "B")
    header, ct = RecordCipher.for_direction(k, client_to_server=False).seal(KIND_CHUNK, b"y" * 100)
    bad = bytearray(ct)
    bad[50] ^= 0x10
    a.sendall(header + bad)
    with pytest.raises(VerificationError):
        RecordReader(b, RecordCipher.for_direction(k, client_to_server=False), 100).read(KIND_CHUNK)


def test_oversized_header_is_refused_before_reading(pair: tuple[socket.socket, socket.socket]) -> None:
    a, b = pair
    a.sendall(HEADER.pack(KIND_CHUNK, 2**31))
    reader = RecordReader(b, RecordCipher.for_direction(key_for("A", "B"), client_to_server=False), CS)
    with pytest.raises(OversizedMessage):
        reader.read(KIND_CHUNK)


def test_wrong_kind_is_malformed(pair: tuple[socket.socket, socket.socket]) -> None:
    a, b = pair
    a.sendall(HEADER.pack(9, 100))
    reader = RecordReader(b, RecordCipher.for_direction(key_for("A", "B"), client_to_server=False), CS)
    with pytest.raises(MalformedMessage):
        reader.read(KIND_CHUNK)


def test_endless_garbage_costs_one_record(pair: tuple[socket.socket, socket.socket]) -> None:
    a, b = pair
    stop = threading.Event()

    def spew() -> None:
        junk = HEADER.pack(KIND_CHUNK, CS) + os.urandom(1 << 16)
        try:
            while not stop.is_set():
                a.sendall(junk)
        except OSError:
            pass

    t = threading.Thread(target=spew, daemon=True)
    t.start()
    try:
        reader = RecordReader(b, RecordCipher.for_direction(key_for("A", "B"), client_to_server=False), CS)
        with pytest.raises(VerificationError):
            reader.read(KIND_CHUNK)
        assert len(reader._buf) == CS + 16  # the only buffer, sized by the limit
    finally:
        stop.set()
        b.close()
        t.join(timeout=5)


def test_truncated_record_is_peer_gone(pair: tuple[socket.socket, socket.socket]) -> None:
    a, b = pair
    header, ct = RecordCipher.for_direction(key_for("A", "B"), client_to_server=False).seal(KIND_CHUNK, b"z" * 1000)
    a.sendall(header + ct[:300])
    a.shutdown(socket.SHUT_WR)
    with pytest.raises(PeerGone):
        RecordReader(b, RecordCipher.for_direction(key_for("A", "B"), client_to_server=False), 2000).read(KIND_CHUNK)


def test_stalled_record_is_peer_timeout(pair: tuple[socket.socket, socket.socket]) -> None:
    a, b = pair
    header, ct = RecordCipher.for_direction(key_for("A", "B"), client_to_server=False).seal(KIND_CHUNK, b"z" * 1000)
    a.sendall(header + ct[:300])  # and then nothing, connection kept open
    with pytest.raises(PeerTimeout):
        RecordReader(b, RecordCipher.for_direction(key_for("A", "B"), client_to_server=False), 2000).read(KIND_CHUNK)


@pytest.mark.parametrize("into", ["memory", "file"])
def test_receive_batch_rejects_a_bad_chunk_and_names_it(
    pair: tuple[socket.socket, socket.socket], tmp_path: Path, into: str
) -> None:
    a, b = pair
    data = os.urandom(3 * CS)
    m = hash_bytes(data, CS)
    k = key_for("A", "B")
    tx = RecordCipher.for_direction(k, client_to_server=False)
    chunks = [data[i * CS : (i + 1) * CS] for i in range(3)]
    chunks[1] = b"\0" * CS  # authentic record, wrong content: the provider lies
    def send_all() -> None:
        try:
            for c in chunks:
                send_record(a, tx, KIND_CHUNK, c)
        except PcpError:  # the receiver hangs up after the bad chunk: expected
            pass

    sender = threading.Thread(target=send_all, daemon=True)
    sender.start()
    ok: list[int] = []
    reader = RecordReader(b, RecordCipher.for_direction(k, client_to_server=False), CS)
    store = BlobStore(tmp_path / "store", 1 << 30)
    pending = store.begin(m.cid, m)
    fd = os.open(pending.path, os.O_RDWR)
    out = bytearray(len(data))
    sink: ChunkSink = MemorySink(m, range(3), memoryview(out)) if into == "memory" else FileSink(pending, fd)
    try:
        with pytest.raises(HashMismatch) as info:
            receive_batch(b, reader, [0, 1, 2], sink, ChunkPool(CS), on_ok=ok.append, stall=1.0)
        assert info.value.index == 1  # type: ignore[attr-defined]
        # chunk 0 is verified and kept; the bad chunk 1 never is (chunk 2 may be,
        # by the second verifier thread, before the failure stops the batch)
        assert 0 in ok and 1 not in ok
        if into == "memory":
            assert out[:CS] == chunks[0] and not sink.complete  # type: ignore[attr-defined]
        else:
            assert os.pread(fd, CS, 0) == chunks[0]
            assert os.pread(fd, CS, CS) == b"\0" * CS  # the lie was never written
            with pytest.raises(HashMismatch):
                pending.commit()
    finally:
        os.close(fd)
        pending.abort()
    sender.join(timeout=5)


def test_memory_sink_takes_a_copy_only_of_chunks_received_elsewhere() -> None:
    data = os.urandom(3 * CS)
    m = hash_bytes(data, CS)
    out = bytearray(2 * CS)
    sink = MemorySink(m, range(1, 3), memoryview(out))
    assert sink.slot(1).tobytes() == b"\0" * CS and len(sink.slot(2)) == CS
    sink.put(2, memoryview(data[2 * CS :]))  # e.g. from the stream path: copied
    assert out[CS:] == data[2 * CS :] and not sink.complete
    sink.slot(1)[:] = data[CS : 2 * CS]
    sink.put(1, sink.slot(1), in_place=True)
    assert bytes(out) == data[CS:] and sink.complete
    with pytest.raises(LocalError):
        MemorySink(m, range(3), memoryview(bytearray(3 * CS - 1)))


def test_file_sink_writes_aligned_chunks_directly_and_the_rest_through_the_cache(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import errno

    from pcp_p2p.blob import receiver

    data = os.urandom(3 * CS + 5000)  # last chunk: 4096 bytes direct, 904 through the cache
    m = hash_bytes(data, CS)
    store = BlobStore(tmp_path / "store", 1 << 30, chunk_size=CS)
    pool = ChunkPool(CS)

    def fill(sink: FileSink, index: int, aligned: bool = True) -> None:
        off, ln = m.chunk_span(index)
        if aligned:
            buf = pool.get(1.0)
            buf[:ln] = data[off : off + ln]
            accept_chunk(sink, index, memoryview(buf)[:ln])
            pool.put(buf)
        else:  # e.g. the stream path's bytearray
            accept_chunk(sink, index, memoryview(bytearray(data[off : off + ln])))

    refused: list[int] = []
    real_pwrite = os.pwrite
    pending = store.begin(m.cid, m)
    with FileSink.open(pending) as sink:
        direct = sink.direct_fd
        fill(sink, 0)
        fill(sink, 1, aligned=False)
        if direct is not None:  # a direct write refused mid-fetch: the cache from then on

            def pwrite(fd: int, buf: memoryview, offset: int) -> int:
                if fd == direct:
                    refused.append(offset)
                    raise OSError(errno.EINVAL, "refused")
                return real_pwrite(fd, buf, offset)

            monkeypatch.setattr(receiver.os, "pwrite", pwrite)
        fill(sink, 2)
        fill(sink, 3)
        assert sink.direct_fd is None
    assert refused == ([2 * CS] if direct is not None else [])
    assert pending.commit().read_bytes() == data
