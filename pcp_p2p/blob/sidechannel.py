"""The bulk data path: a TCP side socket carrying AES-256-GCM records.

Why not the libp2p stream itself: on this stack a single Noise + Yamux stream
moved 256 MB at 0.17x of raw TCP on loopback (the time goes to 64 KB Noise
frames and yamux's per-frame Python work, not to the cipher), and bitswap at
0.01x. So the libp2p stream only *negotiates* a transfer (who, what, a fresh
secret, a port) and the bytes go over a plain TCP connection in large
authenticated-encryption records, moved by blocking socket calls in worker
threads (``recv_into`` a preallocated buffer; AES-GCM and sha256 release the GIL).
The measured figures are in ``docs/blob.md``.

Security: the 32-byte secret travels only inside the Noise-encrypted,
peer-authenticated libp2p stream. The record key is
``HKDF-SHA256(secret, salt = client nonce || server nonce, info = transcript)``
where the transcript names both peer ids (as each side's Noise session
authenticated them), the CID, the manifest CID and the chunk range, so a key
is good for exactly one transfer between exactly these two peers. The client
proves it holds the key with a first ``hello`` record before the server sends
anything. Record nonces are a direction tag plus a counter (never reused under
one key); the 8-byte record header is the AAD, so a record cannot be
truncated, reordered, replayed or re-labelled without failing authentication.

Record: ``kind (1) | reserved (3) | length (4, big-endian)`` then ``length``
bytes of ciphertext (plaintext + 16-byte tag). ``length`` is checked against
the largest record the transfer allows *before* any buffer is sized, so a peer
streaming garbage costs one failed header or one failed tag, never memory.

Time: a socket timeout alone is a stall detector that a peer resets with every
byte. Reads therefore also take an overall deadline (the hello's handshake
deadline, a chunk's paced deadline from :class:`pcp_p2p.net.budget.Pace`),
and a record is sent within the socket's timeout as a whole, so neither end
can be held by a peer that trickles.
"""

from __future__ import annotations

import socket
import struct
import time
from collections.abc import Callable
from dataclasses import dataclass

from cryptography.exceptions import InvalidTag
from cryptography.hazmat.primitives import hashes
from cryptography.hazmat.primitives.ciphers.aead import AESGCM
from cryptography.hazmat.primitives.kdf.hkdf import HKDF

from pcp_p2p.core.errors import (
    MalformedMessage,
    OversizedMessage,
    PeerGone,
    PeerTimeout,
    VerificationError,
)
from pcp_p2p.net.traffic import Traffic

HEADER = struct.Struct(">B3xI")
TAG_LEN = 16
KIND_HELLO = 1
KIND_CHUNK = 2
_HELLO_TEXT = b"pcp/blob/side/1 hello"
_C2S = b"c2s\x00"
_S2C = b"s2c\x00"


def transcript(
    client_peer: str, server_peer: str, cid: str, manifest_cid: str, first: int, count: int
) -> bytes:
    """The bytes that bind a record key to one transfer between two peers."""
    parts = [b"pcp/blob/side/1", client_peer.encode(), server_peer.encode(),
             cid.encode(), manifest_cid.encode(), b"%d" % first, b"%d" % count]
    return b"".join(struct.pack(">H", len(p)) + p for p in parts)


def derive_key(secret: bytes, client_nonce: bytes, server_nonce: bytes, info: bytes) -> bytes:
    if len(secret) != 32:
        raise MalformedMessage("side-channel secret must be 32 bytes")
    return HKDF(
        algorithm=hashes.SHA256(), length=32, salt=client_nonce + server_nonce, info=info
    ).derive(secret)


@dataclass
class RecordCipher:
    """Seal and open records for one direction of one transfer (a counter nonce)."""

    aead: AESGCM
    direction: bytes
    counter: int = 0

    @classmethod
    def for_direction(cls, key: bytes, *, client_to_server: bool) -> RecordCipher:
        return cls(AESGCM(key), _C2S if client_to_server else _S2C)

    def _nonce(self) -> bytes:
        n = self.direction + struct.pack(">Q", self.counter)
        self.counter += 1
        return n

    def seal(self, kind: int, plaintext: bytes) -> tuple[bytes, bytes]:
        """``(header, ciphertext)``; send them back to back (``sendmsg``, no copy)."""
        header = HEADER.pack(kind, len(plaintext) + TAG_LEN)
        return header, self.aead.encrypt(self._nonce(), plaintext, header)

    def open(self, header: bytes, ciphertext: bytes | bytearray | memoryview) -> bytes:
        try:
            return self.aead.decrypt(self._nonce(), ciphertext, header)
        except InvalidTag as exc:
            raise VerificationError("side-channel record failed authentication") from exc

    def seal_into(self, kind: int, plaintext: memoryview, out: bytearray) -> tuple[bytes, memoryview]:
        """Like :meth:`seal` but into a reused buffer (no 4 MiB allocation per record)."""
        n = len(plaintext) + TAG_LEN
        header = HEADER.pack(kind, n)
        view = memoryview(out)[:n]
        self.aead.encrypt_into(self._nonce(), plaintext, header, view)
        return header, view

    def open_into(self, header: bytes, ciphertext: memoryview, out: memoryview) -> None:
        try:
            self.aead.decrypt_into(self._nonce(), ciphertext, header, out)
        except InvalidTag as exc:
            raise VerificationError("side-channel record failed authentication") from exc


