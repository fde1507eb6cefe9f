"""``pcp status`` against a live local swarm: the TUI in a real terminal (tmux), and the pipe path.

tmux gives the TUI a real 80x24 pseudo-terminal and lets the test read the
screen back (``capture-pane``) and type keys (``send-keys``). There is no
event for "the screen now shows X", so the test polls the pane, bounded by a
deadline. Skipped where tmux is not installed; the tmux server runs on a
private socket and is killed in a ``finally``.
"""

from __future__ import annotations

import json
import os
import shlex
import shutil
import subprocess
import uuid
from pathlib import Path

import pytest
import trio

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
        text = ""
        with trio.move_on_after(deadline_s):
            while True:
                text = await trio.to_thread.run_sync(self.screen)
                if all(w in text for w in wanted):
                    return text
                await trio.sleep(0.25)
        raise AssertionError(f"screen never showed {wanted}; it shows:\n{text}")

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

            tmux("send-keys", "-t", "tui", "q")
            with trio.fail_after(15):
                while not (rc_file.exists() and rc_file.read_text().strip()):
                    await trio.sleep(0.1)
            assert rc_file.read_text().strip() == "0"

            # a dumb terminal without colours: plain ASCII, same content
            rc_file.unlink()
            cmd = (f"env TERM=dumb NO_COLOR=1 {shlex.join([*pcp_command(), 'status', '--connect', b.addr])}; "
                   f"echo $? > {shlex.quote(str(rc_file))}")
            tmux("new-session", "-d", "-s", "tui", "-x", "80", "-y", "24", "-c", str(REPO), cmd)
            text = await tmux.wait_for(["+ > swarm", "* " + "~" + b.peer_id[-8:], "live"])
            assert text.isascii()
            tmux("send-keys", "-t", "tui", "q")
            with trio.fail_after(15):
                while not (rc_file.exists() and rc_file.read_text().strip()):
                    await trio.sleep(0.1)
            assert rc_file.read_text().strip() == "0"
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
