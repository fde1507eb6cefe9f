"""Loss and validation loss over rounds as a text chart.

A block/marker chart in plain characters, because the TUI has to be readable
over SSH at 80x24 and in ``tmux capture-pane``: no graphics protocol, no
braille (many fonts lack it). The rounds are stretched over the whole width:
with fewer rounds than columns each round's point sits at its share of the
width, linked to the next by dots; with more rounds than columns each column is
the mean of a bucket of consecutive rounds, so the whole run stays visible
rather than only its tail. Given the rounds' numbers, the bottom two lines are
an x axis with ticks at round numbers that do not crowd each other. The y range
is the data's own (losses of a language model live in a narrow band: a range
from 0 would flatten the curve).

Pure functions of numbers: tested without a terminal.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

from pcp_p2p.tui.fmt import UNICODE, Glyphs

LABEL_WIDTH = 6  # "12.34" plus the axis character


def bucket_means(values: Sequence[float | None], n: int) -> list[float | None]:
    """``values`` squeezed into at most ``n`` points by averaging consecutive buckets."""
    if n <= 0:
        return []
    if len(values) <= n:
        return list(values)
    out: list[float | None] = []
    for i in range(n):
        lo = i * len(values) // n
        hi = max(lo + 1, (i + 1) * len(values) // n)
        finite = [v for v in values[lo:hi] if v is not None and math.isfinite(v)]
        out.append(sum(finite) / len(finite) if finite else None)
    return out


def _label(v: float, span: float = math.inf) -> str:
    """The axis label of ``v``; a ``span`` (top minus bottom) under 0.05 earns a third
    decimal, so that after one round "3.073" and "3.071" do not both read "3.07"."""
    a = abs(v)
    if a >= 1000:
        s = f"{v:.0e}"
    elif a >= 100:
        s = f"{v:.0f}"
    elif a >= 10:
        s = f"{v:.1f}"
    elif span < 0.05:
        s = f"{v:.3f}"
    else:
        s = f"{v:.2f}"
    return s[: LABEL_WIDTH - 1].rjust(LABEL_WIDTH - 1)


def x_positions(n: int, plot_w: int) -> list[int]:
    """The column of each of ``n`` points on a plot ``plot_w`` wide.

    Up to ``plot_w`` points are stretched (the first at column 0, the last at
    the right edge); more are bucketed as :func:`bucket_means` does.
    """
    if n <= 0 or plot_w <= 0:
        return []
    if n == 1:
        return [0]
    if n <= plot_w:
        return [round(i * (plot_w - 1) / (n - 1)) for i in range(n)]
    return [i * plot_w // n for i in range(n)]


NICE_STEPS = (1, 2, 5, 10, 20, 25, 50, 100, 200, 250, 500, 1000, 2000, 5000, 10_000)


def round_ticks(xs: Sequence[int], rounds: Sequence[int], plot_w: int) -> list[tuple[int, str]]:
    """(column, label) of the rounds to mark: the first, the last, and every multiple of
    the smallest step (1, 2, 5, 10, ...) whose labels leave a space between them."""
    if not xs or len(xs) != len(rounds):
        return []
    label_w = max(len(str(r)) for r in rounds) + 1
    span = max(1, rounds[-1] - rounds[0])
    step = next((s for s in NICE_STEPS if span / s * label_w <= plot_w), NICE_STEPS[-1])
    placed: list[tuple[int, str]] = []

    def fits(x: int, label: str) -> bool:
        start = min(x, plot_w - len(label))
        return start >= 0 and all(start > px + len(pl) or start + len(label) < min(px, plot_w - len(pl))
                                  for px, pl in placed)

    order = [0, len(xs) - 1] + [i for i in range(1, len(xs) - 1) if rounds[i] % step == 0]
    for i in order:
        label = str(rounds[i])
        if all(px != xs[i] for px, _ in placed) and fits(xs[i], label):
            placed.append((xs[i], label))
    return sorted(placed)


def line_chart(
    series: Sequence[Sequence[float | None]],
    width: int,
    height: int,
    *,
    glyphs: Glyphs = UNICODE,
    markers: Sequence[str] | None = None,
    rounds: Sequence[int] | None = None,
) -> list[str]:
    """``height`` lines of exactly ``width`` characters plotting each series.

    ``series[k][i]`` is the value of series k at round i (None where missing).
    Where two series land on the same cell, ``glyphs.both`` is drawn. With
    ``rounds`` (the number of each round, as people count them) and at least
    four lines, the last two are the x axis and its round labels.
    """
    if width <= 0 or height <= 0:
        return []
    markers = list(markers or [glyphs.loss, glyphs.val])
    plot_w = width - LABEL_WIDTH
    if plot_w < 2:
        return [" " * width for _ in range(height)]
    n = max((len(s) for s in series), default=0)
    axis = rounds is not None and len(rounds) == n and n > 0 and height >= 4
    plot_h = height - 2 if axis else height
    cols = [bucket_means(s, plot_w) for s in series]
    finite = [v for s in cols for v in s if v is not None and math.isfinite(v)]
    if not finite:
        blank = [" " * width for _ in range(height)]
        msg = "no data yet"
        blank[height // 2] = (" " * LABEL_WIDTH + msg.center(plot_w))[:width].ljust(width)
        return blank
    lo, hi = min(finite), max(finite)
    if hi - lo < 1e-12:
        lo, hi = lo - 0.5 * max(abs(lo), 1e-3), hi + 0.5 * max(abs(hi), 1e-3)

    def row_of(v: float) -> int:
        return round((hi - v) / (hi - lo) * (plot_h - 1)) if plot_h > 1 else 0

    grid = [[" "] * plot_w for _ in range(plot_h)]
    stretched = n <= plot_w
    for s in cols:  # the links first: a point drawn later always wins its cell
        xs = x_positions(len(s), plot_w) if stretched else list(range(len(s)))
        for (x0, v0), (x1, v1) in zip(zip(xs, s), zip(xs[1:], s[1:])):
            if v0 is None or v1 is None or not (math.isfinite(v0) and math.isfinite(v1)):
                continue
            for x in range(x0 + 1, x1):
                y = row_of(v0 + (v1 - v0) * (x - x0) / (x1 - x0))
                if grid[y][x] == " ":
                    grid[y][x] = glyphs.link
    for k, s in enumerate(cols):
        mark = markers[k % len(markers)]
        xs = x_positions(len(s), plot_w) if stretched else list(range(len(s)))
        for x, v in zip(xs, s):
            if v is None or not math.isfinite(v):
                continue
            y = row_of(v)
            cell = grid[y][x]
            grid[y][x] = mark if cell in (" ", glyphs.link, mark) else glyphs.both
    lines = []
    for y in range(plot_h):
        if y == 0:
            label, bar = _label(hi, hi - lo), glyphs.tick
        elif y == plot_h - 1:
            label, bar = _label(lo, hi - lo), glyphs.tick
        else:
            label, bar = " " * (LABEL_WIDTH - 1), glyphs.axis
        lines.append(label + bar + "".join(grid[y]))
    if axis:
        assert rounds is not None
        ticks = round_ticks(x_positions(n, plot_w), list(rounds), plot_w)
        line = [glyphs.hline] * plot_w
        text = [" "] * plot_w
        for x, label in ticks:
            line[x] = glyphs.xtick
            start = min(x, plot_w - len(label))
            text[start : start + len(label)] = list(label)
        lines.append("round".rjust(LABEL_WIDTH - 1)[: LABEL_WIDTH - 1] + glyphs.corner + "".join(line))
        lines.append(" " * LABEL_WIDTH + "".join(text))
    return lines
