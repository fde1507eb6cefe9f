"""Options from a TOML ``--config`` file, for commands whose flags an operator keeps in a file.

A command's file keys are its flags' argparse ``dest`` names (``--data-dir`` is
``data_dir``), read from the parser itself, so a flag added later is a file key
at once and nothing is listed twice. Flags given on the command line win over
the file; for a repeatable flag (``--bootstrap``) the command line's list
replaces the file's, it is not merged.

Two halves, because argparse errors must stay usage errors while a bad file
must be one ``pcp: error:`` line (a :class:`ConfigError` raised by the
command, where the CLI's error path is):

- :class:`ConfigFileParser` records which options the command line named
  (argparse itself cannot say whether ``--log-level info`` was typed or is the
  default) in the namespace under :data:`GIVEN`;
- :func:`apply_config` (called by the command, see :func:`with_config`) reads
  the file and fills every option the command line did not name.

Values are TOML's own types: strings for paths and addresses, integers,
booleans for on/off flags (``client_mode = true``: a key holds the value stored
under its name), arrays (or one string) for
repeatable flags. Relative paths are relative to the file's directory, so a
file means the same whatever directory the service starts in.
"""

from __future__ import annotations

import argparse
import difflib
import tomllib
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from pcp_p2p.core.errors import ConfigError

GIVEN = "_given_on_command_line"
# Options that only make sense on the command line: the file itself, help, and --debug
# (which must already hold if reading the file fails).
NOT_IN_FILE = frozenset({"help", "config", "debug", "version"})


class ConfigFileParser(argparse.ArgumentParser):
    """An ArgumentParser that records which of its options the command line gave.

    It parses twice: once as usual, once with every default suppressed, so the
    second namespace holds exactly the options that were typed.
    """

    # One signature for typeshed's three overloads (generic in the namespace type): this
    # parser is only ever handed an argparse.Namespace or none.
    def parse_known_args(  # type: ignore[override]
        self, args: Sequence[str] | None = None, namespace: argparse.Namespace | None = None
    ) -> tuple[argparse.Namespace, list[str]]:
        ns, extras = super().parse_known_args(args, namespace)
        saved = [(action, action.default) for action in self._actions]
        saved_defaults = dict(self._defaults)
        try:
            for action, _ in saved:
                action.default = argparse.SUPPRESS
            self._defaults.clear()
            typed, _ = super().parse_known_args(args, argparse.Namespace())
        finally:
            for action, default in saved:
                action.default = default
            self._defaults.update(saved_defaults)
        setattr(ns, GIVEN, frozenset(vars(typed)))
        return ns, extras


def add_config_parser(
    subparsers: argparse._SubParsersAction[argparse.ArgumentParser], name: str, **kwargs: Any
) -> ConfigFileParser:
    """``subparsers.add_parser(name, **kwargs)``, but a :class:`ConfigFileParser`
    with a ``--config FILE`` option; call :func:`with_config` on its command."""
    saved = subparsers._parser_class
    subparsers._parser_class = ConfigFileParser
    try:
        parser = subparsers.add_parser(name, **kwargs)
    finally:
        subparsers._parser_class = saved
    assert isinstance(parser, ConfigFileParser)
    parser.add_argument("--config", type=Path, metavar="FILE",
                        help="read options from this TOML file: keys are the long flags with '_' for '-' "
                        "(data_dir = \"...\", bootstrap = [\"...\"], client_mode = true; relative paths are "
                        "relative to the file); flags given here override the file's keys; an unknown key is an error")
    return parser


def with_config(
    parser: argparse.ArgumentParser, func: Callable[[argparse.Namespace], int]
) -> Callable[[argparse.Namespace], int]:
    """``func`` run on the namespace after :func:`apply_config` filled it from ``--config``."""

    def run(args: argparse.Namespace) -> int:
        apply_config(parser, args)
        return func(args)

    run.__doc__ = func.__doc__
    return run


