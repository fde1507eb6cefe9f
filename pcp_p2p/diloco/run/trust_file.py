"""The trust file: the run owners a node trains for, re-read while it runs.

``pcp node join --trust-file FILE`` names a text file with one owner peer id
per line; ``#`` starts a comment (a whole line or the end of one) and blank
lines are skipped. The ``--trust`` flags add to it. An operator edits the file
and the node picks the change up without a restart: new owners apply to runs
announced afterwards, to runs the node already refused for want of trust
(:meth:`~pcp_p2p.diloco.protocol.runs.RunBook.retrust`), and to the runs the owner
published before (the node looks up the owner's ``owner-runs`` record).

How a change is seen: the node looks at the file's ``(mtime_ns, size, inode)``
every :data:`POLL_S` seconds and re-reads it when that changes. Polling rather
than SIGHUP because :mod:`pcp_p2p.core.shutdown` owns the node's signal handling,
because it works alike under a service manager, in a container with a mounted
file and in tests, and because a ``stat`` every two seconds costs nothing. The
inode is in the stamp so an editor's save-by-rename is seen even within the
same mtime tick.

A malformed line (not a peer id embedding an Ed25519 key) is logged once per
version of the file, with its line number, and skipped: the rest of the file
applies. A file that cannot be read at start is a :class:`ConfigError`; one
that disappears or cannot be read later keeps the last list (an editor may
briefly remove it while saving) and says so once.

Parsing is sans-IO (:func:`parse_trust_file`); :class:`TrustFile` only stats
and reads.
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass
from pathlib import Path

from pcp_p2p.core.errors import ConfigError, PcpError
from pcp_p2p.core.identity import public_key_of

log = logging.getLogger("pcp.trust")

POLL_S = 2.0
MAX_FILE_BYTES = 1024 * 1024
MAX_OWNERS = 10_000


@dataclass(frozen=True)
class LineProblem:
    """A line of the trust file that was skipped, and why."""

    line: int  # 1-based
    why: str

    def __str__(self) -> str:
        return f"line {self.line}: {self.why}"


def check_owner(peer_id: str) -> str:
    """``peer_id`` if it is a peer id with an Ed25519 key (what signs run specs); ConfigError otherwise."""
    try:
        public_key_of(peer_id)
    except PcpError as exc:
        raise ConfigError(f"{peer_id!r:.80} is not a peer id (12D3KooW…): {exc}") from exc
    return peer_id


def parse_trust_file(text: str) -> tuple[frozenset[str], list[LineProblem]]:
    """The owners a trust file lists, and the lines it skipped (bad peer id, too many)."""
    owners: set[str] = set()
    problems: list[LineProblem] = []
    for n, raw in enumerate(text.splitlines(), start=1):
        entry = raw.split("#", 1)[0].strip()
        if not entry:
            continue
        if len(entry.split()) != 1:
            problems.append(LineProblem(n, "more than one word (one peer id per line)"))
            continue
        try:
            check_owner(entry)
        except ConfigError:
            problems.append(LineProblem(n, f"{entry!r:.60} is not a peer id"))
            continue
        if len(owners) >= MAX_OWNERS:
            problems.append(LineProblem(n, f"more than {MAX_OWNERS} owners; the rest are skipped"))
            break
        owners.add(entry)
    return frozenset(owners), problems


class TrustFile:
    """One trust file on disk: :meth:`load` at start, :meth:`poll` while the node runs."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self._stamp: tuple[int, int, int] | None = None
        self._unreadable_said = False

    def _stat(self) -> tuple[int, int, int]:
        st = os.stat(self.path)
        return (st.st_mtime_ns, st.st_size, st.st_ino)

    def _read(self) -> frozenset[str]:
        stamp = self._stat()
        if stamp[1] > MAX_FILE_BYTES:
            raise OSError(f"larger than {MAX_FILE_BYTES // 1024} KiB")
        with open(self.path, encoding="utf-8", errors="replace") as f:
            text = f.read(MAX_FILE_BYTES + 1)
        self._stamp = stamp
        owners, problems = parse_trust_file(text)
        for p in problems:  # once per version of the file: an unchanged file is not parsed again
            log.warning("trust file %s: %s (skipped)", self.path, p)
        log.info("trust file %s: %d owner(s)", self.path, len(owners))
        return owners

    def load(self) -> frozenset[str]:
        """The owners listed now; :class:`ConfigError` if the file cannot be read."""
        try:
            return self._read()
        except OSError as exc:
            raise ConfigError(f"cannot read --trust-file {self.path}: {exc.strerror or exc}") from exc

    def poll(self) -> frozenset[str] | None:
        """The owners listed, if the file changed since it was last read; else None."""
        try:
            if self._stat() == self._stamp:
                return None
            owners = self._read()
        except OSError as exc:
            if not self._unreadable_said:
                log.warning("trust file %s cannot be read (%s): keeping the owners it listed before",
                            self.path, exc.strerror or exc)
                self._unreadable_said = True
            return None
        self._unreadable_said = False
        return owners
