"""Text from a run's latest checkpoint: ``pcp generate``, and the demo's closing sample.

Sampling runs the model's forward pass with ``jax.jit`` on the θ of the latest
commit (fetched by CID and hash-checked like every blob). It needs the compile
extra (JAX), which every node installed by ``make`` has.
"""

from __future__ import annotations

import argparse
import json
import logging
import math
import sys
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np
import trio

from pcp_p2p.compile.model import GPTConfig
from pcp_p2p.compile.tokenizer import CharTokenizer
from pcp_p2p.core import logs
from pcp_p2p.core.errors import ConfigError, InvalidInput, PcpError, PeerTimeout
from pcp_p2p.core.identity import default_data_dir
from pcp_p2p.core.shutdown import run_until_signal
from pcp_p2p.wire.codec import M

if TYPE_CHECKING:
    from pcp_p2p.diloco.protocol.messages import CommitRecord
    from pcp_p2p.diloco.protocol.spec import RunSpec
    from pcp_p2p.node.node import Node

log = logging.getLogger("pcp.generate")

DEFAULT_TIMEOUT_S = 60.0
RETRY_FIRST_S, RETRY_MAX_S = 1.0, 8.0  # back-off between DHT lookups that found nothing
ENGINES = ("native", "wasm")


def sample_text(
    model: str | GPTConfig, theta: dict[str, np.ndarray], tokenizer: CharTokenizer, prompt: str, tokens: int,
    *, temperature: float = 0.8, seed: int = 0,
) -> str:
    """``prompt`` continued by ``tokens`` characters sampled from the model.

    ``model`` is a preset name (its vocabulary resized to the tokenizer's) or a
    whole config. Each step feeds a ``block_size`` window (the context, then
    zero padding the causal model never attends to) and samples from the row
    of the context's last token with :func:`pcp_p2p.export.sampling.sample_token`,
    the rule the WebAssembly guest repeats exactly (``pcp generate --engine wasm``).
    """
    import jax
    import jax.numpy as jnp

    from pcp_p2p.compile.model import forward, preset
    from pcp_p2p.export.sampling import SplitMix64, sample_token

    cfg = model if isinstance(model, GPTConfig) else preset(model, vocab_size=tokenizer.vocab_size)
    ids = encode_prompt(tokenizer, prompt)
    fwd = jax.jit(lambda p, idx: forward(cfg, p, idx))
    params = {k: jnp.asarray(v) for k, v in theta.items()}
    rng = SplitMix64(seed)
    t = cfg.block_size
    for _ in range(tokens):
        ctx = ids[-t:]
        window = np.zeros((1, t), dtype=np.int32)
        window[0, : len(ctx)] = ctx  # causal model: padding after the context is never attended to
        logits = np.asarray(fwd(params, jnp.asarray(window)))[0, len(ctx) - 1]
        ids.append(sample_token(logits.tolist(), temperature, rng))
    return tokenizer.decode(np.asarray(ids, dtype=np.int32))


def encode_prompt(tokenizer: CharTokenizer, prompt: str) -> list[int]:
    """The prompt's token ids (``[0]`` for an empty prompt); characters outside the vocabulary raise."""
    try:
        return [int(i) for i in tokenizer.encode(prompt)] if prompt else [0]
    except PcpError as exc:
        raise InvalidInput(f"the prompt uses characters this run's vocabulary lacks: {exc}") from exc


