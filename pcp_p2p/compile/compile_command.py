"""``pcp compile``: build, sign and write artifacts for a model and a list of targets.

Example::

    pcp compile --model tiny --targets cpu-x86_64-v3,cuda-sm80 --out build/tiny
    pcp compile --model medium --targets all --out build/medium --json

writes ``<program>.<target>.vmfb``, its signed ``<program>.<target>.manifest``
and a readable ``<program>.<target>.json`` for each program and target, printing one line per artifact as it finishes,
then a table (or, with ``--json``, one JSON object per artifact).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import TypedDict

from pcp_p2p.compile.model import PRESETS, preset
from pcp_p2p.compile.programs import PROGRAMS, ProgramOptions
from pcp_p2p.core.errors import ConfigError


class ArtifactRow(TypedDict):
    """One artifact as ``--json`` prints it and the table lists it."""

    program: str
    target: str
    cid: str
    size: int
    compile_s: float
    cached: bool
    artifact: str
    manifest: str


def register(subparsers: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = subparsers.add_parser(
        "compile",
        help="compile the model's programs to signed IREE artifacts",
        description="Lower the model's train/eval/sample programs to StableHLO, compile them "
        "with iree-compile for each target and sign a manifest for every artifact.",
    )
    p.add_argument("--model", default="tiny", choices=sorted(PRESETS), help="model preset")
    p.add_argument("--targets", default="cpu",
                   help="comma-separated target names, 'cpu' (every CPU target) or 'all' "
                   "(default: cpu); see docs/compile.md")
    p.add_argument("--out", type=Path, required=True, help="directory for artifacts and manifests")
    p.add_argument("--programs", default=",".join(PROGRAMS),
                   help=f"comma-separated subset of {','.join(PROGRAMS)} (default: all)")
    p.add_argument("--inner-steps", type=int, default=ProgramOptions.inner_steps,
                   help="H, AdamW steps per train call")
    p.add_argument("--batch", type=int, default=ProgramOptions.batch, help="B, sequences per step")
    p.add_argument("--seq", type=int, default=None, help="T, tokens per sequence (default: block size)")
    p.add_argument("--micro-batch", type=int, default=0,
                   help="M, sequences per forward/backward pass: a step accumulates B/M passes (M divides B; "
                   "default 0: the whole batch at once); see docs/compile.md, memory-aware sizing")
    p.add_argument("--vocab-size", type=int, default=None, help="vocabulary size (default: 65)")
    p.add_argument("--data-dir", type=Path, default=None,
                   help="node data directory (identity key, compile cache)")
    p.add_argument("--no-cache", action="store_true", help="always run the compiler")
    p.add_argument("--json", action="store_true", help="print JSON instead of a table")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from pcp_p2p.compile.cache import ArtifactCache
    from pcp_p2p.compile.pipeline import Artifact, build_artifacts, write_artifact
    from pcp_p2p.compile.targets import parse_targets
    from pcp_p2p.core.identity import default_data_dir, load_or_create_identity

    cfg = preset(args.model, args.vocab_size)
    programs = [p.strip() for p in args.programs.split(",") if p.strip()]
    unknown = [p for p in programs if p not in PROGRAMS]
    if unknown or not programs:
        raise ConfigError(f"unknown programs {unknown}; choose from {', '.join(PROGRAMS)}")
    opts = ProgramOptions(inner_steps=args.inner_steps, batch=args.batch,
                          seq=args.seq if args.seq is not None else cfg.block_size, micro_batch=args.micro_batch)
    targets = parse_targets(args.targets)
    data_dir = args.data_dir or default_data_dir()
    identity = load_or_create_identity(data_dir)
    cache = None if args.no_cache else ArtifactCache.in_data_dir(data_dir)
    progress = sys.stderr

    print(f"compiling {args.model} ({', '.join(programs)}) for {len(targets)} target(s) "
          f"as {identity.peer_id}", file=progress, flush=True)
    rows: list[ArtifactRow] = []
    t_start = time.perf_counter()

    def done(art: Artifact) -> None:
        vmfb_path, manifest_path = write_artifact(args.out, art)
        how = "cached" if art.cached else f"{art.compile_s:5.1f} s"
        print(f"  {art.manifest.program:6} {art.manifest.target:20} {how:>8}  "
              f"{art.manifest.artifact_size:>9,} B  {art.cid}", file=progress, flush=True)
        rows.append({
            "program": art.manifest.program,
            "target": art.manifest.target,
            "cid": art.cid,
            "size": art.manifest.artifact_size,
            "compile_s": round(art.compile_s, 3),
            "cached": art.cached,
            "artifact": str(vmfb_path),
            "manifest": str(manifest_path),
        })

    build_artifacts(args.model, cfg, opts, programs, targets, identity, cache, on_artifact=done)
    if args.json:
        print(json.dumps(rows, indent=1))
    else:
        print(f"{'program':7} {'target':20} {'size':>10} {'compile_s':>9}  cid")
        for r in rows:
            print(f"{r['program']:7} {r['target']:20} {r['size']:>10,} {r['compile_s']:>9.1f}  {r['cid']}")
        print(f"{len(rows)} artifact(s) in {args.out} "
              f"({time.perf_counter() - t_start:.1f} s); signer {identity.peer_id}")
    return 0
