"""``pcp status`` against a live local swarm: the TUI in a real terminal (tmux), and the pipe path.

tmux gives the TUI a real 80x24 pseudo-terminal and lets the test read the
screen back (``capture-pane``) and type keys (``send-keys``). There is no
event for "the screen now shows X", so the test polls the pane, bounded by a
deadline. Skipped where tmux is not installed; the tmux server runs on a
private socket and is killed in a ``finally``.

Two swarms: an idle one (members, keys, resize, a node going away, a dumb
terminal) and a training one (the run panel's round advancing, phase,
deadline, quorum, losses, the shepherd's term and lease).
"""

from __future__ import annotations

import json
import os
import re
import shlex
import shutil
import subprocess
import uuid
from collections.abc import Callable
from pathlib import Path

import pytest
import trio
from test_training_swarm import create_run

from pcp_p2p.node.local_swarm import local_swarm, pcp_command

pytestmark = pytest.mark.timeout(180)
REPO = Path(__file__).resolve().parents[1]


class Tmux:
    def __init__(self) -> None:
        self.socket = f"pcp-test-{os.getpid()}-{uuid.uuid4().hex[:8]}"

    def __call__(self, *args: str) -> str:
        res = subprocess.run(["tmux", "-L", self.socket, "-f", "/dev/null", *args],
                             capture_output=True, text=True, timeout=10)
        if res.returncode != 0:
            raise RuntimeError(f"tmux {' '.join(args)}: {res.stderr.strip()}")
        return res.stdout

    def screen(self) -> str:
        return self("capture-pane", "-p", "-t", "tui")

    async def wait_for(self, predicate: str | list[str], deadline_s: float = 30.0) -> str:
        wanted = [predicate] if isinstance(predicate, str) else predicate
        return await self.wait_until(lambda text: all(w in text for w in wanted), str(wanted), deadline_s)

    async def wait_until(self, predicate: Callable[[str], bool], what: str, deadline_s: float = 30.0) -> str:
        """Poll the pane until ``predicate(screen)`` holds; fail with the last screen after ``deadline_s``."""
        text = ""
        with trio.move_on_after(deadline_s):
            while True:
                text = await trio.to_thread.run_sync(self.screen)
                if predicate(text):
                    return text
                await trio.sleep(0.25)
        raise AssertionError(f"screen never showed {what} within {deadline_s:.0f} s; it shows:\n{text}")

    async def quit(self, rc_file: Path) -> str:
        """Press ``q`` and return the exit code the shell wrote to ``rc_file``."""
        self("send-keys", "-t", "tui", "q")
        rc = trio.Path(rc_file)
        with trio.fail_after(15):  # the file is written by another process: poll it
            while not (await rc.exists() and (await rc.read_text()).strip()):  # noqa: ASYNC110
                await trio.sleep(0.1)
        return (await rc.read_text()).strip()

    def kill(self) -> None:
        subprocess.run(["tmux", "-L", self.socket, "kill-server"], capture_output=True, timeout=10)


@pytest.mark.skipif(shutil.which("tmux") is None, reason="tmux is not installed")
async def test_tui_in_tmux_shows_the_members_and_quits_on_q(tmp_path: Path) -> None:
    async with local_swarm(tmp_path) as swarm:
        await swarm.start_bootstrap()
        a = await swarm.add_worker()
        b = await swarm.add_worker()
        await swarm.wait_views({a.peer_id, b.peer_id}, deadline_s=60)

        rc_file = tmp_path / "tui.rc"
        cmd = f"{shlex.join([*pcp_command(), 'status', '--connect', a.addr])}; echo $? > {shlex.quote(str(rc_file))}"
        tmux = Tmux()
        try:
            tmux("new-session", "-d", "-s", "tui", "-x", "80", "-y", "24", "-c", str(REPO), cmd)
            text = await tmux.wait_for([a.peer_id[-8:], b.peer_id[-8:], "live"])
            lines = text.splitlines()
            assert len(lines) <= 24 and all(len(line) <= 80 for line in lines)
            assert "swarm (2)" in text and "no run" in text and "Traceback" not in text

            tmux("send-keys", "-t", "tui", "Tab")
            await tmux.wait_for("shepherd  /ip4/")  # the footer names the focused panel
            tmux("send-keys", "-t", "tui", "?")
            await tmux.wait_for("next panel")
            tmux("send-keys", "-t", "tui", "Escape")

            # a window made too small says so, and comes back when made larger
            tmux("resize-window", "-t", "tui", "-x", "60", "-y", "20")
            await tmux.wait_for("terminal too small: 60x20")
            tmux("resize-window", "-t", "tui", "-x", "80", "-y", "24")
            await tmux.wait_for(["swarm (2)", b.peer_id[-8:]])

            # the node goes away: the screen says so and keeps running
            await swarm.kill(a)
            text = await tmux.wait_for("disconnected, retrying")
            assert "Traceback" not in text

            assert await tmux.quit(rc_file) == "0"

            # a dumb terminal without colours: plain ASCII, same content
            rc_file.unlink()
            cmd = (f"env TERM=dumb NO_COLOR=1 {shlex.join([*pcp_command(), 'status', '--connect', b.addr])}; "
                   f"echo $? > {shlex.quote(str(rc_file))}")
            tmux("new-session", "-d", "-s", "tui", "-x", "80", "-y", "24", "-c", str(REPO), cmd)
            text = await tmux.wait_for(["+ > swarm", "* " + "~" + b.peer_id[-8:], "live"])
            assert text.isascii()
            assert await tmux.quit(rc_file) == "0"
        finally:
            tmux.kill()


