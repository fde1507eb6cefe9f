"""The status TUI rendered to text from recorded status snapshots: no terminal, no network.

``tests/fixtures/status_worker_idle.json`` is a real ``pcp status --json`` of a
worker in a 2-worker local swarm (no run yet); ``status_run.json`` adds the
run, shepherd and artifact sections other parts of PCP report, in the schema
they agreed on; ``status_nulls.json`` has those sections present but null.
"""

from __future__ import annotations

import itertools
import json
import threading
from pathlib import Path
from typing import Any

import pytest
import urwid

from pcp_p2p.core.errors import PeerGone
from pcp_p2p.tui import fmt, panels
from pcp_p2p.tui.app import apply_result
from pcp_p2p.tui.chart import bucket_means, line_chart
from pcp_p2p.tui.fetcher import FetchResult, StatusFetcher, backoff
from pcp_p2p.tui.fmt import ASCII, UNICODE, Style
from pcp_p2p.tui.view import MIN_COLS, MIN_ROWS, StatusView

FIXTURES = Path(__file__).parent / "fixtures"
TARGET = "/ip4/127.0.0.1/tcp/4001/p2p/12D3KooWMYr4WpzmGz3vqtFWhdTFnqu4nspTu7eVku3G43ptDQgv"
COLOUR = Style(colors=256, glyphs=UNICODE)


def snapshot(name: str) -> dict[str, Any]:
    return json.loads((FIXTURES / f"status_{name}.json").read_text())


class Clock:
    def __init__(self, t: float = 1000.0) -> None:
        self.t = t

    def __call__(self) -> float:
        return self.t


def make_view(name: str | None = None, style: Style = COLOUR, clock: Clock | None = None) -> StatusView:
    clock = clock or Clock()
    view = StatusView(TARGET, style, clock=clock, wall=lambda: 1.7e9)
    if name is not None:
        view.apply_status(snapshot(name), at=clock())
    return view


def screen(view: StatusView, size: tuple[int, int] = (80, 24)) -> str:
    rows = view.render(size).text
    assert len(rows) == size[1]
    lines = [r.decode("utf-8") for r in rows]
    assert all(len(line) == size[0] for line in lines), "every row is exactly the terminal width"
    return "\n".join(lines)


# -- every panel from snapshots ------------------------------------------------------------

def test_full_snapshot_shows_every_panel_at_80x24() -> None:
    obj = snapshot("run")
    text = screen(make_view("run"))
    for title in ("swarm (7)", "run", "shepherd", "network", "training", "artifacts"):
        assert title in text
    # swarm: the GPU members with backend, device and throughput, states, last seen
    assert "cuda" in text and "NVIDIA H100 80GB HBM3" in text and "51.2k" in text
    assert "rocm" in text and "AMD Radeon RX 7900 XTX" in text
    assert "training" in text and "shepherd" in text and "0.4s" in text
    assert "* " + fmt.short_id(obj["peer_id"]) in text  # this node is marked
    # run: round, phase, deadline countdown, participants against quorum
    assert "shakespeare-gpt-s" in text and "31 collecting" in text and "1m27s" in text and "4/3 ✓" in text
    # shepherd: holder (this node), term, lease countdown, history
    assert "(me)" in text and "term 4" in text and "lease 42s" in text and "current" in text
    # training: last losses, tokens/s, outer lr, a chart with both series
    assert "loss 1.570" in text and "val 1.680" in text and "41.2k tokens/s" in text and "outer lr 0.7" in text
    assert "r1-30" in text and "●" in text and "┤" in text
    # artifacts: targets, CIDs, cache hits
    assert "cpu-x86_64-" in text and "bafkrei…4s52zy" in text and "hit" in text and "miss" in text
    # network: peers, bytes, rejected inputs
    assert "peers 6" in text and "in 1.7 GiB" in text and "out 393.9 MiB" in text
    assert "bad input 3  stale/dup 12" in text  # 15 rejected: 3 refused as bad input, 12 stale heartbeats
    assert "live" in text.splitlines()[0]