def parse_header(header: bytes, *, max_len: int, expect_kind: int) -> int:
    """The ciphertext length a header announces, checked before any allocation."""
    kind: int
    length: int
    kind, length = HEADER.unpack(header)
    if kind != expect_kind:
        raise MalformedMessage(f"side-channel record of kind {kind}, expected {expect_kind}")
    if length > max_len:
        raise OversizedMessage(f"side-channel record of {length} bytes > limit {max_len}")
    if length < TAG_LEN:
        raise MalformedMessage("side-channel record shorter than its tag")
    return length


# --- blocking socket pumps (run in worker threads) ------------------------------


def recv_exact_into(
    sock: socket.socket, buf: memoryview, *, deadline: float | None = None,
    clock: Callable[[], float] = time.monotonic,
) -> None:
    """Fill ``buf`` from ``sock``; :class:`PeerGone` on EOF, :class:`PeerTimeout` on stall.

    The socket's timeout is the stall limit: no byte for that long is a stall.
    ``deadline`` (on ``clock``) bounds the whole read as well: a peer that
    trickles a byte now and then resets a stall timer forever, never a deadline.
    """
    got = 0
    n = len(buf)
    stall = sock.gettimeout()
    try:
        while got < n:
            if deadline is not None:
                left = deadline - clock()
                if left <= 0:
                    raise PeerTimeout(f"side channel: {got} of {n} bytes by the deadline")
                sock.settimeout(left if stall is None else min(stall, left))
            k = sock.recv_into(buf[got:], n - got)
            if k == 0:
                raise PeerGone(f"side channel closed after {got} of {n} bytes")
            got += k
    except TimeoutError as exc:
        why = "missed its deadline" if deadline is not None and clock() >= deadline else "stalled"
        raise PeerTimeout(f"side channel {why} after {got} of {n} bytes") from exc
    except OSError as exc:
        raise PeerGone(f"side channel broke: {exc}") from exc
    finally:
        if deadline is not None:
            _restore_timeout(sock, stall)


def _restore_timeout(sock: socket.socket, timeout: float | None) -> None:
    try:
        sock.settimeout(timeout)
    except OSError:  # closed meanwhile (a verifier shut it down)
        pass


def send_record(
    sock: socket.socket,
    cipher: RecordCipher,
    kind: int,
    plaintext: bytes | memoryview,
    out: bytearray | None = None,
) -> None:
    """Seal and send one record (into ``out`` when given: no per-record allocation).

    The socket's timeout bounds the whole record, not each call: a peer that
    reads a little now and then cannot stretch one record indefinitely.
    """
    ct: bytes | memoryview
    if out is None:
        header, ct = cipher.seal(kind, bytes(plaintext))
    else:
        header, ct = cipher.seal_into(kind, memoryview(plaintext), out)
    limit = sock.gettimeout()
    deadline = None if limit is None else time.monotonic() + limit
    try:
        sent = sock.sendmsg([header, ct])
        rest: list[memoryview] = []
        if sent < len(header):  # partial sends happen (a socket with a timeout
            rest.append(memoryview(header)[sent:])  # sends what fits): finish without copying
            sent = len(header)
        if sent - len(header) < len(ct):
            rest.append(memoryview(ct)[sent - len(header) :])
        for part in rest:
            if deadline is not None:  # sendall's timeout is its total: what is left of ours
                left = deadline - time.monotonic()
                if left <= 0:
                    raise TimeoutError
                sock.settimeout(left)
            sock.sendall(part)
    except TimeoutError as exc:
        raise PeerTimeout("side channel: peer stopped reading") from exc
    except OSError as exc:
        raise PeerGone(f"side channel broke: {exc}") from exc
    finally:
        if deadline is not None:
            _restore_timeout(sock, limit)


class RecordReader:
    """Reads records from a socket into one reused buffer (bounded memory)."""

    def __init__(self, sock: socket.socket, cipher: RecordCipher, max_plaintext: int,
                 traffic: Traffic | None = None) -> None:
        self.sock = sock
        self.cipher = cipher
        self.traffic = traffic
        self.max_len = max_plaintext + TAG_LEN
        self._hdr = bytearray(HEADER.size)
        self._buf = bytearray(self.max_len)

    def read(self, kind: int, deadline: float | None = None) -> bytes:
        """One record's plaintext; all of it by ``deadline`` (``time.monotonic``) when given."""
        recv_exact_into(self.sock, memoryview(self._hdr), deadline=deadline)
        header = bytes(self._hdr)
        length = parse_header(header, max_len=self.max_len, expect_kind=kind)
        view = memoryview(self._buf)[:length]
        recv_exact_into(self.sock, view, deadline=deadline)
        return self.cipher.open(header, view)

    def read_into(self, kind: int, out: bytearray | memoryview, deadline: float | None = None) -> int:
        """Read one record and decrypt it into ``out``; returns the plaintext length."""
        recv_exact_into(self.sock, memoryview(self._hdr), deadline=deadline)
        header = bytes(self._hdr)
        length = parse_header(header, max_len=self.max_len, expect_kind=kind)
        if length - TAG_LEN > len(out):
            raise OversizedMessage("record larger than the receive buffer")
        view = memoryview(self._buf)[:length]
        recv_exact_into(self.sock, view, deadline=deadline)
        if self.traffic is not None:
            self.traffic.received(HEADER.size + length)
        n = length - TAG_LEN
        self.cipher.open_into(header, view, memoryview(out)[:n])
        return n


def hello_plaintext(info: bytes) -> bytes:
    return _HELLO_TEXT + info


def tune(sock: socket.socket, timeout: float) -> None:
    """Large kernel buffers and a stall timeout for a side socket."""
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    for opt in (socket.SO_SNDBUF, socket.SO_RCVBUF):
        try:
            sock.setsockopt(socket.SOL_SOCKET, opt, 4 * 1024 * 1024)
        except OSError:
            pass
    sock.settimeout(timeout)
