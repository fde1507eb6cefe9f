"""Run the wasi-nn guest on an export directory: ``pcp generate --engine wasm``.

The guest (``guest/generate.wasm``) runs in the ``wasmtime`` Python engine
with WASI (its arguments, stdout, stderr and the export directory preopened
read-only as ``/model``) and this package's wasi-nn host
(:class:`~pcp_p2p.export.wasi_nn.WasiNnHost`). The same guest runs unchanged
under a wasi-nn-enabled wasmtime CLI (docs/export.md).
"""

from __future__ import annotations

import tempfile
from pathlib import Path

from pcp_p2p.core.errors import GuestError, InvalidInput
from pcp_p2p.export.bundle import guest_wasm_path, load_export
from pcp_p2p.export.sampling import MASK64
from pcp_p2p.export.wasi_nn import WasiNnHost

GUEST_MODEL_DIR = "/model"
MAX_GUEST_MEMORY = 4 << 30  # all a wasm32 guest can address
MAX_STDERR_LINE = 500


def run_guest(model_dir: Path, args: list[str], *, wasm: Path | None = None) -> str:
    """The guest's stdout for ``args`` with ``model_dir`` as ``/model``; a failure raises one typed error.

    If the guest exits non-zero after the host refused one of its wasi-nn
    calls, the host's typed error is raised (:class:`NoSuchTensor`,
    :class:`CorruptModel`, ...); otherwise :class:`GuestError` with the
    guest's own last stderr line.
    """
    import wasmtime

    engine = wasmtime.Engine()
    module = wasmtime.Module.from_file(engine, str(wasm or guest_wasm_path()))
    linker = wasmtime.Linker(engine)
    linker.define_wasi()
    host = WasiNnHost()
    host.add_to_linker(linker)
    store = wasmtime.Store(engine)
    store.set_limits(memory_size=MAX_GUEST_MEMORY)
    with tempfile.TemporaryDirectory(prefix="pcp-wasm-") as tmp:
        out, err = Path(tmp) / "stdout", Path(tmp) / "stderr"
        wasi = wasmtime.WasiConfig()
        wasi.argv = ["generate.wasm", *args]
        wasi.preopen_dir(str(model_dir), GUEST_MODEL_DIR, False)
        wasi.stdout_file = str(out)
        wasi.stderr_file = str(err)
        store.set_wasi(wasi)
        code = 0
        try:
            instance = linker.instantiate(store, module)
            start = instance.exports(store).get("_start")
            if not isinstance(start, wasmtime.Func):
                raise GuestError("the wasm guest has no _start function (not a WASI command module)")
            start(store)
        except wasmtime.ExitTrap as exc:
            code = exc.code
        except (wasmtime.Trap, wasmtime.WasmtimeError) as exc:
            if host.error is not None:
                raise host.error from exc
            first = (str(exc).strip().splitlines() or ["trap"])[0]
            raise GuestError(f"the wasm guest stopped: {first[:MAX_STDERR_LINE]}") from exc
        if code != 0:
            if host.error is not None:
                raise host.error
            with err.open("rb") as f:  # the guest's last line says why; read only the tail
                f.seek(max(0, f.seek(0, 2) - 8192))
                lines = f.read().decode(errors="replace").strip().splitlines()
            raise GuestError(lines[-1][:MAX_STDERR_LINE] if lines else f"the wasm guest exited with status {code}")
        return out.read_text(encoding="utf-8")


def generate_wasm(export_dir: Path, prompt: str, tokens: int, *, temperature: float = 0.8, seed: int = 0) -> str:
    """``prompt`` continued by ``tokens`` characters, sampled by the guest from a checked export.

    For the same θ, prompt, temperature and seed this is the text
    :func:`pcp_p2p.export.generate.sample_text` gives (the sampler is shared;
    see :mod:`pcp_p2p.export.sampling`).
    """
    from pcp_p2p.export.generate import encode_prompt

    bundle = load_export(export_dir)
    encode_prompt(bundle.tokenizer, prompt)  # the native engine's error for a character the vocabulary lacks
    if "\0" in prompt:
        raise InvalidInput("the wasm engine cannot pass a NUL character in the prompt")
    text = run_guest(export_dir, [
        "--model", GUEST_MODEL_DIR, "--prompt", prompt, "--tokens", str(tokens),
        "--temperature", repr(float(temperature)), "--seed", str(seed & MASK64),
    ])
    return text[:-1] if text.endswith("\n") else text