@pytest.mark.parametrize("name", ["worker_idle", "nulls"])
def test_node_without_a_run_shows_no_run_instead_of_failing(name: str) -> None:
    obj = snapshot(name)
    text = screen(make_view(name))
    assert "swarm (2)" in text
    for m in obj["members"]:
        assert fmt.short_id(m["peer_id"]) in text
    assert text.count("no run") == 3  # run, shepherd ("no shepherd (no run)"), training
    assert "no artifacts" in text
    assert "in -  out -" in text and "bad input 0  stale/dup 0" in text


def test_garbage_sections_do_not_crash_the_screen() -> None:
    obj = snapshot("worker_idle")
    obj.update(run={"round": "x", "history": [None, 3, {"round": 1, "loss": "nan"}], "participants": None},
               term=[], lease_expires_s="soon", shepherd_history={"a": 1}, artifacts=[1, "x", {"size": None}])
    obj["members"].append({"peer_id": None, "capabilities": None})
    obj["network"] = None
    view = make_view()
    view.apply_status(obj)
    text = screen(view)
    assert "swarm (3)" in text and "no data yet" in text and "term -" in text


def test_countdowns_run_down_between_fetches_and_go_over() -> None:
    clock = Clock()
    view = make_view("run", clock=clock)
    assert "1m27s" in screen(view) and "lease 42s" in screen(view)
    clock.t += 50
    text = screen(view)
    assert "37s" in text and "lease 8s over" in text
    assert "stale 50s" in text.splitlines()[0]


def test_absolute_unix_times_are_understood_too() -> None:
    assert fmt.remaining(1.7e9 + 30, since_fetch_s=5, wall_now=1.7e9) == 30
    assert fmt.remaining(30, since_fetch_s=5, wall_now=1.7e9) == 25
    assert fmt.remaining(None, since_fetch_s=5, wall_now=0) is None


def test_larger_terminal_gives_the_tables_room() -> None:
    text = screen(make_view("run"), (120, 40))
    assert "swarm (7)" in text and "1-" not in text.split("\n")[1]  # all 7 members fit: no scroll range
    for pid in [m["peer_id"] for m in snapshot("run")["members"]]:
        assert fmt.short_id(pid) in text


def live_run_snapshot(**run: Any) -> dict[str, Any]:
    """The ``run`` snapshot in the schema a training node reports today (see
    ``RunRuntime.status``): the run id is the spec's CID, with ``name`` and ``rounds``."""
    obj = snapshot("run")
    obj["run"].update(run_id="bafkreieoifb6jyx5zq2ftbd3fztcyfxqlwffbxgxfqxhgiv3mqepevvx4m", name="tui", rounds=40)
    obj["run"].update(run)
    return obj


def test_a_training_node_s_run_is_named_by_its_spec_with_the_round_out_of_all() -> None:
    view = make_view()
    view.apply_status(live_run_snapshot())
    text = screen(view)
    assert "run    tui …evvx4m" in text and "bafkreieoifb" not in text
    assert "round  31/40 collecting" in text


def test_before_the_first_commit_the_quorum_is_unknown_not_failed() -> None:
    view = make_view()
    view.apply_status(live_run_snapshot(round=0, phase="training", participants=0, history=[], loss=None,
                                        val_loss=None))
    text = screen(view)
    assert "quorum -/3" in text and "✗" not in text and "no round committed yet" in text


def test_a_finished_run_has_nothing_due_and_a_lost_shepherd_is_a_warning() -> None:
    view = make_view()
    view.apply_status(live_run_snapshot(round=40, phase="finished", deadline_s=7.0))
    text = screen(view)
    assert "round  40/40 finished" in text and "due    -" in text
    lost = panels.run(live_run_snapshot(phase="fetching (shepherd lost)"), panels.Ctx(), 24, 4)
    assert ("warn", "fetching (shepherd lost)") in lost.rows[1]
    normal = panels.run(live_run_snapshot(), panels.Ctx(), 24, 4)
    assert ("ok", "collecting") in normal.rows[1]


