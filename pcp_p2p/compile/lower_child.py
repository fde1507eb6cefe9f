"""``python -m pcp_p2p.compile.lower_child``: lower one program to StableHLO in a child process.

Reads ``{"program": name, "config": GPTConfig, "options": ProgramOptions}`` as
JSON on stdin and writes the StableHLO text to stdout. Why a process of its
own: see :mod:`pcp_p2p.compile.child` (a cancellable build, and tracing that
does not hold the node's GIL).
"""

from __future__ import annotations

import json
import sys


def main() -> int:
    from pcp_p2p.compile.lowering import lower
    from pcp_p2p.compile.model import GPTConfig
    from pcp_p2p.compile.programs import ProgramOptions, build_program

    job = json.loads(sys.stdin.buffer.read())
    program = build_program(job["program"], GPTConfig.from_dict(job["config"]),
                            ProgramOptions.from_dict(job["options"]))
    sys.stdout.write(lower(program))
    sys.stdout.flush()
    return 0


if __name__ == "__main__":
    sys.exit(main())
