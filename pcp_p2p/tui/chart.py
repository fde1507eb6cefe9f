"""Loss and validation loss over rounds as a text chart.

A block/marker chart in plain characters, because the TUI has to be readable
over SSH at 80x24 and in ``tmux capture-pane``: no graphics protocol, no
braille (many fonts lack it). Each column is one round; when there are more
rounds than columns, each column is the mean of a bucket of consecutive rounds,
so the whole run stays visible rather than only its tail. The y range is the
data's own (losses of a language model live in a narrow band: a range from 0
would flatten the curve).

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


def line_chart(
    series: Sequence[Sequence[float | None]],
    width: int,
    height: int,
    *,
    glyphs: Glyphs = UNICODE,
    markers: Sequence[str] | None = None,
) -> list[str]:
    """``height`` lines of exactly ``width`` characters plotting each series.

    ``series[k][i]`` is the value of series k at round i (None where missing).
    Where two series land on the same cell, ``glyphs.both`` is drawn.
    """
    if width <= 0 or height <= 0:
        return []
    markers = list(markers or [glyphs.loss, glyphs.val])
    plot_w = width - LABEL_WIDTH
    if plot_w < 2:
        return [" " * width for _ in range(height)]
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
    grid = [[" "] * plot_w for _ in range(height)]
    for k, s in enumerate(cols):
        mark = markers[k % len(markers)]
        for x, v in enumerate(s):
            if v is None or not math.isfinite(v):
                continue
            y = round((hi - v) / (hi - lo) * (height - 1)) if height > 1 else 0
            cell = grid[y][x]
            grid[y][x] = mark if cell in (" ", mark) else glyphs.both
    lines = []
    for y in range(height):
        if y == 0:
            label, axis = _label(hi, hi - lo), glyphs.tick
        elif y == height - 1:
            label, axis = _label(lo, hi - lo), glyphs.tick
        else:
            label, axis = " " * (LABEL_WIDTH - 1), glyphs.axis
        lines.append(label + axis + "".join(grid[y]))
    return lines
