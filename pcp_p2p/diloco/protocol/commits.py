"""The ``commit`` record kind: the latest committed round of a run, in the DHT.

Stored under ``/pcp/commit/<run id>`` by the shepherd that signed the commit;
a late joiner or a worker that missed a commit looks it up there. The record's
``seq`` is (term, round) (:func:`commit_seq`) and the highest wins, the same
fork choice as the election's: a higher term beats a longer chain of an older one.
"""

from __future__ import annotations

from pcp_p2p.core.errors import BadSignature, VerificationError
from pcp_p2p.dht.records import KindRule
from pcp_p2p.diloco.protocol.messages import CommitRecord, verify
from pcp_p2p.wire import Message


def _commit_rule(name: str, signer: str, payload: Message) -> None:
    assert isinstance(payload, CommitRecord)
    if payload.run_id != name:
        raise VerificationError("commit record stored under another run id")
    if payload.shepherd != signer:
        raise BadSignature("a commit record must be stored by the shepherd that signed it")
    verify(payload, signer)


COMMIT_KIND = "commit"
COMMIT_RULE = KindRule(CommitRecord, _commit_rule, order="seq")


def commit_seq(rec: CommitRecord) -> int:
    """The record ``seq`` of a commit: fork choice order (term, then round) in one number."""
    return (rec.term << 32) | rec.round
