"""Running the ``iree-compile`` command-line compiler, reproducibly.

We call the command-line tool rather than ``iree.compiler.compile_str``:
the Python API adds default flags of its own, and a compile from a *file*
embeds the file's path in the artifact. StableHLO goes in on stdin (``-``)
and the vmfb comes out on stdout, so the output bytes depend only on the
input text, the compiler version and the flag list: the same three give the
same artifact CID on any machine.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import threading
from functools import lru_cache
from pathlib import Path

from pcp_p2p.compile.child import run_child
from pcp_p2p.core.errors import CompileError, CompilerRejected

TOOL = "iree-compile"


@lru_cache(maxsize=1)
def compiler_path() -> str:
    """Where ``iree-compile`` is: next to this Python, in the wheel's tool dir, or on PATH."""
    beside = Path(sys.executable).with_name(TOOL)
    if beside.is_file() and os.access(beside, os.X_OK):
        return str(beside)
    try:
        from iree.compiler.tools.binaries import find_tool

        tool: str = find_tool(TOOL)  # the iree package ships no type information
        return tool
    except Exception:  # not installed, or its own lookup failed
        pass
    found = shutil.which(TOOL)
    if found:
        return found
    raise CompileError(
        f"{TOOL} not found; install the compiler with `pip install -e '.[compile]'`"
    )


@lru_cache(maxsize=1)
def compiler_version() -> str:
    """The compiler's version line, e.g. ``3.13.0rc20261016@89ece87b8985...``."""
    try:
        out = subprocess.run([compiler_path(), "--version"], capture_output=True, text=True,
                             timeout=60, check=True).stdout
    except (OSError, subprocess.SubprocessError) as exc:
        raise CompileError(f"cannot run {TOOL} --version: {exc}") from exc
    for line in out.splitlines():
        line = line.strip()
        if line.startswith("IREE compiler version"):
            # "IREE compiler version 3.13.0rc20261016 @ 89ece87b..." -> "3.13.0rc20261016@89ece87b..."
            return line.removeprefix("IREE compiler version").strip().replace(" @ ", "@")
    raise CompileError(f"unrecognised {TOOL} --version output: {out[:200]!r}")


def run_compiler(
    stablehlo: str, flags: tuple[str, ...], timeout: float = 1800, cancel: threading.Event | None = None
) -> bytes:
    """Compile StableHLO text read from stdin with ``flags``; the vmfb bytes.

    ``cancel``: once set, the compiler process is killed and
    :class:`CompileCancelled` is raised (:func:`~pcp_p2p.compile.child.run_child`).
    Why: a compile runs in a thread, which nothing outside can stop, and a node
    that lost the election kept a core busy for a minute compiling for a term it
    did not hold.
    """
    code, out, err = run_child([compiler_path(), *flags, "-o", "-", "-"], stablehlo.encode(), what=TOOL,
                               timeout=timeout, cancel=cancel, env=_clean_env())
    if code != 0 or not out:
        raise CompilerRejected(f"{TOOL} exited {code}: {_tail(err.decode(errors='replace').strip())}")
    return out


def _clean_env() -> dict[str, str]:
    """The environment minus variables that could change the compiler's output."""
    return {k: v for k, v in os.environ.items() if not k.startswith(("IREE_", "LLVM_"))}


def _tail(text: str, lines: int = 15) -> str:
    parts = text.splitlines()
    return "\n".join(parts[-lines:]) if parts else "(no output)"
