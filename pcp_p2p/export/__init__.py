"""Portable inference: a run's model as ONNX, sampled from WebAssembly through wasi-nn.

- :mod:`.onnx_export` writes an export directory (``pcp export``);
- :mod:`.bundle` reads one back and checks it;
- :mod:`.sampling` is the sampler the native and the wasm engines share;
- :mod:`.wasi_nn` is the wasi-nn host for the wasmtime Python engine;
- :mod:`pcp_p2p.export.guest` runs the guest (``pcp generate --engine wasm``);
- :mod:`pcp_p2p.export.export_command` is the ``pcp export`` command;
- :mod:`pcp_p2p.export.generate` is ``pcp generate`` (natively, or through the guest).

See docs/export.md.
"""
