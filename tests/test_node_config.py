"""Operators' files: ``--config FILE`` for ``node join`` / ``bootstrap``, and the rotated log file."""

from __future__ import annotations

import argparse
import logging
import logging.handlers
import re
import signal
from collections.abc import Iterator
from pathlib import Path

import pytest
from test_cli_errors import Node

from pcp_p2p.cli import build_parser, main
from pcp_p2p.core import logs
from pcp_p2p.core.errors import ConfigError
from pcp_p2p.node.config_file import add_config_parser, apply_config, file_options, with_config

ROOT = Path(__file__).parent.parent
EXAMPLE = ROOT / "examples" / "node.toml"
BOOTSTRAP_EXAMPLE = ROOT / "bootstrap" / "pcp-bootstrap.toml"
OWNER_A = "12D3KooWOwnerA"
OWNER_B = "12D3KooWOwnerB"


def subparser(*path: str) -> argparse.ArgumentParser:
    parser: argparse.ArgumentParser = build_parser()
    for name in path:
        parser = parser._subparsers._group_actions[0].choices[name]  # type: ignore[union-attr]
    return parser


def parsed(tmp_path: Path, toml: str, *argv: str, command: tuple[str, ...] = ("node", "join")) -> argparse.Namespace:
    """``argv`` parsed by the real CLI parser with ``toml`` as ``--config``, the file applied."""
    path = tmp_path / "node.toml"
    path.write_text(toml)
    args = build_parser().parse_args([*command, "--config", str(path), *argv])
    apply_config(subparser(*command), args)
    return args


def one_error_line(capsys: pytest.CaptureFixture[str], argv: list[str]) -> str:
    """Run the CLI in-process; it must fail with exit 1 and exactly one ``pcp: error:`` line."""
    code = main(argv)
    err = capsys.readouterr().err
    assert code == 1 and "Traceback" not in err, err
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("pcp: error: "), err
    return lines[0]


# -- the example files -------------------------------------------------------------------


def example_keys(text: str) -> set[str]:
    """Keys set or shown commented out (``# key = value``) in an example file."""
    return set(re.findall(r"^(?:# )?([a-z_]+) = ", text, flags=re.MULTILINE))


def uncommented(text: str) -> str:
    return re.sub(r"^# ([a-z_]+ = )", r"\1", text, flags=re.MULTILINE)


def test_example_node_toml_covers_every_flag_and_loads(tmp_path: Path) -> None:
    text = EXAMPLE.read_text()
    assert example_keys(text) == set(file_options(subparser("node", "join"))), \
        "examples/node.toml must show every `pcp node join` option (and no other)"
    args = parsed(tmp_path, text)
    assert args.data_dir == Path("/var/lib/pcp/node") and args.metrics_port == 9100
    assert args.bootstrap == [re.findall(r'^bootstrap = \["(.*)"\]', text, re.MULTILINE)[0]]
    # every commented-out example value is of the right type too
    every = parsed(tmp_path, uncommented(text))
    assert every.trust_any is False and every.client_mode is False and every.log_file == Path("/var/log/pcp/node.log")
    assert every.swarm_key == Path("/etc/pcp/swarm.key") and every.metrics_host == "127.0.0.1"
    assert every.log_file_max_bytes == logs.LOG_FILE_MAX_BYTES and every.log_file_backups == logs.LOG_FILE_BACKUPS


def test_bootstrap_example_loads(tmp_path: Path) -> None:
    args = parsed(tmp_path, uncommented(BOOTSTRAP_EXAMPLE.read_text()), command=("bootstrap",))
    assert args.listen == ["/ip4/0.0.0.0/tcp/4001"] and args.data_dir == Path("/var/lib/pcp/bootstrap")
    assert args.swarm_key == Path("/etc/pcp/swarm.key") and len(args.bootstrap) == 1


def test_help_says_what_the_file_does() -> None:
    for command in (("node", "join"), ("bootstrap",)):
        text = " ".join(subparser(*command).format_help().split())
        assert "--config FILE" in text and "override" in text and "unknown key is an error" in text


# -- precedence and values ----------------------------------------------------------------


FILE = f"""
listen = ["/ip4/0.0.0.0/tcp/4002", "/ip4/0.0.0.0/tcp/4003"]
data_dir = "/srv/pcp"
log_level = "debug"
metrics_port = 9100
client_mode = true
trust = ["{OWNER_A}"]
swarm_key = "keys/swarm.key"
"""


