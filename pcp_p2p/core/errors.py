"""One exception hierarchy for all of PCP.

Every error PCP raises on purpose derives from :class:`PcpError`, so a node's
pumps can catch "anything PCP rejected" in one place, log it once and go on.

The tree separates *whose fault* an error is, the way h11 separates
``LocalProtocolError`` from ``RemoteProtocolError``. Every class sits under
exactly one of three branches (``tests/test_faults.py`` walks them all):

- :class:`RemoteError` — a peer (or a file a peer gave us) sent something we
  refuse: malformed, oversized, unsigned, replayed, tampered, or more than its
  budget (:class:`OverBudget`). The node keeps running; the peer's input is
  dropped, counted against it and answered with the error's
  :attr:`~PcpError.refusal_reason`.
- :class:`PeerError` — the world broke: a peer vanished or stalled, content is
  not where it was looked for, too few peers came. Nobody is blamed; retrying
  with another peer (or later) is usually right.
- :class:`LocalError` — this node's own fault: misconfigured or misused (bad
  flag, missing file, an artifact for a target this machine cannot run, a
  failed executor).

Why three and not "local or remote": the question a boundary asks is *whom to
blame*, and for a vanished peer the honest answer is nobody. A timeout is not
proof of malice (so it must not count against the peer, as a
:class:`RemoteError` would) and not a bug of ours (so it must not page an
operator with a traceback, as a :class:`LocalError` met while handling a peer
would). :class:`PeerError` is therefore its own branch beside the other two:
*remote* in where it happened, *neither's fault* in what it means.

The boundary rule (:mod:`pcp_p2p.core.faults`), applied wherever a peer's input is
handled: a :class:`RemoteError` is the peer's fault (refused with its reason,
counted in ``rejected``); a :class:`PeerError` is logged at info and the
exchange dropped; anything else — a bug, or a :class:`LocalError` raised while
handling a peer's message — is logged once with its traceback, counted in
``local_faults``, and answered with the neutral ``internal_error`` code,
without touching the peer's counts. Cancellation is never caught.

Causes are chained (``raise X(...) from exc``) so the original reason survives.
"""

from __future__ import annotations


class PcpError(Exception):
    """Root of every error PCP raises deliberately."""

    refusal_reason: str = "refused"
    """The code a direct-message handler's refusal carries back to the sender
    (:mod:`pcp_p2p.node.messaging`); subclasses that mean something to the
    sender name it (``not_trusted``, ``no_target``, ``unavailable``). A bug, or
    any :class:`LocalError`, met while handling a peer's message is answered
    ``internal_error`` instead (:func:`pcp_p2p.core.faults.refusal_reason`)."""


# --- the peer's fault -------------------------------------------------------


class RemoteError(PcpError):
    """Input from a peer was refused."""


class ProtocolError(RemoteError):
    """A message broke the wire protocol."""


class MalformedMessage(ProtocolError):
    """Bytes that do not decode to a valid message of the expected type."""


class OversizedMessage(ProtocolError):
    """A message, field or declared size above its configured limit."""


class UnknownVersion(ProtocolError):
    """A message with a protocol version this node does not speak."""


class UnknownMessageType(ProtocolError):
    """A message tag this node does not know, or not the one expected here."""


class VerificationError(RemoteError):
    """A signature, hash or record check failed."""


class BadSignature(VerificationError):
    """Missing signature, signature by the wrong key, or a forged one."""


class HashMismatch(VerificationError):
    """Content does not hash to the identifier it was fetched under."""

    index: int | None = None
    """The chunk that failed, when it was one chunk of a manifest (set by the blob receiver)."""


class ExpiredRecord(VerificationError):
    """A record whose validity window has passed (or lies in the future)."""


class StaleMessage(VerificationError):
    """A replayed or out-of-date message (sequence number, round or term too old)."""


class NotElected(VerificationError):
    """A lease or shepherd message from a peer that does not hold (or may not claim) the term."""


