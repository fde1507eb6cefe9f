"""Reading status dicts defensively and formatting their figures for narrow columns.

The status JSON grows as other parts of PCP add sections, and a node with no
run yet has none of them (or has them as ``null``). Everything here takes
"absent", "null" and "wrong type" as the same thing, so a panel shows "no run"
or "-" instead of failing on a half-filled node.
"""

from __future__ import annotations

import math
import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Literal, TypedDict

# IREE runtime driver -> the backend name users pass to --backend.
DRIVER_NAMES = {"local-task": "cpu", "local-sync": "cpu", "hip": "rocm", "cuda": "cuda", "vulkan": "vulkan",
                "metal": "metal"}
# A value above this is a unix timestamp rather than "seconds from now".
UNIX_TIME_THRESHOLD = 1e9


class BoxChars(TypedDict, total=False):
    """Border characters for ``urwid.LineBox`` (its keyword names); empty: urwid's own."""

    tlcorner: str
    tline: str
    lline: str
    trcorner: str
    blcorner: str
    rline: str
    bline: str
    brcorner: str


@dataclass(frozen=True)
class Glyphs:
    """Characters that have a plain-ASCII stand-in for terminals that cannot show Unicode."""

    ellipsis: str
    loss: str
    val: str
    both: str
    ok: str
    bad: str
    axis: str
    tick: str
    focus: str
    box: BoxChars
    link: str = "·"  # between two rounds' points on a stretched chart
    corner: str = "└"  # where the chart's x axis meets its y axis
    hline: str = "─"  # the x axis
    xtick: str = "┬"  # a round tick on the x axis


UNICODE = Glyphs("…", "●", "○", "◉", "✓", "✗", "│", "┤", "▶", {})
ASCII = Glyphs("~", "*", "o", "@", "+", "x", "|", "+", ">", {
    "tlcorner": "+", "tline": "-", "lline": "|", "trcorner": "+",
    "blcorner": "+", "rline": "|", "bline": "-", "brcorner": "+",
}, link=".", corner="+", hline="-", xtick="+")


@dataclass(frozen=True)
class Style:
    """How to draw on this terminal: colours or not, Unicode or ASCII."""

    colors: Literal[1, 256]  # 1 (monochrome: bold/reverse only) or 256
    glyphs: Glyphs

    @classmethod
    def detect(cls, env: Mapping[str, str] | None = None, encoding: str = "utf-8") -> Style:
        """``NO_COLOR`` (any non-empty value, no-color.org) or ``TERM=dumb`` turn colours off;
        ``TERM=dumb`` or a non-UTF-8 terminal also switch to ASCII."""
        env = os.environ if env is None else env
        term = env.get("TERM", "")
        dumb = term in ("dumb", "")
        mono = dumb or bool(env.get("NO_COLOR"))
        ascii_only = dumb or "utf" not in encoding.lower().replace("-", "")
        return cls(colors=1 if mono else 256, glyphs=ASCII if ascii_only else UNICODE)


def section(obj: Mapping[str, Any] | None, name: str) -> Mapping[str, Any]:
    """``obj[name]`` when it is a mapping, else an empty one (absent, null, garbage)."""
    if not isinstance(obj, Mapping):
        return {}
    value = obj.get(name)
    return value if isinstance(value, Mapping) else {}


def items(obj: Mapping[str, Any] | None, name: str) -> list[Mapping[str, Any]]:
    """The mappings in the list ``obj[name]``; anything else is dropped."""
    if not isinstance(obj, Mapping):
        return []
    value = obj.get(name)
    if not isinstance(value, Sequence) or isinstance(value, (str, bytes)):
        return []
    return [v for v in value if isinstance(v, Mapping)]