def test_the_file_fills_what_the_command_line_does_not_give(tmp_path: Path) -> None:
    args = parsed(tmp_path, FILE)
    assert args.listen == ["/ip4/0.0.0.0/tcp/4002", "/ip4/0.0.0.0/tcp/4003"]
    assert args.data_dir == Path("/srv/pcp") and args.log_level == "debug" and args.metrics_port == 9100
    assert args.client_mode is True and args.trust == [OWNER_A]
    assert args.swarm_key == tmp_path / "keys" / "swarm.key"  # relative to the file, not the cwd
    assert args.bootstrap == [] and args.backend == "auto"  # not in the file: the flags' defaults


def test_flags_override_the_file_even_when_they_say_the_default(tmp_path: Path) -> None:
    args = parsed(tmp_path, FILE, "--listen", "/ip4/127.0.0.1/tcp/0", "--log-level", "info",
                  "--trust", OWNER_B, "--metrics-port", "9200", "--data-dir", "rel")
    assert args.listen == ["/ip4/127.0.0.1/tcp/0"]  # a repeatable flag replaces the file's list
    assert args.log_level == "info"  # "info" is the default, and was typed: it wins
    assert args.trust == [OWNER_B] and args.metrics_port == 9200
    assert args.data_dir == Path("rel")  # the command line's own relative path stays relative to the cwd
    assert args.client_mode is True  # untouched by the command line: from the file


def test_a_single_string_for_a_repeatable_key(tmp_path: Path) -> None:
    assert parsed(tmp_path, 'bootstrap = "/ip4/1.2.3.4/tcp/1/p2p/x"').bootstrap == ["/ip4/1.2.3.4/tcp/1/p2p/x"]


def test_a_flag_added_later_is_a_file_key_at_once(tmp_path: Path) -> None:
    root = argparse.ArgumentParser(prog="t")
    sub = root.add_subparsers()
    cmd = add_config_parser(sub, "cmd")
    cmd.set_defaults(func=with_config(cmd, lambda a: 0))
    cmd.add_argument("--trust-file", type=Path)  # added after the config machinery, as other parts do
    (tmp_path / "c.toml").write_text('trust_file = "/etc/pcp/trusted"\n')
    args = root.parse_args(["cmd", "--config", str(tmp_path / "c.toml")])
    assert args.func(args) == 0 and args.trust_file == Path("/etc/pcp/trusted")


@pytest.mark.parametrize(("toml", "needle"), [
    ("colour = 3\n", "unknown key 'colour'"),
    ("datadir = '/x'\n", "unknown key 'datadir' (did you mean 'data_dir'?)"),
    ("config = 'other.toml'\n", "unknown key 'config'"),
    ("listen = [\n", "not valid TOML"),
    ("metrics_port = '9100'\n", "metrics_port must be a number (an integer)"),
    ("metrics_port = 91.5\n", "metrics_port must be a number (an integer)"),
    ("log_level = 'loud'\n", "log_level must be one of debug, info, warning, error"),
    ("client_mode = 'yes'\n", "client_mode must be true or false"),
    ("listen = [4002]\n", "listen must be a string"),
    ("data_dir = ['/a', '/b']\n", "data_dir takes one value"),
    ("[bootstrap]\nx = 1\n", "bootstrap must be a string"),
])
def test_bad_files_are_one_error_line_naming_the_file(tmp_path: Path, capsys: pytest.CaptureFixture[str],
                                                     toml: str, needle: str) -> None:
    path = tmp_path / "node.toml"
    path.write_text(toml)
    line = one_error_line(capsys, ["node", "join", "--config", str(path), "--data-dir", str(tmp_path)])
    assert str(path) in line and needle in line, line
    assert not (tmp_path / "identity.key").exists()  # refused before anything started