def test_the_shepherd_is_marked_in_the_swarm_even_though_its_heartbeat_says_training() -> None:
    obj = live_run_snapshot()
    shepherd = obj["run"]["shepherd"]
    for m in obj["members"]:
        m["state"] = "training"
    view = make_view()
    view.apply_status(obj)
    row = next(line for line in screen(view).splitlines() if fmt.short_id(shepherd) in line and "cpu" in line)
    assert "shepherd" in row and "training" not in row


def test_an_artifact_listed_twice_shows_once_and_null_cache_is_not_a_miss() -> None:
    cid = "bafkreigh2akiscaildcqabsyg3dfr6chu3fgpregiymsck7e7aqa4s52zy"
    other = "bafkreiab6ydd4x7cxvbmjqp2fmlfcu6f2xqbsn2ixb5bcvmfxyzqlmbu3e"
    obj = live_run_snapshot()
    # a shepherd: loaded into its executor (null) and compiled (false); a fetched-only one (null)
    obj["artifacts"] = [{"target": "cpu-x86_64-v4", "cid": cid, "size": 10, "cache_hit": None},
                        {"target": "cpu-x86_64-v4", "cid": cid, "size": 10, "cache_hit": False},
                        {"target": "cpu-x86_64-v3", "cid": other, "size": 10, "cache_hit": None}]
    view = make_view()
    view.apply_status(obj)
    rows = [line for line in screen(view).splitlines() if "cpu-x86_64-v" in line]
    assert len(rows) == 2
    assert "miss" in rows[0] and "bafkrei…4s52zy" in rows[0]
    assert "miss" not in rows[1] and rows[1].rstrip("│ ").endswith("-")


# -- keys ------------------------------------------------------------------------------------

def test_tab_moves_the_focus_through_every_panel_and_wraps() -> None:
    view = make_view("run")
    size = (80, 24)
    seen = []
    for _ in range(6):
        seen.append(view.focused_panel.name)
        assert f"▶ {view.focused_panel.name}" in screen(view)
        assert view.keypress(size, "tab") is None
    assert seen == ["swarm", "shepherd", "run", "training", "artifacts", "network"]
    assert view.focused_panel.name == "swarm"
    view.keypress(size, "shift tab")
    assert view.focused_panel.name == "network"
    view.keypress(size, "4")
    assert view.focused_panel.name == "training"


def test_arrows_scroll_the_focused_table() -> None:
    view = make_view("run")
    size = (80, 24)
    assert "swarm (7) 1-4/7" in screen(view)
    view.keypress(size, "down")
    text = screen(view)
    assert "swarm (7) 2-5/7" in text
    view.keypress(size, "end")
    assert "4-7/7" in screen(view)
    view.keypress(size, "down")  # already at the bottom: stays
    assert "4-7/7" in screen(view)
    view.keypress(size, "home")
    assert "1-4/7" in screen(view)
    # the shepherd history scrolls on its own once focused
    view.keypress(size, "tab")
    before = screen(view)
    view.keypress(size, "down")
    assert "shepherd 2-3/4" in screen(view) and "shepherd 1-2/4" in before
    assert "1-4/7" in screen(view)  # the swarm panel kept its own offset


def test_question_mark_shows_help_and_esc_closes_it() -> None:
    view = make_view("run")
    size = (80, 24)
    assert "help" not in screen(view).split("\n", 1)[1].replace("? help", "")
    view.keypress(size, "?")
    text = screen(view)
    assert "tab         next panel" in text and "q           quit" in text
    view.keypress(size, "tab")  # keys other than the closing ones do nothing while help shows
    assert view.show_help and view.focused_panel.name == "swarm"
    view.keypress(size, "esc")
    assert not view.show_help and "next panel" not in screen(view)


