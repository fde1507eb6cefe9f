"""The six panels of ``pcp status``: what each shows, and the box that scrolls it.

Each panel is a pure function ``(status dict, Ctx, width, height) -> Content``:
a few fixed lines (a table header, a summary) and a list of scrollable rows,
as urwid text markup. Keeping them pure means every panel is tested from a
recorded status snapshot without a terminal, and a section a node does not
report (no run yet, no lease, no artifacts) turns into a "no run" line rather
than an exception.

:class:`Panel` is the urwid box around one of them: a titled border, the
fixed lines, and as many rows as fit, scrolled with the arrow keys when it has
the focus.
"""

from __future__ import annotations

from collections.abc import Callable, Hashable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, TypeAlias

import urwid

from pcp_p2p.node.status import split_rejected
from pcp_p2p.tui import fmt
from pcp_p2p.tui.chart import line_chart
from pcp_p2p.tui.fmt import UNICODE, Glyphs

Markup = Any  # urwid text markup: str, (attr, str), or a list of those
STATE_ORDER = {"shepherd": 0, "training": 1, "compiling": 2, "idle": 3}


@dataclass(frozen=True)
class Ctx:
    """What a panel needs besides the status dict."""

    glyphs: Glyphs = UNICODE
    since_fetch_s: float = 0.0  # how old the status dict is
    wall_now: float = 0.0  # unix time, for countdowns reported as absolute times


class LazyRows(Sequence[Markup]):
    """Rows formatted only when shown: a 1000-member swarm table formats the four
    rows that fit, not all of them, on every frame."""

    def __init__(self, items: Sequence[Any], format_row: Callable[[Any], Markup]) -> None:
        self.items = items
        self.format_row = format_row

    def __len__(self) -> int:
        return len(self.items)

    def __getitem__(self, index: Any) -> Any:
        if isinstance(index, slice):
            return [self.format_row(x) for x in self.items[index]]
        return self.format_row(self.items[index])


@dataclass
class Content:
    fixed: list[Markup] = field(default_factory=list)
    rows: Sequence[Markup] = field(default_factory=list)


@dataclass(frozen=True)
class Col:
    title: str
    width: int | None  # None: takes what the others leave
    align: str = "left"


def table_line(cols: Sequence[Col], cells: Sequence[tuple[str | None, str]], width: int, g: Glyphs) -> list[Markup]:
    """One table row as markup, each cell clipped or padded to its column's width."""
    fixed = sum(c.width or 0 for c in cols) + len(cols) - 1
    flex = max(1, width - fixed)
    out: list[Markup] = []
    for i, (col, (attr, value)) in enumerate(zip(cols, cells)):
        w = col.width if col.width is not None else flex
        s = fmt.clip(value, w, g)
        s = s.rjust(w) if col.align == "right" else s.ljust(w)
        out.append((attr, s) if attr else s)
        if i < len(cols) - 1:
            out.append(" ")
    return out


def header_line(cols: Sequence[Col], width: int, g: Glyphs) -> list[Markup]:
    return table_line(cols, [("hdr", c.title) for c in cols], width, g)


def note(message: str) -> Markup:
    return ("dim", message)


# -- swarm ---------------------------------------------------------------------------

SWARM_COLS = (
    Col("  peer", 11), Col("backend", 7), Col("device", None), Col("GFLOP/s", 8, "right"),
    Col("state", 9), Col("reach", 5), Col("seen", 6, "right"),
)
# A member's own reachability verdict (pcp_p2p.net.reachability), in five letters.
REACH_SHORT = {"public": "pub", "hole-punchable": "punch", "relay-only": "relay"}


