"""The ``pcp`` command line.

Each subcommand lives beside the code it drives, in a module that exposes
``register(subparsers)``; this file only lists those modules. Imports are
lazy so ``pcp --help`` and ``pcp node join`` never pay for JAX or the IREE
compiler.

It is also the one error path of every command: whatever a command raises,
however deep in trio's exception groups, ends as one line
``pcp: error: <what and why>`` on stderr and a conventional exit status
(:func:`exit_code`); ``--debug`` prints the traceback instead.

===========  ==========================================================
exit status  meaning
===========  ==========================================================
0            done (a node stopped by SIGTERM has left cleanly: also 0)
1            an error, explained on the ``pcp: error:`` line
2            a usage error (bad flag or argument), explained by argparse
130, 143     stopped by SIGINT (Ctrl+C) or SIGTERM: 128 + the signal
141          stdout was closed by its reader (``pcp status --json | head``)
===========  ==========================================================
"""

from __future__ import annotations

import argparse
import importlib
import os
import select
import signal
import sys
import traceback

from pcp_p2p import __version__
from pcp_p2p.core.errors import PcpError

EXIT_ERROR = 1
EXIT_USAGE = 2
EXIT_BROKEN_PIPE = 128 + signal.SIGPIPE

# Modules that each define ``register(subparsers) -> None``; each parser sets
# ``func`` to a callable taking the parsed args and returning an exit code.
COMMAND_MODULES = (
    "pcp_p2p.commands.node_commands",
    "pcp_p2p.commands.swarm_command",
    "pcp_p2p.node.doctor",
    "pcp_p2p.compile.compile_command",
    "pcp_p2p.diloco.run.owner_commands",
    "pcp_p2p.export.generate",
    "pcp_p2p.export.export_command",
    "pcp_p2p.testing.sim_command",
)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="pcp",
        description="PCP, the Planetary Compute Protocol: peer-to-peer volunteer training.",
    )
    parser.add_argument("--version", action="version", version=f"pcp {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name in COMMAND_MODULES:
        try:
            module = importlib.import_module(name)
        except ModuleNotFoundError as exc:
            if exc.name != name:
                raise
            continue
        module.register(sub)
    _add_debug_flag(parser, default=False)
    return parser


def _add_debug_flag(parser: argparse.ArgumentParser, *, default: object) -> None:
    """``--debug`` on ``pcp`` and on every subcommand, so it works wherever it is typed.

    Subcommands default to SUPPRESS: a subparser's own default would otherwise
    overwrite ``pcp --debug node join``'s True.
    """
    parser.add_argument("--debug", action="store_true", default=default,
                        help="on error, print the full traceback instead of one line")
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for child in dict.fromkeys(action.choices.values()):
                _add_debug_flag(child, default=argparse.SUPPRESS)


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    func = getattr(args, "func", None)
    if func is None:
        parser.print_help()
        return EXIT_USAGE
    try:
        code = int(func(args) or 0)
        sys.stdout.flush()  # a closed pipe shows here, not in the interpreter's exit
        return code
    except (SystemExit, GeneratorExit):
        raise
    except BaseException as exc:
        return report(exc, debug=args.debug)


def leaves(exc: BaseException) -> list[BaseException]:
    """The exceptions inside ``exc``'s (nested) exception groups, in order; ``[exc]`` if it is not one.

    A failure inside a node's nursery reaches the top wrapped in one group per
    nursery it crossed (trio's strict exception groups).
    """
    if isinstance(exc, BaseExceptionGroup):
        return [leaf for sub in exc.exceptions for leaf in leaves(sub)]
    return [exc]


def primary(exc: BaseException) -> BaseException:
    """The exception that says what went wrong: a stop request first, then ours, then the OS's.

    ``trio.Cancelled`` leaves are the consequence of another failure, never its cause.
    """
    import trio

    found = [e for e in leaves(exc) if not isinstance(e, trio.Cancelled)] or [exc]

    def rank(e: BaseException) -> int:
        if isinstance(e, KeyboardInterrupt):
            return 0
        if isinstance(e, BrokenPipeError) and _stdout_closed():
            return 1
        if isinstance(e, PcpError):
            return 2
        if _cause(e, OSError) is not None:
            return 3
        return 4

    return min(found, key=rank)  # min is stable: the first of the best rank


def _cause(exc: BaseException, kind: type[BaseException]) -> BaseException | None:
    """``exc`` or the first of its causes (``raise ... from``) that is a ``kind``."""
    seen: set[int] = set()
    cur: BaseException | None = exc
    while cur is not None and id(cur) not in seen:
        if isinstance(cur, kind):
            return cur
        seen.add(id(cur))
        cur = cur.__cause__
    return None


def describe(exc: BaseException) -> str:
    """One line saying what failed and why, for ``pcp: error:``."""
    if isinstance(exc, PcpError):
        return " ".join(str(exc).split()) or type(exc).__name__
    detail = " ".join(str(exc).split())
    os_error = _cause(exc, OSError)
    if isinstance(os_error, OSError) and os_error.strerror:
        if os_error is not exc and os_error.strerror in detail:
            return detail  # a wrapper (libp2p's) that already names the cause
        why = os_error.strerror[:1].lower() + os_error.strerror[1:]
        where = [str(f) for f in (os_error.filename, os_error.filename2) if f is not None]
        text = f"cannot use {' -> '.join(where)}: {why}" if where else why
        return f"{detail}: {text}" if os_error is not exc and detail else text
    return f"internal error: {type(exc).__name__}{': ' + detail if detail else ''} (run with --debug for the traceback)"


def exit_code(exc: BaseException) -> int:
    """The exit status for a command that raised ``exc`` (see the module's table)."""
    first = primary(exc)
    if isinstance(first, KeyboardInterrupt):
        return 128 + int(getattr(first, "signum", signal.SIGINT))
    if isinstance(first, BrokenPipeError) and _stdout_closed():
        return EXIT_BROKEN_PIPE
    return EXIT_ERROR


def report(exc: BaseException, *, debug: bool = False) -> int:
    """Print ``exc`` the CLI's way and return the exit status."""
    first = primary(exc)
    code = exit_code(exc)
    if code == EXIT_BROKEN_PIPE:
        _silence_stdout()
        return code
    if debug:
        traceback.print_exception(exc, file=sys.stderr)
    elif isinstance(first, KeyboardInterrupt):
        try:
            name = signal.Signals(code - 128).name
        except ValueError:
            name = f"signal {code - 128}"
        print(f"pcp: stopped by {name}", file=sys.stderr)
    else:
        print(f"pcp: error: {describe(first)}", file=sys.stderr)
    return code


def _stdout_closed() -> bool:
    """True when stdout is a pipe whose reader has gone (``| head`` finished)."""
    try:
        fd = sys.stdout.fileno()
        poller = select.poll()
        poller.register(fd, select.POLLOUT)
        return any(ev & select.POLLERR for _, ev in poller.poll(0))
    except (AttributeError, OSError, ValueError):
        return False


def _silence_stdout() -> None:
    """Point stdout at /dev/null so the interpreter's final flush does not complain again."""
    try:
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        os.close(devnull)
    except (AttributeError, OSError, ValueError):
        pass


if __name__ == "__main__":
    # Run the importable module, not this __main__ copy: commands import
    # pcp_p2p.cli and must see the same objects.
    from pcp_p2p.cli import main as _main

    sys.exit(_main())
