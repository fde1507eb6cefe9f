"""Logging, configured once per process.

py-libp2p's loggers have no handler of their own, so their warnings go straight
to stderr, and some fire on every normal event (the DHT logs "Failed to read
DHT message from stream" at the end of every request). :func:`configure`
installs one handler and turns the noisy libp2p loggers down, so what a node
prints is what an operator should read.

:class:`LogOnce` implements "bad input is logged once": the first rejection
of a given kind from a given peer is a warning, repeats are debug-level, so a
peer that floods garbage cannot flood the log.
"""

from __future__ import annotations

import json
import logging
import logging.handlers
import sys
import time
from collections import Counter, OrderedDict
from pathlib import Path

_configured = False

# Loggers that are noisy at INFO/WARNING during normal operation.
NOISY_LOGGERS = ("libp2p", "multiaddr", "async_service", "libp2p.kad_dht", "libp2p.pubsub", "jax._src.xla_bridge")


class JsonFormatter(logging.Formatter):
    """One JSON object per line, for log shippers."""

    def format(self, record: logging.LogRecord) -> str:
        obj = {
            "ts": round(record.created, 3),
            "level": record.levelname.lower(),
            "logger": record.name,
            "msg": record.getMessage(),
        }
        if record.exc_info:
            obj["exc"] = self.formatException(record.exc_info)
        return json.dumps(obj, ensure_ascii=False)


def configure(
    level: int | str = logging.INFO, *, json_lines: bool = False, libp2p_level: int = logging.CRITICAL
) -> None:
    """Install the process's one log handler (idempotent)."""
    global _configured
    # py-libp2p resets its own loggers when first imported (libp2p.utils.logging):
    # import it now so that our levels are set after, not before, that reset.
    import libp2p  # noqa: F401

    root = logging.getLogger()
    if _configured:
        root.setLevel(level)
        return
    handler = logging.StreamHandler(sys.stderr)
    if json_lines:
        handler.setFormatter(JsonFormatter())
    else:
        handler.setFormatter(logging.Formatter("%(asctime)s %(levelname).1s %(name)s: %(message)s", "%H:%M:%S"))
    root.handlers[:] = [handler]
    root.setLevel(level)
    for name in NOISY_LOGGERS:
        logging.getLogger(name).setLevel(libp2p_level)
    _configured = True


# A node's log file (DATA_DIR/logs/pcp.log unless --log-file): rotated at
# LOG_FILE_MAX_BYTES into LOG_FILE_BACKUPS older files (pcp.log.1 ... .N),
# so it never takes more than (1 + N) x that size.
LOG_FILE_NAME = Path("logs") / "pcp.log"
LOG_FILE_MAX_BYTES = 10 * 1024 * 1024
LOG_FILE_BACKUPS = 5
MIN_LOG_FILE_BYTES = 1024


def log_to_file(
    path: Path,
    *,
    max_bytes: int = LOG_FILE_MAX_BYTES,
    backups: int = LOG_FILE_BACKUPS,
    json_lines: bool = False,
) -> logging.Handler:
    """Also write the process's log to ``path``, rotated by size (replaces an earlier file handler).

    The file gets the same records as stderr, with full dates (a file outlives
    the day it was started). Raises ConfigError for sizes that would not bound
    it; OSError if the file cannot be opened (the CLI names the path).
    """
    from pcp_p2p.core.errors import ConfigError

    if max_bytes < MIN_LOG_FILE_BYTES:
        raise ConfigError(f"log file size limit too small: {max_bytes} bytes (at least {MIN_LOG_FILE_BYTES})")
    if backups < 1:
        raise ConfigError(f"log file backups must be at least 1, not {backups}")
    path.parent.mkdir(parents=True, exist_ok=True)
    handler = logging.handlers.RotatingFileHandler(path, maxBytes=max_bytes, backupCount=backups, encoding="utf-8")
    handler.setFormatter(JsonFormatter() if json_lines else
                         logging.Formatter("%(asctime)s %(levelname).1s %(name)s: %(message)s"))
    root = logging.getLogger()
    for old in [h for h in root.handlers if isinstance(h, logging.handlers.RotatingFileHandler)]:
        root.removeHandler(old)
        old.close()
    root.addHandler(handler)
    return handler


class LogOnce:
    """Warn the first time a (peer, kind) pair happens; debug-log repeats."""

    def __init__(self, logger: logging.Logger, capacity: int = 4096) -> None:
        self._logger = logger
        self._seen: OrderedDict[tuple[str, str], float] = OrderedDict()
        self._capacity = capacity
        self.warned: Counter[str] = Counter()  # warnings actually emitted, by "what:kind"

    def __call__(self, peer: str, exc: BaseException | str, what: str = "rejected input", *,
                 level: int = logging.WARNING) -> bool:
        """Log ``exc`` about ``peer`` (the first time at ``level``); return True if this was the first time."""
        kind = type(exc).__name__ if isinstance(exc, BaseException) else str(exc)
        key = (peer, f"{what}:{kind}")
        first = key not in self._seen
        self._seen[key] = time.monotonic()
        self._seen.move_to_end(key)
        while len(self._seen) > self._capacity:
            self._seen.popitem(last=False)
        if first and level >= logging.WARNING:
            self.warned[key[1]] += 1
        self._logger.log(level if first else logging.DEBUG, "%s from %s: %s: %s", what, peer, kind, exc)
        return first
