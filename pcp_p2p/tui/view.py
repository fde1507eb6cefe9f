"""The ``pcp status`` screen: layout, keys, connection state, help, too-small terminal.

:class:`StatusView` is a plain urwid box widget that knows nothing about the
network: the app feeds it status dicts (:meth:`StatusView.apply_status`) and
failures (:meth:`StatusView.apply_error`), and it reads the time from injected
clocks. So the whole screen renders to text without a terminal
(``view.render((80, 24)).text``), which is how its tests see it.

Layout (80x24 and up; more space goes to every row in proportion)::

    header: node, role, version, uptime, connection state
    +- swarm (full width) ------------------------------------------+
    +- run -------+- shepherd --------+- network ------------------+
    +- training (chart) -------------+- artifacts -----------------+
    footer: keys (or, while disconnected, the last error)

A node that goes away keeps its last status on screen under a
"disconnected, retrying" banner; the screen never shows a traceback.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Mapping
from typing import Any, Literal

import urwid

from pcp_p2p.tui import fmt
from pcp_p2p.tui.fmt import Style
from pcp_p2p.tui.panels import PANELS, Ctx, Markup, Panel

MIN_COLS, MIN_ROWS = 80, 24
STALE_AFTER_S = 3.0

HELP = """\
pcp status: a live view of one PCP node, refreshed every second.

  q           quit (Ctrl+C too)
  tab         next panel   (shift-tab: previous)
  1-6         jump to a panel
  up / down   scroll the focused panel
  pgup/pgdn   scroll a page; home / end: top / bottom
  ?           this help (esc or ? closes it)