def num(value: Any) -> float | None:
    """A finite number, or None."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return None
    f = float(value)
    return f if math.isfinite(f) else None


def text(value: Any, default: str = "-") -> str:
    if value is None or value == "":
        return default
    return str(value)


def short_id(peer_id: Any, g: Glyphs = UNICODE, keep: int = 8) -> str:
    """The last ``keep`` characters of a peer id (every Ed25519 id starts ``12D3KooW``)."""
    s = text(peer_id)
    return s if len(s) <= keep + 1 else g.ellipsis + s[-keep:]


def short_cid(cid: Any, g: Glyphs = UNICODE, keep: int = 6) -> str:
    """``bafkrei…4s52zy``: the prefix says what kind of CID it is, the tail which one."""
    s = text(cid)
    return s if len(s) <= 8 + keep else s[:7] + g.ellipsis + s[-keep:]


def clip(s: str, width: int, g: Glyphs = UNICODE) -> str:
    if width <= 0:
        return ""
    return s if len(s) <= width else s[: max(0, width - len(g.ellipsis))] + g.ellipsis[:width]


def si(value: Any, digits: int = 1) -> str:
    """41250 -> ``41.2k``; None -> ``-``."""
    v = num(value)
    if v is None:
        return "-"
    for unit, scale in (("T", 1e12), ("G", 1e9), ("M", 1e6), ("k", 1e3)):
        if abs(v) >= scale:
            return f"{v / scale:.{digits}f}{unit}"
    return f"{v:.{digits}f}" if v != int(v) else f"{int(v)}"


def human_bytes(value: Any) -> str:
    v = num(value)
    if v is None:
        return "-"
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(v) < 1024 or unit == "TiB":
            return f"{v:.0f} {unit}" if unit == "B" else f"{v:.1f} {unit}"
        v /= 1024
    return "-"  # unreachable


def duration(value: Any) -> str:
    """Seconds as ``42s``, ``5m03s``, ``1h32m``, ``3d04h``."""
    v = num(value)
    if v is None:
        return "-"
    s = int(max(0.0, v))
    if s < 60:
        return f"{s}s"
    if s < 3600:
        return f"{s // 60}m{s % 60:02d}s"
    if s < 86400:
        return f"{s // 3600}h{s % 3600 // 60:02d}m"
    return f"{s // 86400}d{s % 86400 // 3600:02d}h"


def remaining(value: Any, *, since_fetch_s: float, wall_now: float) -> float | None:
    """Seconds left on a countdown the node reported ``since_fetch_s`` ago.

    Status fields like ``deadline_s`` and ``lease_expires_s`` are read as
    "seconds from now" when the reply was built (like ``uptime_s``); a value
    that looks like a unix time (> 1e9) is read as an absolute time instead,
    so the TUI is right whichever convention a part of PCP chooses.
    """
    v = num(value)
    if v is None:
        return None
    if v > UNIX_TIME_THRESHOLD:
        return v - wall_now
    return v - since_fetch_s


def countdown(left: float | None) -> str:
    if left is None:
        return "-"
    if left >= 0:
        return duration(left)
    return f"{duration(-left)} over"


def backend_and_device(caps: Mapping[str, Any]) -> tuple[str, str]:
    """(``cuda``, ``NVIDIA H100 80GB HBM3``): the best backend and its device, from capabilities."""
    backends = [b for b in caps.get("backends") or [] if isinstance(b, str)] if isinstance(caps, Mapping) else []
    best = backends[0] if backends else ""
    devices = items(caps, "devices")
    device = next((d for d in devices if d.get("driver") == best), devices[0] if devices else None)
    name = text(device.get("name"), "") if device else ""
    if not name or name == "cpu":
        name = text(caps.get("cpu_model"), "") if isinstance(caps, Mapping) else ""
    return DRIVER_NAMES.get(best, best or "-"), name or "-"


# Phases of a run that is inside its rounds (the worker's and the shepherd's round
# machines); others (starting, electing, compiling, waiting for quorum, set-up
# failed: ...) come before a round or between terms.
ROUND_PHASES = frozenset({"idle", "fetching", "training", "submitted", "waiting", "collecting"})
ENDED_PHASES = frozenset({"finished", "stopped"})
LOST_SUFFIX = " (shepherd lost)"
# What an in-round phase is called on screen: a worker between two rounds is
# waiting for the next announcement, not idle.
PHASE_NAMES = {"idle": "waiting"}


def phase_base(r: Mapping[str, Any]) -> str:
    """The run's phase without the "(shepherd lost)" note."""
    phase = text(r.get("phase"), "")
    return phase[: -len(LOST_SUFFIX)] if phase.endswith(LOST_SUFFIX) else phase


def phase_label(r: Mapping[str, Any]) -> str:
    """The phase as shown: the node's own words (compiling, waiting for quorum (1/3),
    set-up failed: ...), ``waiting`` for a worker between rounds, ``starting``
    when a node reports none."""
    phase = text(r.get("phase"), "")
    if not phase:
        return "starting"
    base = phase_base(r)
    return PHASE_NAMES.get(base, base) + phase[len(base):]


def phase_attr(label: str) -> str:
    """Colour of a phase: a lost shepherd, a missing quorum or a failed set-up warn."""
    if "lost" in label or label.startswith(("waiting for quorum", "set-up failed", "stopped")):
        return "warn"
    return "ok"


def round_label(r: Mapping[str, Any]) -> str:
    """``4/12``: the round under way (or next), counted from 1, out of the run's rounds.

    Status reports ``round`` as the last committed round (0 before the first);
    the round a node is working on is the one after it. Before the first round
    starts (compiling, waiting for quorum) there is none: ``-/12``, never a
    misleading ``0/12``. A finished or stopped run shows the last committed.
    """
    committed, total = num(r.get("round")), num(r.get("rounds"))
    of = "" if total is None else f"/{int(total)}"
    if committed is None:
        return "-" + of
    done = max(0, int(committed))
    base = phase_base(r)
    if base in ENDED_PHASES:
        return f"{done}{of}"
    if base in ROUND_PHASES or done > 0:
        current = done + 1 if total is None else min(done + 1, int(total))
        return f"{current}{of}"
    return "-" + of