class HeldBack(NotElected):
    """A well-signed lease or commit whose authority this node cannot check yet.

    A term ahead of the chain the node holds, a commit for a term whose lease it
    has not accepted, a holder its membership view does not list yet: the
    message is kept (bounded) and looked at again when the node learns more,
    but nothing is acted on — not acked, fetched, pinned, stored or followed.
    """


class OverBudget(RemoteError):
    """A peer asked this node to hold more than its budget allows: more streams
    or buffered bytes than its own share, or than the node's total for all
    peers (identities are free, so a share alone would bound nothing).

    ``reason`` names the ledger that was full (``streams_per_peer``,
    ``streams_total``, ``bytes_per_peer``, ``bytes_total``, ``rate_per_peer``,
    ``rate_total``).
    """

    def __init__(self, message: str, reason: str = "") -> None:
        super().__init__(message)
        self.reason = reason


class Refused(RemoteError):
    """A peer read our message and declined it, and said why.

    ``reason`` is a short code (``not_trusted``, ``no_target``, ``refused``…)
    the receiver chose from its own closed set; the message is the peer's
    bounded, printable explanation. What a sender shows a person (``pcp run
    create``'s "2 refused: …") rather than a bare reset stream.
    """

    def __init__(self, message: str, reason: str = "refused", detail: str = "") -> None:
        super().__init__(message)
        self.reason = reason
        self.detail = detail or message


class RejectedUpdate(RemoteError):
    """A pseudo-gradient or round submission refused by the aggregator."""


# --- the world broke ----------------------------------------------------------


class PeerError(PcpError):
    """A peer could not be reached, vanished, or stalled: the world broke, nobody is to blame."""

    refusal_reason = "unavailable"


class PeerGone(PeerError):
    """The connection or stream closed before the exchange finished."""


class PeerTimeout(PeerError):
    """A network operation did not finish within its deadline."""


class NoProviders(PeerError):
    """Nobody that could serve a piece of content was found."""


class BlobNotFound(PeerError):
    """No blob with this CID is held (locally or by the asked peer).

    The world's state, not a fault: the asked peer does not have it (yet), or
    our store let it go; fetch it from elsewhere or later.
    """


class QuorumError(PeerError):
    """A round could not gather its quorum before the deadline (too few peers came, or in time)."""


# --- this node's own fault -------------------------------------------------


class LocalError(PcpError):
    """This node was misconfigured or misused."""


class ConfigError(LocalError):
    """A bad command-line flag, config file, key file or run spec."""


class IdentityError(ConfigError):
    """The node's identity key could not be read, created or trusted."""


class CompileError(LocalError):
    """Lowering or ``iree-compile`` failed."""


class CompileCancelled(CompileError):
    """A compile was stopped because nobody needs it any more (the election went to another node)."""


class CompilerRejected(CompileError):
    """``iree-compile`` ran and refused the program with these flags (not a timeout or a missing tool)."""


class IncompatibleArtifact(LocalError):
    """An artifact for a target (CPU level, driver) this machine cannot run."""


class ExecutorError(LocalError):
    """The IREE executor failed."""


class ExecutorCrashed(ExecutorError):
    """The executor's child process died (segfault, SIGILL, killed)."""


class GuestError(ExecutorError):
    """A WebAssembly guest failed, or misused its host's API."""


class NoSuchTensor(GuestError):
    """A wasi-nn guest named an input or output tensor the model does not have."""


class InvalidInput(LocalError):
    """Inputs of the wrong shape or dtype for a program."""


class ExportError(LocalError):
    """An exported model (``pcp export``'s directory) cannot be written or used."""


class CorruptModel(ExportError):
    """A model file that is not the bytes its manifest names: truncated, altered, or not ONNX."""


class ModelMismatch(ExportError):
    """Parts of a model that do not fit each other: its config, θ, tokenizer or ONNX shapes."""


class BlobError(LocalError):
    """This node's blob store failed."""


class StoreFull(BlobError):
    """The blob store cannot fit a blob without evicting pinned content."""