def file_options(parser: argparse.ArgumentParser) -> dict[str, argparse.Action]:
    """The keys a config file for ``parser`` may hold, each with the option it sets."""
    return {
        action.dest: action
        for action in parser._actions
        if action.option_strings and action.dest not in NOT_IN_FILE and action.dest != argparse.SUPPRESS
    }


def load_toml(path: Path) -> dict[str, Any]:
    """The file's table, or a one-line :class:`ConfigError` saying why not."""
    try:
        text = path.read_text(encoding="utf-8")
    except OSError as exc:
        raise ConfigError(f"cannot read config file {path}: {exc.strerror or exc}") from exc
    except UnicodeDecodeError as exc:
        raise ConfigError(f"{path}: not UTF-8 text ({exc.reason})") from exc
    try:
        return tomllib.loads(text)
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError(f"{path}: not valid TOML: {exc}") from exc


def apply_config(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """Fill ``args`` from ``args.config`` for every option the command line did not give."""
    path: Path | None = getattr(args, "config", None)
    if path is None:
        return
    table = load_toml(path)
    options = file_options(parser)
    given = getattr(args, GIVEN, None)
    if given is None:  # not parsed by a ConfigFileParser: an option off its default was given
        given = {dest for dest, action in options.items() if getattr(args, dest, action.default) != action.default}
    values: dict[str, Any] = {}
    for key, value in table.items():
        action = options.get(key)
        if action is None:
            close = difflib.get_close_matches(key, options, n=1)
            hint = f" (did you mean {close[0]!r}?)" if close else f" (known keys: {', '.join(sorted(options))})"
            raise ConfigError(f"{path}: unknown key {key!r}{hint}")
        values[key] = _value(action, value, path, key)
    for key, value in values.items():  # all checked before any is set
        if key not in given:
            setattr(args, key, value)


def _value(action: argparse.Action, value: Any, path: Path, key: str) -> Any:
    """``value`` from the file as ``action`` would have stored it from the command line."""
    where = f"{path}: {key}"
    if isinstance(action, (argparse._StoreConstAction, argparse.BooleanOptionalAction)):  # on/off flags
        if not isinstance(value, bool):
            raise ConfigError(f"{where} must be true or false, not {value!r}")
        if isinstance(action, argparse.BooleanOptionalAction) or isinstance(action.const, bool):
            return value  # store_true / store_false: the key is the value stored under its name
        return action.const if value else action.default  # store_const: "key = true" is the flag given
    if isinstance(action, argparse._CountAction):
        if isinstance(value, bool) or not isinstance(value, int) or value < 0:
            raise ConfigError(f"{where} must be a count (0, 1, 2, ...), not {value!r}")
        return value
    if isinstance(action, argparse._AppendAction) or action.nargs in ("*", "+") or isinstance(action.nargs, int):
        items = [value] if not isinstance(value, list) else value  # one string is a list of one
        return [_one(action, item, path, where) for item in items]
    if action.nargs not in (None, "?"):
        raise ConfigError(f"{where} cannot be set from a file")
    if isinstance(value, (list, dict)):
        raise ConfigError(f"{where} takes one value, not {value!r}")
    return _one(action, value, path, where)


def _one(action: argparse.Action, value: Any, path: Path, where: str) -> Any:
    kind = action.type
    if kind in (int, float):
        if isinstance(value, bool) or not isinstance(value, (int, float)) or (kind is int and isinstance(value, float)):
            raise ConfigError(f"{where} must be a number{' (an integer)' if kind is int else ''}, not {value!r}")
        out: Any = kind(value)
    else:
        if not isinstance(value, str):
            raise ConfigError(f"{where} must be a string, not {value!r}")
        if kind is Path:
            p = Path(value).expanduser()
            out = p if p.is_absolute() else path.parent / p
        elif callable(kind):
            try:
                out = kind(value)
            except (TypeError, ValueError, argparse.ArgumentTypeError) as exc:
                raise ConfigError(f"{where}: {exc}") from exc
        else:
            out = value
    if action.choices is not None and out not in action.choices:
        raise ConfigError(f"{where} must be one of {', '.join(map(str, action.choices))}, not {value!r}")
    return out