def test_q_quits() -> None:
    view = make_view("run")
    with pytest.raises(urwid.ExitMainLoop):
        view.keypress((80, 24), "q")
    quits = []
    view = StatusView(TARGET, COLOUR, on_quit=lambda: quits.append(1))
    view.keypress((80, 24), "?")
    view.keypress((80, 24), "q")  # q quits from the help screen too
    view.keypress((80, 24), "ctrl c")
    assert quits == [1, 1]


def test_the_data_dir_address_is_read_again_on_every_attempt(tmp_path: Path) -> None:
    from argparse import Namespace

    from pcp_p2p.commands.node_commands import ADDR_FILE, _addr_source

    addr_file = tmp_path / ADDR_FILE
    addr_file.write_text("/ip4/127.0.0.1/tcp/1/p2p/A\n")
    source = _addr_source(Namespace(connect=None, data_dir=tmp_path), "/ip4/127.0.0.1/tcp/1/p2p/A")
    assert source() == "/ip4/127.0.0.1/tcp/1/p2p/A"
    addr_file.write_text("/ip4/127.0.0.1/tcp/2/p2p/A\n")  # the node restarted on another port
    assert source() == "/ip4/127.0.0.1/tcp/2/p2p/A"
    addr_file.unlink()  # the node is down: keep trying the last address given
    assert source() == "/ip4/127.0.0.1/tcp/1/p2p/A"
    fixed = _addr_source(Namespace(connect="/ip4/127.0.0.1/tcp/9/p2p/B", data_dir=tmp_path),
                         "/ip4/127.0.0.1/tcp/9/p2p/B")
    assert fixed() == "/ip4/127.0.0.1/tcp/9/p2p/B"


# -- connection state ---------------------------------------------------------------------------

def test_before_the_first_answer_it_says_connecting() -> None:
    text = screen(make_view())
    assert "connecting to" in text and "Traceback" not in text


def test_failed_fetch_shows_disconnected_retrying_and_keeps_the_last_status() -> None:
    clock = Clock()
    view = make_view("run", clock=clock)
    clock.t += 2
    view.apply_error("cannot reach the node: connection refused", retry_in_s=2.0)
    text = screen(view)
    assert "disconnected, retrying in 2s" in text.splitlines()[0]
    assert "cannot reach the node: connection refused" in text.splitlines()[-1]
    assert "NVIDIA H100" in text  # the last known status stays on screen
    clock.t += 2
    assert "disconnected, retrying " in screen(view)
    # the node is back
    view.apply_status(snapshot("run"))
    text = screen(view)
    assert "disconnected" not in text and "live" in text.splitlines()[0]


def test_never_connected_and_failing() -> None:
    view = make_view()
    apply_result(view, FetchResult(None, "no status from the node within 5 s", 1000.0, 1.0))
    apply_result(view, FetchResult(None, "no status from the node within 5 s", 1000.0, 2.0))
    text = screen(view)
    assert "disconnected, retrying in 2s (attempt 2)" in text
    assert "no status from the node within 5 s" in text


def test_too_small_terminal_says_so() -> None:
    view = make_view("run")
    for size in [(79, 24), (80, 23), (40, 10), (20, 3)]:
        rows = [r.decode() for r in view.render(size).text]
        assert len(rows) == size[1]
        text = "\n".join(rows)
        assert "too small" in text
        if size[0] >= 40 and size[1] >= 5:
            assert f"{size[0]}x{size[1]}" in text and f"{MIN_COLS}x{MIN_ROWS}" in text
    assert "too small" not in screen(view, (MIN_COLS, MIN_ROWS))


# -- plain terminals ------------------------------------------------------------------------