def register(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = sub.add_parser(
        "generate",
        help="print text sampled from a run's latest checkpoint",
        description="Fetch the latest committed θ of a run from the swarm (hash-checked) and print "
        "text sampled from it. --engine wasm samples with the WebAssembly guest through wasi-nn "
        "(θ exported to ONNX first); --export DIR samples from a `pcp export` directory, offline. "
        "Both engines give the same text for the same seed (docs/export.md).",
    )
    p.add_argument("--bootstrap", action="append", metavar="MULTIADDR", help="a bootstrap server; repeatable")
    p.add_argument("--run", metavar="RUN_ID", help="the run id printed by `pcp run create`")
    p.add_argument("--export", type=Path, metavar="DIR",
                   help="sample from this `pcp export` directory instead of a run (no swarm; wasm engine)")
    p.add_argument("--engine", choices=ENGINES, default=None,
                   help="native: JAX on this machine (default); wasm: the wasi-nn guest in wasmtime, "
                   "ONNX Runtime behind it (the default with --export)")
    p.add_argument("--prompt", default="ROMEO:", help="text to continue (default ROMEO:)")
    p.add_argument("--tokens", type=int, default=200, help="characters to generate (default 200)")
    p.add_argument("--temperature", type=float, default=0.8, help="0 or less: always the likeliest character")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--data-dir", type=Path, default=None, help=f"default {default_data_dir()}")
    p.add_argument("--swarm-key", type=Path, metavar="FILE")
    p.add_argument("--timeout", type=float, default=DEFAULT_TIMEOUT_S, metavar="SECONDS",
                   help="overall deadline for finding the run, its latest commit and θ in the swarm; DHT "
                   f"lookups are retried until then, with progress on stderr (default {DEFAULT_TIMEOUT_S:g})")
    p.add_argument("--json", action="store_true")
    p.set_defaults(func=_cmd_generate)


def _cmd_generate(args: argparse.Namespace) -> int:
    if not 1 <= args.tokens <= 100_000:
        raise ConfigError("--tokens must be between 1 and 100000")
    if not 0 < args.timeout <= 86_400:
        raise ConfigError("--timeout must be between 0 and 86400 seconds")
    if not math.isfinite(args.temperature):
        raise ConfigError("--temperature must be a finite number")
    logs.configure(logging.WARNING)
    if args.export is not None:
        return _generate_from_export(args)
    if not args.run or not args.bootstrap:
        raise ConfigError("pcp generate needs --run RUN_ID and --bootstrap MULTIADDR (or --export DIR)")
    spec, rec, theta = run_until_signal(_fetch_latest, args)  # Ctrl+C: a clean stop, exit 130
    from pcp_p2p.diloco.algorithm.data import CharDataset

    tokenizer = CharDataset.load(spec.dataset).tokenizer
    if args.engine == "wasm":
        import tempfile

        from pcp_p2p.compile.model import preset
        from pcp_p2p.export.guest import generate_wasm
        from pcp_p2p.export.onnx_export import export_onnx

        with tempfile.TemporaryDirectory(prefix="pcp-generate-") as tmp:
            export_onnx(preset(spec.model, vocab_size=tokenizer.vocab_size), theta, tokenizer, Path(tmp),
                        run_id=args.run, theta_cid=rec.theta_cid, checkpoint_cid=rec.checkpoint_cid,
                        round_=rec.round + 1)
            text = generate_wasm(Path(tmp), args.prompt, args.tokens, temperature=args.temperature, seed=args.seed)
    else:
        text = sample_text(spec.model, theta, tokenizer, args.prompt, args.tokens,
                           temperature=args.temperature, seed=args.seed)
    _print_sample(args, text, args.run, rec.round + 1, rec.theta_cid)
    return 0


def _generate_from_export(args: argparse.Namespace) -> int:
    if args.engine == "native":
        raise ConfigError("--export DIR holds an ONNX model, which the native (JAX) engine does not run: "
                          "use --engine wasm")
    if args.run or args.bootstrap:
        raise ConfigError("--export DIR samples offline: give it without --run and --bootstrap")
    from pcp_p2p.export.bundle import load_export
    from pcp_p2p.export.guest import generate_wasm

    manifest = load_export(args.export).manifest
    text = generate_wasm(args.export, args.prompt, args.tokens, temperature=args.temperature, seed=args.seed)
    _print_sample(args, text, manifest.get("run_id"), manifest.get("round"), manifest.get("theta_cid"))
    return 0


def _print_sample(args: argparse.Namespace, text: str, run_id: object, round_: object, theta_cid: object) -> None:
    if args.json:
        print(json.dumps({"run_id": run_id, "round": round_, "theta": theta_cid, "text": text}))
    else:
        print(f"(round {round_}, θ {theta_cid})", file=sys.stderr)
        print(text)


def progress(message: str) -> None:
    """One progress line on stderr (stdout stays the sample, or the JSON)."""
    print(f"pcp: {message} ...", file=sys.stderr, flush=True)


async def lookup(node: Node, kind: str, name: str, want: type[M], deadline: float, *, what: str) -> M | None:
    """The verified ``kind``/``name`` record's payload if it is a ``want``, else None by ``deadline``.

    A busy swarm answers DHT lookups slowly or not at all (a get that reaches
    no holder in time says "nothing"), so a miss is retried with back-off
    until the overall deadline rather than believed at once. A record that
    fails verification counts as a miss: the next lookup may find a good one.
    """
    delay, attempt = RETRY_FIRST_S, 0
    while True:
        attempt += 1
        left = deadline - trio.current_time()
        if left <= 0:
            return None
        progress(f"looking up {what} in the DHT" + (f" (attempt {attempt}, {left:.0f} s left)" if attempt > 1 else ""))
        value = None
        with trio.move_on_after(left):
            try:
                value = await node.get_record(kind, name)
            except PcpError as exc:  # a peer timed out or sent garbage: try again
                log.info("lookup of %s: %s", what, exc)
        if isinstance(value, want):
            return value
        left = deadline - trio.current_time()
        if left <= 0:
            return None
        await trio.sleep(min(delay, left))
        delay = min(delay * 2, RETRY_MAX_S)


@asynccontextmanager
async def client_node(args: argparse.Namespace) -> AsyncIterator[tuple[Node, float]]:
    """A short-lived client node that has joined the swarm, and the command's overall deadline."""
    from pcp_p2p.node.node import NodeConfig, open_node

    config = NodeConfig(
        data_dir=(args.data_dir or default_data_dir()) / "client", listen=("/ip4/0.0.0.0/tcp/0",),
        bootstrap=tuple(args.bootstrap), role="client", swarm_key=args.swarm_key, benchmark_s=0.0,
    )
    deadline = trio.current_time() + args.timeout
    async with open_node(config) as node:
        progress(f"joining the swarm via {len(args.bootstrap)} bootstrap server(s)")
        with trio.move_on_after(max(0.0, deadline - trio.current_time())):
            await node.bootstrapped.wait()
        if not node.bootstrapped.is_set():
            raise PeerTimeout(f"no bootstrap server answered within {args.timeout:g} s "
                              f"(tried {', '.join(args.bootstrap)})")
        yield node, deadline


async def fetch_spec(node: Node, run_id: str, deadline: float, timeout: float) -> RunSpec:
    """The verified spec of ``run_id`` from the DHT (its owner's signature checked)."""
    from pcp_p2p.diloco.protocol.spec import SignedRunSpec, verify_spec

    signed = await lookup(node, "run", run_id, SignedRunSpec, deadline, what=f"run {run_id}")
    if signed is None:
        raise ConfigError(f"no run {run_id} found in the swarm's DHT within {timeout:g} s")
    return verify_spec(signed)


async def fetch_blob(node: Node, cid: str, deadline: float, timeout: float, *, what: str) -> bytes:
    """The bytes of blob ``cid`` (hash-checked by the blob store) by ``deadline``."""
    progress(f"fetching {what}")
    path = None
    with trio.move_on_after(max(0.0, deadline - trio.current_time())):
        path = await node.blobs.fetch(cid, announce=False)
    if path is None:
        raise PeerTimeout(f"could not fetch {what} within {timeout:g} s")
    assert isinstance(path, Path), "a whole blob (no byte range) is fetched into the store"
    return await trio.to_thread.run_sync(path.read_bytes)


async def _fetch_latest(args: argparse.Namespace) -> tuple[RunSpec, CommitRecord, dict[str, np.ndarray]]:
    from pcp_p2p.diloco.algorithm.params import unpack_tensors
    from pcp_p2p.diloco.protocol.messages import CommitRecord

    async with client_node(args) as (node, deadline):
        spec = await fetch_spec(node, args.run, deadline, args.timeout)
        rec = await lookup(node, "commit", args.run, CommitRecord, deadline,
                           what=f"the latest commit of run {args.run}")
        if rec is None:
            raise ConfigError(f"run {args.run} has no committed round in the swarm's DHT "
                              f"(looked for {args.timeout:g} s)")
        data = await fetch_blob(node, rec.theta_cid, deadline, args.timeout,
                                what=f"θ {rec.theta_cid} of round {rec.round + 1}")
        return spec, rec, unpack_tensors(data)
