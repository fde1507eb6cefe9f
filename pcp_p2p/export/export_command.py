"""``pcp export``: a run's θ, or a checkpoint's, as an ONNX model with its tokenizer and a guest.

``--run RUN_ID`` exports the θ of the run's latest commit; ``--checkpoint CID``
the θ inside that checkpoint blob (its run is named in the checkpoint). Both
are fetched from the swarm and hash-checked like every blob; the model config
and tokenizer come from the run's spec, checked against its owner's signature.
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
from pathlib import Path
from typing import TYPE_CHECKING, TypedDict

from pcp_p2p.core import logs
from pcp_p2p.core.errors import ConfigError
from pcp_p2p.core.identity import default_data_dir
from pcp_p2p.core.shutdown import run_until_signal

if TYPE_CHECKING:
    import numpy as np

    from pcp_p2p.diloco.protocol.spec import RunSpec

FORMATS = ("onnx",)


def register(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    from pcp_p2p.export.generate import DEFAULT_TIMEOUT_S

    p = sub.add_parser(
        "export",
        help="write a run's model as ONNX, with its tokenizer and a wasi-nn guest",
        description="Fetch θ (the run's latest commit, or a checkpoint) from the swarm and write DIR/model.onnx "
        "(the forward pass, checked against JAX with ONNX Runtime), tokenizer.json, manifest.json (model config, "
        "run id, θ CID) and generate.wasm, a WebAssembly guest that samples text through wasi-nn. "
        "`pcp generate --export DIR` runs it here; docs/export.md shows it under the wasmtime CLI.",
    )
    source = p.add_mutually_exclusive_group(required=True)
    source.add_argument("--run", metavar="RUN_ID", help="export the θ of this run's latest commit")
    source.add_argument("--checkpoint", metavar="CID", help="export the θ inside this checkpoint blob")
    p.add_argument("--format", choices=FORMATS, default="onnx", help="the model format (only onnx)")
    p.add_argument("--out", type=Path, required=True, metavar="DIR", help="directory to write (created)")
    p.add_argument("--bootstrap", action="append", required=True, metavar="MULTIADDR",
                   help="a bootstrap server; repeatable")
    p.add_argument("--data-dir", type=Path, default=None, help=f"default {default_data_dir()}")
    p.add_argument("--swarm-key", type=Path, metavar="FILE")
    p.add_argument("--timeout", type=float, default=DEFAULT_TIMEOUT_S, metavar="SECONDS",
                   help=f"overall deadline for finding the run and fetching θ (default {DEFAULT_TIMEOUT_S:g})")
    p.add_argument("--json", action="store_true", help="print the manifest as JSON")
    p.set_defaults(func=_cmd_export)


def _cmd_export(args: argparse.Namespace) -> int:
    if not 0 < args.timeout <= 86_400:
        raise ConfigError("--timeout must be between 0 and 86400 seconds")
    if args.out.exists() and not args.out.is_dir():
        raise ConfigError(f"--out {args.out} exists and is not a directory")
    logs.configure(logging.WARNING)
    spec, theta, ids = run_until_signal(_fetch, args)  # Ctrl+C: a clean stop, exit 130
    from pcp_p2p.compile.model import preset
    from pcp_p2p.diloco.algorithm.data import CharDataset
    from pcp_p2p.export.onnx_export import export_onnx

    tokenizer = CharDataset.load(spec.dataset).tokenizer
    cfg = preset(spec.model, vocab_size=tokenizer.vocab_size)
    manifest = export_onnx(cfg, theta, tokenizer, args.out, **ids)
    if args.json:
        print(json.dumps(manifest))
    else:
        print(f"exported run {ids['run_id']} (θ {ids['theta_cid']}) to {args.out}: model.onnx "
              f"({manifest['onnx']['bytes']} bytes), tokenizer.json, manifest.json, generate.wasm", file=sys.stderr)
        print(args.out)
    return 0


class ExportIds(TypedDict):
    """What the manifest says the exported θ is (:func:`~pcp_p2p.export.onnx_export.export_onnx`'s keywords)."""

    run_id: str
    theta_cid: str
    checkpoint_cid: str | None
    round_: int | None


async def _fetch(args: argparse.Namespace) -> tuple[RunSpec, dict[str, np.ndarray], ExportIds]:
    """``(spec, θ, ids for the manifest)`` from the swarm."""
    from pcp_p2p.core.cid import cid_of
    from pcp_p2p.diloco.algorithm.checkpoint import checkpoint_theta_bytes, decode_checkpoint
    from pcp_p2p.export.generate import _fetch_latest, client_node, fetch_blob, fetch_spec

    if args.run:
        spec, rec, theta = await _fetch_latest(args)
        return spec, theta, {"run_id": args.run, "theta_cid": rec.theta_cid,
                             "checkpoint_cid": rec.checkpoint_cid, "round_": rec.round + 1}
    async with client_node(args) as (node, deadline):
        data = await fetch_blob(node, args.checkpoint, deadline, args.timeout, what=f"checkpoint {args.checkpoint}")
        ckpt = decode_checkpoint(data)
        spec = await fetch_spec(node, ckpt.run_id, deadline, args.timeout)
    return spec, ckpt.state.theta, {"run_id": ckpt.run_id, "theta_cid": cid_of(checkpoint_theta_bytes(data)),
                                    "checkpoint_cid": args.checkpoint, "round_": ckpt.state.round}
