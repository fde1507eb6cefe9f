"""A run's θ as an ONNX model: the GPT forward pass for sampling, converted by jax2onnx.

Why jax2onnx: it converts the very JAX function the swarm trains
(:func:`pcp_p2p.compile.model.forward`) primitive by primitive, so the ONNX
graph cannot drift from the model the way a second, hand-built graph could.
θ is baked into the graph as initializers.

The graph takes one input, ``idx``: a ``(1, block_size)`` window of token ids
*as float32*, and gives ``logits`` ``(1, block_size, vocab_size)``. Float ids
because wasmtime's wasi-nn ONNX backend feeds only f32 input tensors to the
model (ids below 2**24 are exact in f32); the graph casts them to int32 first.

Every export is checked before it is written: ONNX Runtime's logits for a probe
window must lie within :data:`LOGITS_TOLERANCE` of the JAX forward's.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import shutil
import time
from pathlib import Path
from typing import Any

import numpy as np

from pcp_p2p.compile.model import GPTConfig, forward, param_shapes
from pcp_p2p.compile.tokenizer import CharTokenizer
from pcp_p2p.core.errors import ExportError, ModelMismatch
from pcp_p2p.export.bundle import (
    FORMAT,
    GUEST_FILE,
    INPUT_NAME,
    MANIFEST_FILE,
    MODEL_FILE,
    OUTPUT_NAME,
    TOKENIZER_FILE,
    VERSION,
    guest_wasm_path,
)

log = logging.getLogger("pcp.export")

# Gelu needs opset 20. Opset 20 with IR version 9 (what ONNX 1.15 wrote) loads in ONNX Runtime 1.17 and
# later, which covers the builds wasmtime's wasi-nn ONNX backend links (the ort crate).
OPSET = 20
LOGITS_TOLERANCE = 1e-4

_plugins_ready = False


def _load_jax_plugins() -> None:
    """Register only jax2onnx's plugins for plain JAX primitives.

    By default jax2onnx imports every plugin it ships on first use, including
    its flax and equinox examples, which build and compile models at import
    time: 10-20 s on a laptop, for primitives this model never uses. Importing
    the ``plugins/jax`` tree and marking the registry as loaded takes about 1 s.
    If that private hook ever moves, jax2onnx's own full import still works.
    """
    global _plugins_ready
    if _plugins_ready:
        return
    try:
        from jax2onnx.plugins import plugin_system

        root = Path(plugin_system.__file__).parent / "jax"
        plugin_system._import_tree(root, "jax2onnx.plugins.jax")
        plugin_system._already_imported_plugins = True
    except (ImportError, AttributeError) as exc:  # a jax2onnx other than the pinned one
        log.info("jax2onnx: loading all plugins (%s)", exc)
    _plugins_ready = True


def check_compatible(cfg: GPTConfig, theta: dict[str, np.ndarray], tokenizer: CharTokenizer) -> None:
    """Refuse θ whose tensors, or a tokenizer whose vocabulary, do not fit ``cfg``."""
    if tokenizer.vocab_size != cfg.vocab_size:
        raise ModelMismatch(f"the tokenizer has {tokenizer.vocab_size} characters but the model's "
                            f"vocab_size is {cfg.vocab_size}")
    want = param_shapes(cfg)
    if set(theta) != set(want):
        missing, extra = sorted(set(want) - set(theta)), sorted(set(theta) - set(want))
        raise ModelMismatch(f"θ does not hold this model's tensors (missing {missing[:3]}, extra {extra[:3]})")
    for name, shape in want.items():
        if tuple(theta[name].shape) != shape:
            raise ModelMismatch(f"θ tensor {name} has shape {tuple(theta[name].shape)}, the model wants {shape}")


def onnx_bytes(cfg: GPTConfig, theta: dict[str, np.ndarray]) -> bytes:
    """The serialized ONNX model of ``forward(cfg, θ, idx)`` (see the module docstring)."""
    import jax
    import jax.numpy as jnp
    import onnx
    from jax2onnx import to_onnx

    _load_jax_plugins()
    params = {k: jnp.asarray(np.asarray(v, dtype=np.float32)) for k, v in theta.items()}
    model = to_onnx(
        lambda idx: forward(cfg, params, idx.astype(jnp.int32)),
        inputs=[jax.ShapeDtypeStruct((1, cfg.block_size), jnp.float32)],  # type: ignore[no-untyped-call]  # jax leaves its __init__ unannotated
        model_name="pcp_gpt",
        opset=OPSET,
        input_names=[INPUT_NAME],
        output_names=[OUTPUT_NAME],
    )
    # jax2onnx stamps the newest IR version; the oldest one the opset allows loads in more runtimes.
    model.ir_version = onnx.helper.find_min_ir_version_for(list(model.opset_import))
    onnx.checker.check_model(model)
    return bytes(model.SerializeToString())


def probe_window(cfg: GPTConfig) -> np.ndarray:
    """A fixed ``(1, block_size)`` window that uses many ids (int32)."""
    return ((np.arange(cfg.block_size, dtype=np.int64) * 7 + 3) % cfg.vocab_size).astype(np.int32)[None, :]


def logits_gap(cfg: GPTConfig, theta: dict[str, np.ndarray], model: bytes, window: np.ndarray) -> float:
    """Largest absolute difference between ONNX Runtime's and JAX's logits for ``window``."""
    import jax
    import jax.numpy as jnp
    import onnxruntime as ort

    session = ort.InferenceSession(model, providers=["CPUExecutionProvider"])
    got = session.run([OUTPUT_NAME], {INPUT_NAME: window.astype(np.float32)})[0]
    params = {k: jnp.asarray(v) for k, v in theta.items()}
    want = np.asarray(jax.jit(lambda p, idx: forward(cfg, p, idx))(params, jnp.asarray(window)))  # eager: 5x slower
    if got.shape != want.shape:
        raise ExportError(f"the ONNX model gives logits of shape {got.shape}, JAX {want.shape}")
    return float(np.max(np.abs(got.astype(np.float64) - want.astype(np.float64))))


def export_onnx(
    cfg: GPTConfig, theta: dict[str, np.ndarray], tokenizer: CharTokenizer, out_dir: Path, *,
    run_id: str, theta_cid: str, checkpoint_cid: str | None = None, round_: int | None = None,
) -> dict[str, Any]:
    """Write ``model.onnx``, ``tokenizer.json``, ``manifest.json`` and the guest into ``out_dir``.

    Returns the manifest. Raises :class:`ModelMismatch` before converting
    anything if θ or the tokenizer do not fit ``cfg``, and :class:`ExportError`
    if ONNX Runtime's logits stray beyond :data:`LOGITS_TOLERANCE`.
    """
    check_compatible(cfg, theta, tokenizer)
    started = time.monotonic()
    model = onnx_bytes(cfg, theta)
    gap = logits_gap(cfg, theta, model, probe_window(cfg))
    if not gap <= LOGITS_TOLERANCE:  # also catches NaN
        raise ExportError(f"the ONNX model's logits differ from JAX's by {gap:.3g} (> {LOGITS_TOLERANCE:g})")
    manifest: dict[str, Any] = {
        "format": FORMAT,
        "version": VERSION,
        "model": cfg.to_dict(),
        "run_id": run_id,
        "theta_cid": theta_cid,
        "checkpoint_cid": checkpoint_cid,
        "round": round_,
        "onnx": {
            "file": MODEL_FILE, "opset": OPSET, "input": INPUT_NAME, "output": OUTPUT_NAME,
            "bytes": len(model), "sha256": hashlib.sha256(model).hexdigest(),
            "max_abs_logit_diff_vs_jax": gap,
        },
        "tokenizer": TOKENIZER_FILE,
        "guest": GUEST_FILE,
    }
    out_dir.mkdir(parents=True, exist_ok=True)
    _write(out_dir / MODEL_FILE, model)
    _write(out_dir / TOKENIZER_FILE, (json.dumps(tokenizer.to_dict(), ensure_ascii=False) + "\n").encode())
    shutil.copyfile(guest_wasm_path(), out_dir / GUEST_FILE)
    _write(out_dir / MANIFEST_FILE, (json.dumps(manifest, indent=2, ensure_ascii=False) + "\n").encode())
    log.info("exported %s (%d bytes, logits within %.2g of JAX) in %.1f s",
             out_dir, len(model), gap, time.monotonic() - started)
    return manifest


def _write(path: Path, data: bytes) -> None:
    """Write-then-rename, so a reader never sees half a file under the final name."""
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_bytes(data)
    os.replace(tmp, path)