def swarm(obj: Mapping[str, Any], ctx: Ctx, width: int, height: int) -> Content:
    """Members: peer id, backend and device, measured throughput, state, reachability, last seen."""
    g = ctx.glyphs
    me = obj.get("peer_id")
    shepherd = fmt.section(obj, "run").get("shepherd")
    members = fmt.items(obj, "members")
    if not members:
        return Content([header_line(SWARM_COLS, width, g)], [note("no members known yet")])

    def state_of(m: Mapping[str, Any]) -> str:
        # The run's shepherd trains too, so its own member record says "training";
        # the run section knows better who leads, and that is what a reader looks for.
        if shepherd and m.get("peer_id") == shepherd:
            return "shepherd"
        return str(m["state"]) if m.get("state") else fmt.text(m.get("role"))

    def key(m: Mapping[str, Any]) -> tuple[int, float]:
        gflops = fmt.num(fmt.section(m, "capabilities").get("throughput_gflops"))
        return STATE_ORDER.get(state_of(m), 9), -(gflops or 0.0)

    def row(m: Mapping[str, Any]) -> Markup:
        caps = fmt.section(m, "capabilities")
        backend, device = fmt.backend_and_device(caps)
        seen = fmt.num(m.get("last_seen_s"))
        is_me = m.get("peer_id") == me
        state = state_of(m)
        return table_line(SWARM_COLS, [
            ("self" if is_me else None, ("* " if is_me else "  ") + fmt.short_id(m.get("peer_id"), g)),
            (None, backend),
            (None, device),
            (None, fmt.si(caps.get("throughput_gflops"))),
            ("ok" if state in ("training", "shepherd") else None, state),
            ("warn" if m.get("reachability") == "relay-only" else None,
             REACH_SHORT.get(str(m.get("reachability")), "-")),
            # SWIM probes each member every N periods or so: a long silence is normal, a suspicion is not.
            ("warn" if m.get("suspect") else None,
             "suspect" if m.get("suspect") else "-" if seen is None else f"{seen:.1f}s"),
        ], width, g)

    rows = LazyRows(sorted(members, key=key), row)
    return Content([header_line(SWARM_COLS, width, g)], rows)


# -- shepherd ------------------------------------------------------------------------

def shepherd(obj: Mapping[str, Any], ctx: Ctx, width: int, height: int) -> Content:
    """Holder, term, lease countdown, and past terms (newest first)."""
    g = ctx.glyphs
    run = fmt.section(obj, "run")
    holder = run.get("shepherd")
    history = fmt.items(obj, "shepherd_history")
    term = obj.get("term")
    if holder is None and history:
        current = [h for h in history if h.get("ended") is None]
        holder = current[-1].get("holder") if current else None
    if holder is None and term is None and not history:
        return Content([note("no shepherd (no run)")], [])
    me = " (me)" if holder is not None and holder == obj.get("peer_id") else ""
    left = fmt.remaining(obj.get("lease_expires_s"), since_fetch_s=ctx.since_fetch_s, wall_now=ctx.wall_now)
    lease_attr = "bad" if left is not None and left < 0 else ("warn" if left is not None and left < 10 else None)
    fixed: list[Markup] = [
        [("label", "holder "), ("self" if me else None, fmt.short_id(holder, g) + me)],
        [("label", "term "), "-" if fmt.num(term) is None else str(int(fmt.num(term) or 0)),
         ("label", "  lease "), (lease_attr, fmt.countdown(left)) if lease_attr else fmt.countdown(left)],
    ]
    rows: list[Markup] = []
    for h in sorted(history, key=lambda h: -(fmt.num(h.get("term")) or 0)):
        ended = h.get("ended")
        attr = "warn" if ended == "failover" else ("ok" if ended is None else "dim")
        n = fmt.num(h.get("rounds_served"))
        line = f"t{fmt.text(h.get('term'))} {fmt.short_id(h.get('holder'), g)} {'-' if n is None else int(n)}r "
        rows.append([line, (attr, fmt.text(ended, "current"))])
    if not rows:
        rows.append(note("no past terms"))
    return Content(fixed, rows)


# -- run -----------------------------------------------------------------------------