def test_a_missing_file_is_one_error_line(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    line = one_error_line(capsys, ["bootstrap", "--config", str(tmp_path / "nope.toml")])
    assert f"cannot read config file {tmp_path / 'nope.toml'}: no such file or directory" in line.lower()


def test_a_bad_key_is_refused_even_when_the_flag_overrides_it(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="metrics_port"):
        parsed(tmp_path, "metrics_port = 'x'\n", "--metrics-port", "1")


# -- the log file ---------------------------------------------------------------------------


@pytest.fixture
def root_handlers() -> Iterator[None]:
    """Whatever a test adds to the root logger is removed (and closed) after it."""
    root = logging.getLogger()
    before, level = list(root.handlers), root.level
    yield
    for h in root.handlers:
        if h not in before:
            h.close()
    root.handlers[:] = before
    root.setLevel(level)


def test_the_log_file_rotates_within_its_bounds(tmp_path: Path, root_handlers: None) -> None:
    path = tmp_path / "logs" / "pcp.log"
    logs.log_to_file(path, max_bytes=1024, backups=2)
    logging.getLogger().setLevel(logging.INFO)
    log = logging.getLogger("pcp.test")
    for i in range(200):
        log.info("line %03d %s", i, "x" * 40)
    files = sorted(p.name for p in path.parent.iterdir())
    assert files == ["pcp.log", "pcp.log.1", "pcp.log.2"]  # older ones deleted: at most 1 + 2 files
    assert all((path.parent / f).stat().st_size <= 1024 for f in files)
    assert "line 199" in path.read_text() and "line 000" not in "".join((path.parent / f).read_text() for f in files)
    # a date in every line: the file outlives the day it started
    assert re.match(r"\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d{3} I pcp.test: line", path.read_text())


def test_a_second_log_file_replaces_the_first(tmp_path: Path, root_handlers: None) -> None:
    logs.log_to_file(tmp_path / "a.log")
    logs.log_to_file(tmp_path / "b.log")
    assert [h.baseFilename for h in logging.getLogger().handlers  # type: ignore[attr-defined]
            if isinstance(h, logging.handlers.RotatingFileHandler)] == [str(tmp_path / "b.log")]


@pytest.mark.parametrize(("kwargs", "needle"), [({"max_bytes": 10}, "too small"), ({"backups": 0}, "at least 1")])
def test_unbounded_log_file_settings_are_refused(tmp_path: Path, kwargs: dict[str, int], needle: str) -> None:
    with pytest.raises(ConfigError, match=needle):
        logs.log_to_file(tmp_path / "pcp.log", **kwargs)
    assert not (tmp_path / "pcp.log").exists()


@pytest.mark.timeout(120)
@pytest.mark.parametrize("log_file", ["default", "off"])
def test_a_bootstrap_from_a_config_file_logs_into_its_data_dir(tmp_path: Path, log_file: str) -> None:
    data = tmp_path / "data"
    (tmp_path / "boot.toml").write_text(
        'listen = ["/ip4/127.0.0.1/tcp/0"]\ndata_dir = "data"\naddr_file = "boot.addr"\n'
        f"log_file_max_bytes = 4096\nno_log_file = {'true' if log_file == 'off' else 'false'}\n")
    node = Node("bootstrap", "--config", str(tmp_path / "boot.toml"))
    try:
        assert (tmp_path / "boot.addr").read_text().strip() == node.addr  # relative to the file's directory
        assert (data / "identity.key").exists()
        node.signal(signal.SIGTERM)
        code, _, stderr = node.wait(timeout=30)
    finally:
        node.stop()
    assert code == 0, stderr
    log_path = data / "logs" / "pcp.log"
    if log_file == "off":
        assert not log_path.exists()
        return
    text = log_path.read_text()
    peer_id = node.addr.rsplit("/", 1)[1]
    assert f"node {peer_id} (bootstrap) listening on" in text and "left the swarm" in text
    assert "listening on" in stderr  # stderr keeps getting everything too


def test_a_namespace_from_another_parser_still_lets_flags_win(tmp_path: Path) -> None:
    """apply_config on a namespace no ConfigFileParser made: options off their defaults count as given."""
    (tmp_path / "c.toml").write_text('log_level = "debug"\nmetrics_port = 9100\n')
    args = argparse.Namespace(config=tmp_path / "c.toml", log_level="warning", metrics_port=None)
    parser = argparse.ArgumentParser()
    parser.add_argument("--log-level", default="info")
    parser.add_argument("--metrics-port", type=int)
    apply_config(parser, args)
    assert (args.log_level, args.metrics_port) == ("warning", 9100)


def test_every_kind_of_option_from_a_file(tmp_path: Path) -> None:
    """The kinds of argparse option a command might add later, each from its TOML value."""
    root = argparse.ArgumentParser(prog="t")
    cmd = add_config_parser(root.add_subparsers(), "cmd")
    cmd.add_argument("--quiet", action="store_false", dest="chatty")
    cmd.add_argument("--colour", action=argparse.BooleanOptionalAction, default=True)
    cmd.add_argument("-v", "--verbose", action="count", default=0)
    cmd.add_argument("--sizes", nargs="+", type=int)
    cmd.add_argument("--ratio", type=float, default=1.0)
    (tmp_path / "c.toml").write_text("chatty = true\ncolour = false\nverbose = 2\nsizes = [1, 2]\nratio = 3\n")
    args = root.parse_args(["cmd", "--config", str(tmp_path / "c.toml")])
    apply_config(cmd, args)
    # a key holds the value stored under its name: chatty = true is chatty, whatever flag stores it
    assert (args.chatty, args.colour, args.verbose, args.sizes, args.ratio) == (True, False, 2, [1, 2], 3.0)
    (tmp_path / "c.toml").write_text("chatty = false\n")
    apply_config(cmd, args)
    assert args.chatty is False
    (tmp_path / "c.toml").write_text("verbose = -1\n")
    with pytest.raises(ConfigError, match="verbose must be a count"):
        apply_config(cmd, args)
