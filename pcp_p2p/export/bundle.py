"""An export directory, read back and checked before anything runs it.

``pcp export`` writes::

    model.onnx       the forward pass with θ inside (see :mod:`.onnx_export`)
    tokenizer.json   the character vocabulary, ``CharTokenizer.to_dict()``
    manifest.json    format, model config, run id, θ CID, the model's size and sha256
    generate.wasm    the wasi-nn guest that samples text from it

:func:`load_export` refuses, each with one line, a directory whose model is
truncated or altered (size and sha256 against the manifest; then it must
parse as ONNX with the input and output the manifest names), and one whose
parts do not fit each other (tokenizer against ``vocab_size``, ONNX shapes
against the config). A guest given such a model would otherwise fail deep
inside ONNX Runtime, or worse, sample from the wrong vocabulary.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from importlib import resources
from pathlib import Path
from typing import Any

from pcp_p2p.compile.model import GPTConfig
from pcp_p2p.compile.tokenizer import CharTokenizer
from pcp_p2p.core.errors import ConfigError, CorruptModel, ExportError, ModelMismatch, PcpError

FORMAT = "pcp-onnx-export"
VERSION = 1
MODEL_FILE = "model.onnx"
TOKENIZER_FILE = "tokenizer.json"
MANIFEST_FILE = "manifest.json"
GUEST_FILE = "generate.wasm"
INPUT_NAME = "idx"
OUTPUT_NAME = "logits"
MAX_JSON_BYTES = 4 << 20  # a manifest or char tokenizer is a few KiB; more is not ours


def guest_wasm_path() -> Path:
    """The prebuilt guest shipped inside the package (built by ``guest/build.sh``)."""
    path = Path(str(resources.files("pcp_p2p.export") / "guest" / GUEST_FILE))
    if not path.is_file():
        raise ConfigError(f"the prebuilt wasi-nn guest is missing ({path}); run pcp_p2p/export/guest/build.sh")
    return path


@dataclass(frozen=True)
class ExportBundle:
    """A checked export directory."""

    path: Path
    manifest: dict[str, Any]
    config: GPTConfig
    tokenizer: CharTokenizer
    model: bytes


def _read_json(path: Path, what: str) -> Any:
    try:
        with path.open("rb") as f:
            data = f.read(MAX_JSON_BYTES + 1)
    except FileNotFoundError:
        raise ExportError(f"{path.parent} is not a pcp export: it has no {path.name}") from None
    except OSError as exc:
        raise ExportError(f"cannot read {path}: {exc.strerror or exc}") from exc
    if len(data) > MAX_JSON_BYTES:
        raise ExportError(f"{path} is larger than {MAX_JSON_BYTES} bytes: not a pcp {what}")
    try:
        return json.loads(data)
    except (ValueError, UnicodeDecodeError) as exc:
        raise ExportError(f"{path} is not valid JSON ({what}): {exc}") from exc


def load_export(path: Path) -> ExportBundle:
    """Read and check an export directory (see the module docstring)."""
    manifest = _read_json(path / MANIFEST_FILE, "manifest")
    if not isinstance(manifest, dict) or manifest.get("format") != FORMAT or manifest.get("version") != VERSION:
        raise ExportError(f"{path / MANIFEST_FILE} is not a {FORMAT} v{VERSION} manifest")
    model = manifest.get("model")
    if not isinstance(model, dict):
        raise ExportError(f"{path / MANIFEST_FILE}: bad model config: not a table")
    try:
        config = GPTConfig.from_dict(model)
    except (PcpError, TypeError) as exc:
        raise ExportError(f"{path / MANIFEST_FILE}: bad model config: {exc}") from exc
    try:
        tokenizer = CharTokenizer.from_dict(_read_json(path / TOKENIZER_FILE, "tokenizer"))
    except PcpError as exc:
        if isinstance(exc, ExportError):
            raise
        raise ExportError(f"{path / TOKENIZER_FILE}: {exc}") from exc
    if tokenizer.vocab_size != config.vocab_size:
        raise ModelMismatch(f"{path}: the tokenizer has {tokenizer.vocab_size} characters but the "
                            f"model's vocab_size is {config.vocab_size}")
    onnx_meta = manifest.get("onnx")
    if not isinstance(onnx_meta, dict) or onnx_meta.get("file") != MODEL_FILE:
        raise ExportError(f"{path / MANIFEST_FILE} does not describe {MODEL_FILE}")
    model = _read_model(path / MODEL_FILE, onnx_meta)
    check_model_shapes(model, config, where=str(path / MODEL_FILE))
    return ExportBundle(path, manifest, config, tokenizer, model)


def _read_model(path: Path, meta: dict[str, Any]) -> bytes:
    size, digest = meta.get("bytes"), meta.get("sha256")
    if type(size) is not int or not isinstance(digest, str):
        raise ExportError(f"{path.parent / MANIFEST_FILE} lacks the model's size and sha256")
    try:
        with path.open("rb") as f:
            model = f.read(size + 1)
    except FileNotFoundError:
        raise CorruptModel(f"{path} is missing") from None
    except OSError as exc:
        raise CorruptModel(f"cannot read {path}: {exc.strerror or exc}") from exc
    if len(model) != size:
        more = "more than" if len(model) > size else "only"
        raise CorruptModel(f"{path} is truncated or altered: {more} {min(len(model), size)} of the "
                           f"{size} bytes the manifest names")
    if hashlib.sha256(model).hexdigest() != digest:
        raise CorruptModel(f"{path} is corrupt: its sha256 is not the manifest's")
    return model


def check_model_shapes(model: bytes, config: GPTConfig, *, where: str) -> None:
    """The ONNX graph must take ``idx`` (1, block_size) f32 and give ``logits`` (1, block_size, vocab)."""
    import onnx
    from google.protobuf.message import DecodeError

    try:
        proto = onnx.ModelProto.FromString(model)
    except (DecodeError, ValueError) as exc:
        raise CorruptModel(f"{where} is not an ONNX model: {exc}") from exc

    def dims(value_info: Any) -> tuple[int, ...]:
        return tuple(d.dim_value for d in value_info.type.tensor_type.shape.dim)

    inputs = {i.name: i for i in proto.graph.input}
    outputs = {o.name: o for o in proto.graph.output}
    if INPUT_NAME not in inputs or OUTPUT_NAME not in outputs:
        raise CorruptModel(f"{where} has no {INPUT_NAME!r} input and {OUTPUT_NAME!r} output")
    want_in, want_out = (1, config.block_size), (1, config.block_size, config.vocab_size)
    got_in, got_out = dims(inputs[INPUT_NAME]), dims(outputs[OUTPUT_NAME])
    if got_in != want_in or got_out != want_out:
        raise ModelMismatch(f"{where} maps {got_in} to {got_out}, but the manifest's config needs "
                            f"{want_in} to {want_out}")