def run(obj: Mapping[str, Any], ctx: Ctx, width: int, height: int) -> Content:
    """Run id, round and phase, deadline countdown, participants against quorum."""
    g = ctx.glyphs
    r = fmt.section(obj, "run")
    if not r:
        return Content([note("no run")], [])
    left = fmt.remaining(r.get("deadline_s"), since_fetch_s=ctx.since_fetch_s, wall_now=ctx.wall_now)
    if fmt.phase_base(r) in fmt.ENDED_PHASES:
        left = None  # the last announcement's deadline still counts down at the node: nothing is due
    parts, quorum = fmt.num(r.get("participants")), fmt.num(r.get("quorum"))
    if parts == 0 and not fmt.items(r, "history"):
        parts = None  # nothing committed yet: "0/2 ✗" would read as a failed round
    if parts is not None and quorum is not None:
        met = parts >= quorum
        quorum_m: Markup = [f"{int(parts)}/{int(quorum)} ", ("ok" if met else "warn", g.ok if met else g.bad)]
    else:
        quorum_m = f"{fmt.si(parts, 0)}/{fmt.si(quorum, 0)}"
    due_attr = "bad" if left is not None and left < 0 else ("warn" if left is not None and left < 10 else None)
    phase = fmt.phase_label(r)
    rows: list[Markup] = [
        [("label", "run    "), run_label(r, g)],
        [("label", "round  "), fmt.round_label(r), " ", (fmt.phase_attr(phase), phase)],
        [("label", "due    "), (due_attr, fmt.countdown(left)) if due_attr else fmt.countdown(left)],
        [("label", "quorum "), quorum_m],
        [("label", "theta  "), fmt.short_cid(r.get("theta"), g)],
    ]
    return Content([], rows)


def run_label(r: Mapping[str, Any], g: Glyphs) -> str:
    """``tui …b6jyx5``: a run id is the CID of its signed spec, and every CID starts
    ``bafkrei``, so the spec's name plus the id's tail is what tells runs apart."""
    run_id, name = fmt.text(r.get("run_id")), r.get("name")
    if not isinstance(name, str) or not name:
        return run_id
    return f"{name} {fmt.short_id(run_id, g, keep=6)}" if run_id != "-" else name


# -- training ------------------------------------------------------------------------

def training(obj: Mapping[str, Any], ctx: Ctx, width: int, height: int) -> Content:
    """Loss and validation loss over rounds, tokens per second, outer learning rate."""
    g = ctx.glyphs
    r = fmt.section(obj, "run")
    if not r:
        return Content([note("no run")], [])
    history = sorted(fmt.items(r, "history"), key=lambda h: fmt.num(h.get("round")) or 0)
    loss = fmt.num(r.get("loss"))
    val = fmt.num(r.get("val_loss"))
    if loss is None and history:
        loss = fmt.num(history[-1].get("loss"))
    if val is None and history:
        val = fmt.num(history[-1].get("val_loss"))
    lr = fmt.num(r.get("outer_lr"))
    fixed: list[Markup] = [
        [("loss", g.loss), " loss ", "-" if loss is None else f"{loss:.3f}",
         "   ", ("val", g.val), " val ", "-" if val is None else f"{val:.3f}"],
        [fmt.si(r.get("tokens_per_s")), " tokens/s   outer lr ", "-" if lr is None else f"{lr:g}"],
    ]
    chart_h = max(0, height - len(fixed))
    if not history:
        return Content(fixed, [note("no round committed yet")])
    rounds = [fmt.num(h.get("round")) for h in history]
    ticks = [int(x) for x in rounds if x is not None]
    chart = line_chart([[fmt.num(h.get("loss")) for h in history], [fmt.num(h.get("val_loss")) for h in history]],
                       width, chart_h, glyphs=g, rounds=ticks if len(ticks) == len(rounds) else None)
    rows: list[Markup] = [_colour_chart_line(line, g) for line in chart]
    if rounds and rounds[0] is not None and rounds[-1] is not None and chart_h >= 1:
        fixed[1] = fixed[1] + [("dim", f"   r{int(rounds[0])}-{int(rounds[-1])}")]
    return Content(fixed, rows)


def _colour_chart_line(line: str, g: Glyphs) -> Markup:
    attrs = {g.loss: "loss", g.val: "val", g.both: "loss", g.link: "dim"}
    out: list[Markup] = []
    for ch in line:
        attr = attrs.get(ch)
        if out and isinstance(out[-1], tuple) and out[-1][0] == attr:
            out[-1] = (attr, out[-1][1] + ch)
        else:
            out.append((attr, ch))
    return [(a, s) if a else s for a, s in out]