def test_no_color_and_dumb_terminals_degrade() -> None:
    assert Style.detect({"TERM": "xterm-256color"}) == Style(256, UNICODE)
    assert Style.detect({"TERM": "xterm-256color", "NO_COLOR": "1"}) == Style(1, UNICODE)
    assert Style.detect({"TERM": "xterm-256color", "NO_COLOR": ""}).colors == 256  # empty: not set (no-color.org)
    assert Style.detect({"TERM": "dumb"}) == Style(1, ASCII)
    assert Style.detect({"TERM": "xterm"}, encoding="ascii").glyphs is ASCII


def test_ascii_rendering_is_pure_ascii() -> None:
    view = make_view("run", style=Style(1, ASCII))
    text = screen(view)
    assert text.isascii()
    assert "> swarm" in text and "+- " not in text[:0] and "|" in text and "4/3 +" in text
    view.keypress((80, 24), "?")
    assert screen(view).isascii()


# -- pieces -------------------------------------------------------------------------------------

def test_chart_plots_both_series_with_the_data_range() -> None:
    loss = [4.0, 3.0, 2.0, 1.0]
    val = [4.0, 3.5, 2.5, 1.5]
    lines = line_chart([loss, val], width=16, height=4, glyphs=ASCII)
    assert len(lines) == 4 and all(len(line) == 16 for line in lines)
    assert lines[0].startswith(" 4.00+") and lines[-1].startswith(" 1.00+")
    plot = [line[6:] for line in lines]
    assert plot[0][0] == "@"  # both series at 4.0 in round 1
    # 4 rounds stretched over 10 columns: rounds at columns 0, 3, 6, 9, linked by dots
    assert plot[3][9] == "*" and plot[2][9] == "o"  # loss 1.0 on the bottom row, val 1.5 above it
    assert "." in plot[1] and plot[3][:9].strip(" .") == ""


def test_chart_labels_keep_a_narrow_range_apart() -> None:
    lines = line_chart([[3.073], [3.071]], width=16, height=4, glyphs=ASCII)
    assert lines[0].startswith("3.073+") and lines[-1].startswith("3.071+")


def test_chart_squeezes_long_runs_and_handles_missing_values() -> None:
    assert bucket_means([1.0, 3.0, 5.0, 7.0], 2) == [2.0, 6.0]
    assert bucket_means([None, None, 1.0], 5) == [None, None, 1.0]
    lines = line_chart([[float(i) for i in range(500)]], width=30, height=5)
    assert all(len(line) == 30 for line in lines)
    assert "●" in lines[0] and "●" in lines[-1]
    assert "no data yet" in "".join(line_chart([[None, float("nan")]], width=30, height=3))
    flat = line_chart([[2.0, 2.0]], width=30, height=3)[1]
    assert flat[6] == "●" and flat[-1] == "●" and set(flat[7:-1]) == {"·"}  # a flat line sits mid-chart, full width


def test_formatting() -> None:
    assert fmt.si(41250) == "41.2k" and fmt.si(None) == "-" and fmt.si(3) == "3"
    assert fmt.human_bytes(1873920512) == "1.7 GiB" and fmt.human_bytes(12) == "12 B"
    assert fmt.duration(5523) == "1h32m" and fmt.duration(87.5) == "1m27s" and fmt.duration(3) == "3s"
    assert fmt.countdown(-8) == "8s over"
    assert fmt.short_id("12D3KooWMYr4WpzmGz3vqtFWhdTFnqu4nspTu7eVku3G43ptDQgv") == "…43ptDQgv"
    assert fmt.backend_and_device({"backends": ["hip"], "devices": [{"name": "RX", "driver": "hip"}]}) == ("rocm", "RX")
    assert fmt.backend_and_device({}) == ("-", "-")