swarm      members: backend, device, GFLOP/s, state, last seen
shepherd   holder, term, lease, past terms: rotation or failover
run        round under way (from 1), phase, deadline, quorum
training   loss and validation loss per round, tokens/s, outer lr
artifacts  compiled targets, CIDs, cache hits
network    connections, bytes, rejected: bad input vs stale/dup
"""

# name, foreground, background, monochrome: the monochrome column is what a
# NO_COLOR or TERM=dumb terminal gets (urwid with colors=1).
PALETTE = [
    ("header", "white,bold", "dark blue", "standout"),
    ("footer", "light gray", "dark gray", ""),
    ("keyhint", "yellow,bold", "dark gray", "bold"),
    ("body", "", "", ""),
    ("border", "dark gray", "", ""),
    ("border_focus", "light cyan", "", "bold"),
    ("title", "light gray", "", ""),
    ("title_focus", "black", "light cyan", "standout"),
    ("hdr", "light gray,underline", "", "underline"),
    ("label", "dark cyan", "", ""),
    ("self", "white,bold", "", "bold"),
    ("ok", "light green", "", ""),
    ("warn", "yellow", "", "bold"),
    ("bad", "light red,bold", "", "standout"),
    ("dim", "dark gray", "", ""),
    ("loss", "light magenta", "", "bold"),
    ("val", "light cyan", "", ""),
    ("live", "light green,bold", "dark blue", "standout"),
    ("stale", "yellow,bold", "dark blue", "standout"),
    ("down", "white,bold", "dark red", "standout"),
]


class StatusView(urwid.Widget):
    """The whole screen; see the module docstring."""

    _sizing = frozenset([urwid.Sizing.BOX])
    _selectable = True

    def __init__(
        self,
        target: str,
        style: Style | None = None,
        *,
        clock: Callable[[], float] = time.monotonic,
        wall: Callable[[], float] = time.time,
        on_quit: Callable[[], None] | None = None,
    ) -> None:
        super().__init__()
        self.target = target
        self.style = style or Style.detect()
        self.clock = clock
        self.wall = wall
        self.on_quit = on_quit
        self.status: dict[str, Any] | None = None
        self.fetched_at: float | None = None
        self.error: str | None = None
        self.failures = 0
        self.retry_at: float | None = None
        self.show_help = False
        self.panels = [Panel(name, fn, self._source, _title_extra(name, self)) for name, fn in PANELS]
        self.focus_index = 0
        self.panels[0].focused = True
        by = {p.name: p for p in self.panels}
        self._header = urwid.Text("", wrap="clip")
        self._footer = urwid.Text("", wrap="clip")
        self._layout = urwid.Pile([
            ("pack", urwid.AttrMap(self._header, "header")),
            ("weight", 7, by["swarm"]),
            ("weight", 6, urwid.Columns([("weight", 26, by["run"]), ("weight", 27, by["shepherd"]),
                                         ("weight", 27, by["network"])])),
            ("weight", 9, urwid.Columns([by["training"], by["artifacts"]])),
            ("pack", urwid.AttrMap(self._footer, "footer")),
        ])

    # -- state fed by the app ------------------------------------------------------

    def apply_status(self, obj: Mapping[str, Any], at: float | None = None) -> None:
        """A fresh status dict from the node (``at``: when it arrived, on ``clock``)."""
        self.status = dict(obj)
        self.fetched_at = self.clock() if at is None else at
        self.error = None
        self.failures = 0
        self.retry_at = None
        self.refresh()

    def apply_error(self, message: str, retry_in_s: float = 1.0, at: float | None = None) -> None:
        """The last fetch failed; the app retries in ``retry_in_s``."""
        now = self.clock() if at is None else at
        self.error = message
        self.failures += 1
        self.retry_at = now + retry_in_s
        self.refresh()

    def refresh(self) -> None:
        """Forget cached canvases: the status or the time moved on."""
        for p in self.panels:
            p._invalidate()
        self._invalidate()

    @property
    def connected(self) -> bool:
        return self.status is not None and self.error is None

    @property
    def focused_panel(self) -> Panel:
        return self.panels[self.focus_index]

    def _source(self) -> tuple[Mapping[str, Any], Ctx]:
        age = 0.0 if self.fetched_at is None else max(0.0, self.clock() - self.fetched_at)
        return self.status or {}, Ctx(glyphs=self.style.glyphs, since_fetch_s=age, wall_now=self.wall())

    # -- keys ------------------------------------------------------------------------

    def focus_panel(self, index: int) -> None:
        self.focused_panel.focused = False
        self.focus_index = index % len(self.panels)
        self.focused_panel.focused = True
        self.refresh()

    def keypress(self, size: tuple[int, int], key: str) -> str | None:  # type: ignore[override]  # a box widget: urwid passes (maxcol, maxrow)
        if key in ("q", "Q", "ctrl c"):  # urwid's raw mode delivers Ctrl+C as a key
            if self.on_quit is not None:
                self.on_quit()
                return None
            raise urwid.ExitMainLoop()
        if self.show_help:
            if key in ("?", "esc", "enter", "h"):
                self.show_help = False
                self._invalidate()
            return None
        if key in ("?", "h"):
            self.show_help = True
            self._invalidate()
            return None
        if key == "tab":
            self.focus_panel(self.focus_index + 1)
            return None
        if key == "shift tab":
            self.focus_panel(self.focus_index - 1)
            return None
        if len(key) == 1 and key.isdigit() and 1 <= int(key) <= len(self.panels):
            self.focus_panel(int(key) - 1)
            return None
        result = self.focused_panel.keypress(size, key)
        if result is None:
            self._invalidate()
        return result

    # -- drawing -----------------------------------------------------------------------

    def render(self, size: tuple[int, int], focus: bool = False) -> urwid.Canvas:  # type: ignore[override]  # a box widget: urwid passes (maxcol, maxrow)
        maxcol, maxrow = size
        if maxcol < MIN_COLS or maxrow < MIN_ROWS:
            return _lines_widget([
                f"terminal too small: {maxcol}x{maxrow}",
                f"pcp status needs at least {MIN_COLS}x{MIN_ROWS}",
                "(make the window larger, or press q to quit)",
            ], align="center", pad=2 if maxrow >= 8 else 0).render(size, focus)
        self._header.set_text(self._header_markup(maxcol))
        self._footer.set_text(self._footer_markup())
        if self.status is None:
            body = _lines_widget(self._waiting_lines(), align="center")
            w: urwid.Widget = urwid.Pile([("pack", urwid.AttrMap(self._header, "header")), body,
                                          ("pack", urwid.AttrMap(self._footer, "footer"))])
        else:
            w = self._layout
        if self.show_help:
            help_lines = HELP.splitlines()
            text = urwid.Pile([urwid.Text(line, wrap="clip") for line in help_lines])
            box = urwid.LineBox(urwid.Filler(text, valign="top"), title="help", **self.style.glyphs.box)
            w = urwid.Overlay(urwid.AttrMap(box, "body"), w, "center", 72, "middle", min(maxrow, len(help_lines) + 2))
        return w.render(size, focus)

    def _conn_markup(self) -> Markup:
        now = self.clock()
        if self.error is not None:
            return ("down", f" disconnected, {self._retry_text()} ")
        if self.fetched_at is None:
            return ("stale", " connecting ")
        age = now - self.fetched_at
        if age > STALE_AFTER_S:
            return ("stale", f" stale {age:.0f}s ")
        return ("live", " live ")

    def _header_markup(self, width: int) -> Markup:
        obj = self.status or {}
        g = self.style.glyphs
        conn = self._conn_markup()
        if obj:
            left = (f" PCP  {fmt.short_id(obj.get('peer_id'), g)}  {fmt.text(obj.get('role'))}"
                    f"  pcp {fmt.text(obj.get('version'))}  up {fmt.duration(obj.get('uptime_s'))}"
                    f"  {len(fmt.items(obj, 'members'))} members")
        else:
            left = f" PCP  {self.target}"
        room = width - len(conn[1])
        return [fmt.clip(left, room, g).ljust(room), conn]

    def _footer_markup(self) -> Markup:
        if self.error is not None:
            return ("bad", f" {self.error}")
        hints: list[Markup] = []
        for key, what in (("q", "quit"), ("tab", "panel"), ("arrows", "scroll"), ("?", "help")):
            hints += [" ", ("keyhint", key), f" {what} "]
        hints.append(("footer", f"  {self.panels[self.focus_index].name}  {self.target}"))
        return hints

    def _waiting_lines(self) -> list[str]:
        if self.error is None:
            return [f"connecting to {self.target} ..."]
        return [f"disconnected, {self._retry_text()} (attempt {self.failures})", self.error]

    def _retry_text(self) -> str:
        now = self.clock()
        wait = max(0.0, (self.retry_at or now) - now)
        return f"retrying in {math.ceil(wait)}s" if wait >= 0.5 else "retrying"


def _title_extra(name: str, view: StatusView) -> Callable[[fmt.Glyphs], Markup] | None:
    if name == "swarm":
        return lambda g: f"({len(fmt.items(view.status, 'members'))})"
    if name == "training":
        return lambda g: [("loss", g.loss), " loss ", ("val", g.val), " val"]
    return None


def _lines_widget(lines: list[str], align: Literal["left", "center", "right"] = "left", pad: int = 2) -> urwid.Widget:
    """Lines that render at any size, wrapped, and cut at the bottom (a ListBox never
    complains about being too small)."""
    texts = [urwid.Text(line, align=align) for line in lines]
    return urwid.ListBox(urwid.SimpleListWalker([urwid.Text("") for _ in range(pad)] + texts))