async def test_status_through_a_pipe_prints_text_and_json_unchanged(tmp_path: Path) -> None:
    async with local_swarm(tmp_path) as swarm:
        await swarm.start_bootstrap()
        a = await swarm.add_worker()
        b = await swarm.add_worker()
        await swarm.wait_views({a.peer_id, b.peer_id}, deadline_s=60)

        def run(*extra: str) -> subprocess.CompletedProcess[str]:
            return subprocess.run([*pcp_command(), "status", "--connect", a.addr, *extra],
                                  capture_output=True, text=True, timeout=60, stdin=subprocess.DEVNULL)

        text = await trio.to_thread.run_sync(run)
        assert text.returncode == 0, text.stderr
        assert text.stdout.startswith(f"node     {a.peer_id}") and "members  2" in text.stdout
        assert b.peer_id in text.stdout and "run      none" in text.stdout
        js = await trio.to_thread.run_sync(run, "--json")
        obj = json.loads(js.stdout)
        assert obj["peer_id"] == a.peer_id and {m["peer_id"] for m in obj["members"]} == {a.peer_id, b.peer_id}


# -- a training swarm --------------------------------------------------------------------

TRAIN_ROUNDS = 3
TRAIN_SPEC = f"""
name = "tui"
[model]
preset = "tiny"
[inner]
lr = 3e-3
[round]
time_budget_s = 1.0
max_inner_steps = 50
deadline_s = 10.0
rounds = {TRAIN_ROUNDS}
min_quorum = 2
"""
# The run panel's second row: "round  1/3 training" (the round under way, from 1; "-/3" before the first).
ROUND_RE = re.compile(r"round  (\d+)/" + str(TRAIN_ROUNDS) + r" ([a-z]+)")


def shown_round(text: str) -> int | None:
    m = ROUND_RE.search(text)
    return int(m.group(1)) if m else None


@pytest.mark.timeout(300)  # ~30 s alone; the deadlines below leave room for a machine busy with other tests
@pytest.mark.skipif(shutil.which("tmux") is None, reason="tmux is not installed")
async def test_tui_in_tmux_follows_a_training_run_round_by_round(tmp_path: Path) -> None:
    async with local_swarm(tmp_path, extra_args=["--trust-any"]) as swarm:
        boot = await swarm.start_bootstrap()
        a, b = await swarm.add_workers(2, deadline_s=60)
        suffixes = {a.peer_id[-8:], b.peer_id[-8:]}

        rc_file = tmp_path / "tui.rc"
        cmd = f"{shlex.join([*pcp_command(), 'status', '--connect', a.addr])}; echo $? > {shlex.quote(str(rc_file))}"
        tmux = Tmux()
        screens: list[str] = []  # every screen polled: each must fit 80x24 and hold no traceback

        def seen(predicate: Callable[[str], bool]) -> Callable[[str], bool]:
            def check(text: str) -> bool:
                screens.append(text)
                return predicate(text)
            return check

        try:
            tmux("new-session", "-d", "-s", "tui", "-x", "80", "-y", "24", "-c", str(REPO), cmd)
            await tmux.wait_until(seen(lambda t: all(x in t for x in (*suffixes, "no run", "live"))),
                                  "both members and no run", 60)
            await create_run(swarm, boot.addr, tmp_path, TRAIN_SPEC)

            # (b) a round number, then a higher one: the round advances on screen.
            text = await tmux.wait_until(seen(lambda t: shown_round(t) is not None), "the run's round", 120)
            first = shown_round(text)
            assert first is not None and "tui …" in text  # the run is named by its spec, not "bafkrei..."
            text = await tmux.wait_until(seen(lambda t: (shown_round(t) or -1) > first), f"a round after {first}", 120)

            # A committed round: participants against quorum, both losses, the chart's round range.
            text = await tmux.wait_until(seen(lambda t: "quorum 2/2 ✓" in t and re.search(r"● loss \d\.\d{3}", t)
                                              and re.search(r"○ val \d\.\d{3}", t) and "r1-" in t
                                              and "round└┬" in t),  # the chart's x axis, ticked at rounds
                                         "a committed round with its losses", 120)
            # The shepherd panel names one of the two workers and its term; the swarm marks it.
            holder = re.search(r"holder …(\S{8})", text)
            assert holder and holder.group(1) in suffixes, text
            assert re.search(r"term \d+  lease", text) and "shepherd" in text.split("┌ run")[0], text

            # The run ends: the last round, finished, every round in the chart.
            text = await tmux.wait_until(seen(lambda t: f"round  {TRAIN_ROUNDS}/{TRAIN_ROUNDS} finished" in t
                                              and f"r1-{TRAIN_ROUNDS}" in t), "the run finished", 120)
            # (a) every member is still listed; a finished run has nothing due.
            assert all(x in text for x in suffixes) and "due    -" in text, text

            # While rounds ran, the deadline counted down somewhere along the way.
            assert any(re.search(r"due    \d+s", t) for t in screens)
            in_order = [r for t in screens if (r := shown_round(t)) is not None]
            rounds_seen = sorted(set(in_order))
            assert len(rounds_seen) >= 2 and rounds_seen[-1] == TRAIN_ROUNDS, rounds_seen
            # Rounds count from 1 and only go forward; before the first round the screen says
            # what the node does (compiling, waiting for quorum) rather than "0/3 idle".
            assert rounds_seen[0] >= 1 and in_order == sorted(in_order), in_order
            assert not any(f"round  0/{TRAIN_ROUNDS}" in t or re.search(r"round  \S+ idle", t) for t in screens)
            # (c) every screen fit the terminal and none showed a traceback.
            for t in screens:
                lines = t.splitlines()
                assert len(lines) <= 24 and all(len(line) <= 80 for line in lines), t
                assert "Traceback" not in t, t

            assert await tmux.quit(rc_file) == "0"
        finally:
            tmux.kill()