def test_fetcher_reports_failures_with_backoff_then_success() -> None:
    assert [backoff(n, 1.0) for n in range(6)] == [1.0, 1.0, 2.0, 4.0, 5.0, 5.0]
    assert backoff(5000, 1.0) == 5.0  # hours of failures: the doubling stays capped, no OverflowError
    outcomes = [PeerGone("connection refused"), RuntimeError("bug"), {"peer_id": "x"}]
    results: list[FetchResult] = []
    done = threading.Event()
    addrs = []

    async def fetch(addr: str) -> dict[str, Any]:
        addrs.append(addr)
        out = outcomes[min(len(addrs), len(outcomes)) - 1]
        if isinstance(out, Exception):
            raise out
        return out

    def on_result(r: FetchResult) -> None:
        results.append(r)
        if len(results) == 3:
            done.set()

    fetcher = StatusFetcher(lambda: "addr", fetch, on_result, interval=0.01)
    fetcher.start()
    try:
        assert done.wait(10)
    finally:
        fetcher.stop()
    assert results[0].status is None and results[0].error == "connection refused"
    assert results[1].status is None and "RuntimeError: bug" in (results[1].error or "")
    assert results[2].status == {"peer_id": "x"} and results[2].error is None
    assert fetcher._thread is not None and not fetcher._thread.is_alive()


def test_the_screenshot_in_the_docs_is_what_the_code_draws() -> None:
    docs = (Path(__file__).parents[1] / "docs" / "tui.md").read_text()
    clock = Clock(100.0)
    view = StatusView(TARGET, COLOUR, clock=clock, wall=lambda: 1e9)
    view.apply_status(snapshot("run"), at=100.0)
    shot = "\n".join(line.rstrip() for line in screen(view).splitlines())
    assert f"```\n{shot}\n```" in docs


# -- honest labels: phases, 1-based rounds, rejected split, stretched chart ----------------


@pytest.mark.parametrize(("run", "shown"), [
    ({"round": 0, "rounds": 12, "phase": "compiling"}, "-/12 compiling"),  # not "0/12 idle"
    ({"round": 0, "rounds": 12, "phase": "waiting for quorum (1/3)"}, "-/12 waiting for quorum (1/3)"),
    ({"round": 0, "rounds": 12, "phase": "idle"}, "1/12 waiting"),  # a worker waiting for round 1
    ({"round": 0, "rounds": 12, "phase": "training"}, "1/12 training"),
    ({"round": 3, "rounds": 12, "phase": "training"}, "4/12 training"),  # 3 committed, the 4th under way
    ({"round": 3, "rounds": 12, "phase": "electing"}, "4/12 electing"),  # a new term, then round 4
    ({"round": 12, "rounds": 12, "phase": "idle"}, "12/12 waiting"),  # never 13/12
    ({"round": 12, "rounds": 12, "phase": "finished"}, "12/12 finished"),
    ({"round": 5, "rounds": 12, "phase": "stopped"}, "5/12 stopped"),
    ({"round": 3, "rounds": 12, "phase": "idle (shepherd lost)"}, "4/12 waiting (shepherd lost)"),
    ({"round": 2}, "3 starting"),  # no phase reported, no total
    ({"round": "x", "rounds": 4, "phase": "training"}, "-/4 training"),
])
def test_round_and_phase_labels_count_from_one_and_name_what_a_node_does(run: dict, shown: str) -> None:
    assert f"{fmt.round_label(run)} {fmt.phase_label(run)}" == shown


def test_a_phase_that_needs_attention_is_a_warning() -> None:
    for phase in ("waiting for quorum (1/3)", "set-up failed: no dataset", "training (shepherd lost)", "stopped"):
        assert fmt.phase_attr(phase) == "warn", phase
    for phase in ("compiling", "training", "waiting", "finished"):
        assert fmt.phase_attr(phase) == "ok", phase


def test_the_run_panel_shows_compiling_before_the_first_round() -> None:
    view = make_view()
    view.apply_status(live_run_snapshot(round=0, phase="compiling", participants=0, history=[]))
    assert "round  -/40 compiling" in screen(view)


