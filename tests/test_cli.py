"""The ``pcp`` command line: help that tells the truth, clean errors, no tracebacks."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from pcp_p2p.cli import build_parser, main
from pcp_p2p.core.identity import Identity

PCP = [sys.executable, "-m", "pcp_p2p.cli"]


def run(*args: str, timeout: float = 60) -> subprocess.CompletedProcess[str]:
    return subprocess.run([*PCP, *args], capture_output=True, text=True, timeout=timeout)


def test_help_lists_the_commands() -> None:
    out = run("--help").stdout
    for cmd in ("node", "bootstrap", "status", "swarm-key"):
        assert cmd in out


@pytest.mark.parametrize("argv", [["node", "join"], ["bootstrap"], ["status"], ["swarm-key"]])
def test_every_subcommand_has_help(argv: list[str]) -> None:
    with pytest.raises(SystemExit) as exc:
        main([*argv, "--help"])
    assert exc.value.code == 0


def test_join_help_documents_the_issue_flags() -> None:
    parser = build_parser()
    node = parser._subparsers._group_actions[0].choices["node"]  # type: ignore[union-attr]  # private, Optional
    text = node._subparsers._group_actions[0].choices["join"].format_help()
    for flag in ("--bootstrap", "--listen", "--data-dir", "--addr-file", "--backend", "--client-mode", "--swarm-key"):
        assert flag in text


def test_status_of_a_dead_node_is_a_clean_error() -> None:
    dead = f"/ip4/127.0.0.1/tcp/1/p2p/{Identity.generate().peer_id}"
    res = run("status", "--json", "--connect", dead, "--timeout", "5")
    assert res.returncode == 1
    assert "pcp: error:" in res.stderr and "Traceback" not in res.stderr


def test_status_with_a_bad_address_is_a_clean_error() -> None:
    res = run("status", "--connect", "not-a-multiaddr")
    assert res.returncode == 1 and "Traceback" not in res.stderr


def test_status_without_a_running_node_says_so(tmp_path: Path) -> None:
    res = run("status", "--data-dir", str(tmp_path))
    assert res.returncode == 1 and "no running node" in res.stderr


def test_join_with_a_bad_bootstrap_address_is_a_clean_error(tmp_path: Path) -> None:
    res = run("node", "join", "--bootstrap", "/ip4/1.2.3.4/tcp/1", "--data-dir", str(tmp_path))
    assert res.returncode == 1 and "/p2p/" in res.stderr and "Traceback" not in res.stderr


def test_swarm_key_file(tmp_path: Path) -> None:
    from pcp_p2p.net.swarm_key import read_swarm_key

    assert run("swarm-key", str(tmp_path / "k")).returncode == 0
    assert len(read_swarm_key(tmp_path / "k")) == 64
    again = run("swarm-key", str(tmp_path / "k"))
    assert again.returncode == 1 and "refusing" in again.stderr


def test_bad_swarm_key_is_a_config_error(tmp_path: Path) -> None:
    from pcp_p2p.core.errors import ConfigError
    from pcp_p2p.net.swarm_key import read_swarm_key

    (tmp_path / "k").write_text("nothex\n")
    with pytest.raises(ConfigError):
        read_swarm_key(tmp_path / "k")


def test_bootstrap_prints_its_full_multiaddr_and_stops_on_sigterm(tmp_path: Path) -> None:
    import signal

    proc = subprocess.Popen(
        [*PCP, "bootstrap", "--listen", "/ip4/127.0.0.1/tcp/0", "--data-dir", str(tmp_path)],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True,
    )
    try:
        assert proc.stdout is not None
        line = proc.stdout.readline().strip()
        assert line.startswith("/ip4/127.0.0.1/tcp/") and "/p2p/12D3KooW" in line
        assert (tmp_path / "node.addr").read_text().strip() == line
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=20) == 0
    finally:
        if proc.poll() is None:
            proc.kill()


def test_bootstrap_config_with_unknown_key_is_refused(tmp_path: Path) -> None:
    (tmp_path / "c.toml").write_text('listen = ["/ip4/127.0.0.1/tcp/0"]\nlisten_port = 3\n')
    res = run("bootstrap", "--config", str(tmp_path / "c.toml"), "--data-dir", str(tmp_path))
    assert res.returncode == 1 and "listen_port" in res.stderr


def test_pcp_id_prints_the_peer_id_of_the_data_dirs_key(tmp_path: Path) -> None:
    first = run("id", "--data-dir", str(tmp_path))
    assert first.returncode == 0 and first.stderr == ""
    peer_id = first.stdout.strip()
    from pcp_p2p.core.identity import load_or_create_identity

    assert peer_id == load_or_create_identity(tmp_path).peer_id  # the key a node there would use
    assert run("id", "--data-dir", str(tmp_path)).stdout.strip() == peer_id  # created once, then read
    assert peer_id != run("id", "--data-dir", str(tmp_path / "other")).stdout.strip()
