"""The ``pcp`` command line.

Each subcommand lives beside the code it drives, in a module that exposes
``register(subparsers)``; this file only lists those modules. Imports are
lazy so ``pcp --help`` and ``pcp node join`` never pay for JAX or the IREE
compiler.
"""

from __future__ import annotations

import argparse
import importlib
import sys

from pcp_p2p import __version__
from pcp_p2p.errors import PcpError

# Modules that each define ``register(subparsers) -> None``; each parser sets
# ``func`` to a callable taking the parsed args and returning an exit code.
COMMAND_MODULES = (
    "pcp_p2p.node.commands",
    "pcp_p2p.node.swarm_command",
    "pcp_p2p.compile.command",
    "pcp_p2p.diloco.command",
    "pcp_p2p.diloco.generate",
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
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    func = getattr(args, "func", None)
    if func is None:
        parser.print_help()
        return 2
    try:
        return int(func(args) or 0)
    except PcpError as exc:
        print(f"pcp: error: {exc}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("pcp: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