def test_rejected_inputs_are_split_into_bad_input_and_stale_or_duplicate() -> None:
    from pcp_p2p.node.status import split_rejected

    counts = {"heartbeat:StaleMessage": 300, "round:HeldBack": 15, "round:ExpiredRecord": 6,
              "status:MalformedMessage": 2, "message:BadSignature": 1, "round:OverBudget": 1, "junk": "x"}
    assert split_rejected(counts) == (4, 321)
    assert split_rejected(None) == (0, 0) and split_rejected({"a:StaleMessage": float("inf")}) == (0, 0)
    obj = snapshot("run")
    obj["network"]["rejected"] = counts
    obj["network"]["local_faults"] = 2  # our own bugs (pcp_p2p.core.faults): shown apart, never as bad input
    content = panels.network(obj, panels.Ctx(), 25, 8)
    flat = ["".join(p if isinstance(p, str) else p[1] for p in (line if isinstance(line, list) else [line]))
            for line in content.fixed]
    assert "bad input 4  stale/dup 321" in flat and "local faults 2" in flat
    # bad input first; the stale and duplicate rows are dimmed
    assert "MalformedMessage" in "".join(map(str, content.rows[0]))
    assert content.rows[-1][0] == "dim"


def test_the_chart_stretches_a_few_rounds_over_the_width_with_round_ticks() -> None:
    lines = line_chart([[3.0, 2.0, 1.0]], width=40, height=6, glyphs=ASCII, rounds=[1, 2, 3])
    assert len(lines) == 6 and all(len(line) == 40 for line in lines)
    plot = [line[6:] for line in lines[:4]]
    assert plot[0][0] == "*" and plot[3][33] == "*"  # the first round at the left edge, the last at the right
    assert plot[2][16] == "*"  # round 2 in the middle
    assert "".join(plot).count("*") == 3 and set("".join(plot)) == {"*", ".", " "}  # linked by dots
    axis, labels = lines[4], lines[5]
    assert axis.startswith("round+") and axis[6] == "+" and axis[39] == "+"  # ticks under rounds 1 and 3
    assert labels[6] == "1" and labels.rstrip().endswith("3") and "2" in labels


def test_round_ticks_never_crowd_and_keep_the_first_and_last() -> None:
    from pcp_p2p.tui.chart import round_ticks, x_positions

    for n, w in ((5, 60), (30, 30), (1000, 70), (12, 20)):
        rounds = list(range(1, n + 1))
        ticks = round_ticks(x_positions(n, w), rounds, w)
        labels = [label for _, label in ticks]
        assert labels[0] == "1" and labels[-1] == str(n), (n, w, ticks)
        spans = [(min(x, w - len(label)), min(x, w - len(label)) + len(label)) for x, label in ticks]
        assert all(a_end < b_start for (_, a_end), (b_start, _) in itertools.pairwise(spans)), (n, w, ticks)
        assert all(0 <= s and e <= w for s, e in spans)


def test_throughput_says_when_it_was_measured() -> None:
    from pcp_p2p.node.status import throughput_text

    assert throughput_text({"throughput_gflops": 208.0, "throughput_measured_at": 1000.0}, now=1030.0) \
        == "208 GFLOP/s (measured 30 s ago)"
    assert throughput_text({"throughput_gflops": 208.0, "throughput_measured_at": 1000.0}, now=1000.0 + 600) \
        == "208 GFLOP/s (measured 10 min ago)"
    assert throughput_text({"throughput_gflops": 0.0}, now=0.0) == "0 GFLOP/s (not measured)"
    assert throughput_text({"throughput_gflops": 3.7}, now=0.0) == "4 GFLOP/s"  # an older node: no stamp
    assert throughput_text(None, now=0.0) == "- GFLOP/s"


def test_the_plain_text_status_splits_rejected_and_counts_rounds_from_one() -> None:
    from pcp_p2p.commands.node_commands import render_text

    text = render_text(live_run_snapshot(round=3, rounds=12, phase="idle"))
    assert "rejected 3 bad input, 12 stale or duplicate" in text
    assert "round 4/12 (waiting)" in text
    assert "GFLOP/s" in text and "(not measured)" not in text  # the fixture's figure has no stamp: shown bare