# -- artifacts -----------------------------------------------------------------------

ARTIFACT_COLS = (Col("target", None), Col("cid", 14), Col("size", 8, "right"), Col("cache", 5))


def artifacts(obj: Mapping[str, Any], ctx: Ctx, width: int, height: int) -> Content:
    """Compiled artifacts this node holds: target, CID, size, whether the cache had it."""
    g = ctx.glyphs
    arts = fmt.items(obj, "artifacts")
    if not arts:
        return Content([note("no artifacts")], [])
    cols = ARTIFACT_COLS if width >= 40 else tuple(c for c in ARTIFACT_COLS if c.title != "size")
    rows = []
    for a in unique_artifacts(arts):
        hit = a.get("cache_hit")
        cache = (("ok", "hit") if hit else ("dim", "miss")) if isinstance(hit, bool) else ("dim", "-")
        cells = [(None, fmt.text(a.get("target"))), (None, fmt.short_cid(a.get("cid"), g)),
                 (None, fmt.human_bytes(a.get("size"))), cache]
        if len(cols) == 3:
            del cells[2]
        rows.append(table_line(cols, cells, width, g))
    return Content([header_line(cols, width, g)], rows)


def unique_artifacts(arts: Sequence[Mapping[str, Any]]) -> list[Mapping[str, Any]]:
    """One row per (target, CID). A shepherd lists its artifact twice, once compiled
    (``cache_hit`` true or false) and once loaded into its own executor (``cache_hit``
    null: not compiled here); the compiled entry is the one that says something."""
    seen: dict[tuple[str, str], int] = {}
    out: list[Mapping[str, Any]] = []
    for a in arts:
        key = (fmt.text(a.get("target")), fmt.text(a.get("cid")))
        if key not in seen:
            seen[key] = len(out)
            out.append(a)
        elif not isinstance(out[seen[key]].get("cache_hit"), bool) and isinstance(a.get("cache_hit"), bool):
            out[seen[key]] = a
    return out


# -- network -------------------------------------------------------------------------

def network(obj: Mapping[str, Any], ctx: Ctx, width: int, height: int) -> Content:
    """Connected peers, bytes in and out, rejected inputs by reason."""
    net = fmt.section(obj, "network")
    rejected = fmt.section(net, "rejected")
    counts = {str(k): int(fmt.num(n) or 0) for k, n in rejected.items()}
    bad, stale = split_rejected(counts)
    fixed: list[Markup] = [
        [("label", "peers "), fmt.text(net.get("connected_peers"), "0"), ("label", "  table "),
         fmt.text(net.get("routing_table_size"), "0"), ("dim", f" {fmt.text(net.get('dht_mode'), '')}")],
        [("label", "in "), fmt.human_bytes(net.get("bytes_in")),
         ("label", "  out "), fmt.human_bytes(net.get("bytes_out"))],
        # Split: a healthy swarm rejects stale and duplicate messages all the time.
        [("label", "bad input "), ("warn" if bad else None, str(bad)), ("label", "  stale/dup "), str(stale)],
    ]
    faults = int(fmt.num(net.get("local_faults")) or 0)
    if faults:  # this node's own bugs met handling peers' input (pcp_p2p.core.faults): never the peers' fault
        fixed.append([("label", "local faults "), ("warn", str(faults))])
    # Bad input first (it is what a reader looks for), then the stale and duplicate, dimmed.
    order = sorted(counts.items(), key=lambda kv: (split_rejected({kv[0]: 1})[0] == 0, -kv[1], kv[0]))
    rows: list[Markup] = [[f"{n:>5} ", reason] if split_rejected({reason: 1})[0] else ("dim", f"{n:>5} {reason}")
                          for reason, n in order]
    return Content(fixed, rows)


ContentFn = Callable[[Mapping[str, Any], Ctx, int, int], Content]
# Tab order, and the name each panel is known by in the help and in tests.
PANELS: tuple[tuple[str, ContentFn], ...] = (
    ("swarm", swarm), ("shepherd", shepherd), ("run", run),
    ("training", training), ("artifacts", artifacts), ("network", network),
)


# The panel's frame: a titled line box around the line stack, inside a border colour.
_Box: TypeAlias = "urwid.LineBox[urwid.AttrMap[urwid.Filler[urwid.Pile]]]"
_Border: TypeAlias = "urwid.AttrMap[_Box]"


class Panel(urwid.Widget):
    """A titled box showing one panel's content, scrollable when it has the focus.

    The content is recomputed on every render from the view's current status
    (cheap: a few dozen lines), so the panel holds no copy that could go stale;
    what it keeps is its scroll offset and whether it has the focus.
    """

    _sizing = frozenset([urwid.Sizing.BOX])
    _selectable = True

    def __init__(self, name: str, fn: ContentFn, source: Callable[[], tuple[Mapping[str, Any], Ctx]],
                 title_extra: Callable[[Glyphs], Markup] | None = None) -> None:
        super().__init__()
        self.name = name
        self.fn = fn
        self.source = source
        self.title_extra = title_extra
        self.offset = 0
        self.focused = False
        self._visible = 1
        self._total = 0
        self._built: tuple[Glyphs, _Border, _Box, urwid.Pile] | None = None
        self._texts: list[urwid.Text] = []

    def _widgets(self, g: Glyphs) -> tuple[_Border, _Box, urwid.Pile]:
        """The border, box and line stack, built once (urwid widget construction is
        the expensive part of a frame) and refilled on every render."""
        if self._built is None or self._built[0] is not g:
            pile = urwid.Pile([])
            box = urwid.LineBox(urwid.AttrMap(urwid.Filler(pile, valign="top"), "body"),
                                title=self.name, title_align="left", **g.box)
            self._built = (g, urwid.AttrMap(box, "border"), box, pile)
        return self._built[1], self._built[2], self._built[3]

    def render(self, size: tuple[int, int], focus: bool = False) -> urwid.Canvas:  # type: ignore[override]  # a box widget: urwid passes (maxcol, maxrow)
        maxcol, maxrow = size
        obj, ctx = self.source()
        g = ctx.glyphs
        inner_w, inner_h = max(1, maxcol - 2), max(1, maxrow - 2)
        c = self.fn(obj, ctx, inner_w, inner_h)
        fixed = c.fixed[:inner_h]
        visible = max(0, inner_h - len(fixed))
        total = len(c.rows)
        self._visible, self._total = visible, total
        self.offset = max(0, min(self.offset, total - visible))
        shown = list(c.rows[self.offset : self.offset + visible])
        border, box, pile = self._widgets(g)
        while len(self._texts) < inner_h:
            self._texts.append(urwid.Text("", wrap="clip"))
        lines = fixed + shown
        for i, t in enumerate(self._texts[:inner_h]):
            t.set_text(lines[i] if i < len(lines) else "")
        if len(pile.contents) != inner_h:
            pile.contents[:] = [(t, (urwid.PACK, None)) for t in self._texts[:inner_h]]
        # The focus is marked in text as well as colour: a NO_COLOR terminal or a
        # `tmux capture-pane` still shows where tab has moved it.
        title: list[Markup] = [(g.focus + " " if self.focused else "") + self.name]
        if self.title_extra is not None:
            title += [" ", self.title_extra(g)]
        if total > visible > 0:
            title.append(f" {self.offset + 1}-{self.offset + len(shown)}/{total}")
        elif total > 0 and visible == 0:
            title.append(f" ({total} hidden)")
        box.set_title(("title_focus" if self.focused else "title", title))
        attr_map: dict[Hashable, Hashable] = {None: "border_focus" if self.focused else "border"}
        border.set_attr_map(attr_map)
        return border.render(size, focus)

    def keypress(self, size: tuple[int, int], key: str) -> str | None:  # type: ignore[override]  # a box widget: urwid passes (maxcol, maxrow)
        page = max(1, self._visible - 1)
        last = max(0, self._total - self._visible)
        moves = {"up": self.offset - 1, "down": self.offset + 1, "page up": self.offset - page,
                 "page down": self.offset + page, "home": 0, "end": last}
        if key not in moves:
            return key
        self.offset = max(0, min(moves[key], last))
        self._invalidate()
        return None
