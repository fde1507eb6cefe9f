"""Issue #17: a model exported to ONNX, sampled from WebAssembly through wasi-nn.

One tiny model is exported once for the module (jax2onnx, checked with ONNX
Runtime); the tests then read it back, compare logits with JAX, generate with
the real guest (``pcp_p2p/export/guest/generate.wasm``) in wasmtime against
the native engine, and feed it the bad inputs the issue names.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from pcp_p2p.compile.model import GPTConfig, forward, init_params
from pcp_p2p.compile.tokenizer import CharTokenizer
from pcp_p2p.core.errors import CorruptModel, GuestError, InvalidInput, ModelMismatch, NoSuchTensor
from pcp_p2p.export.bundle import guest_wasm_path, load_export
from pcp_p2p.export.guest import generate_wasm, run_guest
from pcp_p2p.export.sampling import SplitMix64, exp_det, sample_token

pytestmark = pytest.mark.wasm

ROOT = Path(__file__).resolve().parent.parent
TEXT = "First Citizen:\nBefore we proceed any further, hear me speak.\nROMEO: ô, Juliet!\n"
CFG_ARGS = dict(block_size=16, n_layer=1, n_head=2, n_embd=16)


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> tuple[GPTConfig, dict[str, np.ndarray], CharTokenizer, Path]:
    from pcp_p2p.export.onnx_export import export_onnx

    tokenizer = CharTokenizer.from_text(TEXT)
    cfg = GPTConfig(vocab_size=tokenizer.vocab_size, **CFG_ARGS)  # type: ignore[arg-type]
    theta = init_params(cfg, seed=5)
    theta["wte"] = theta["wte"] * 8.0  # logits a few units apart: samples that depend on the draw
    out = tmp_path_factory.mktemp("export")
    export_onnx(cfg, theta, tokenizer, out, run_id="run-x", theta_cid="theta-y", checkpoint_cid="ckpt-z", round_=3)
    return cfg, theta, tokenizer, out


def copy_of(src: Path, tmp_path: Path) -> Path:
    dst = tmp_path / "export"
    shutil.copytree(src, dst)
    return dst


def one_line(exc: pytest.ExceptionInfo[BaseException]) -> str:
    text = str(exc.value)
    assert text and "\n" not in text
    return text


# --- export ----------------------------------------------------------------------


def test_export_round_trip(model) -> None:  # type: ignore[no-untyped-def]
    cfg, _, tokenizer, out = model
    assert sorted(p.name for p in out.iterdir()) == ["generate.wasm", "manifest.json", "model.onnx", "tokenizer.json"]
    manifest = json.loads((out / "manifest.json").read_text())
    assert manifest["model"] == cfg.to_dict()
    assert (manifest["run_id"], manifest["theta_cid"], manifest["checkpoint_cid"], manifest["round"]) == \
        ("run-x", "theta-y", "ckpt-z", 3)
    model_bytes = (out / "model.onnx").read_bytes()
    assert manifest["onnx"]["sha256"] == hashlib.sha256(model_bytes).hexdigest()
    assert json.loads((out / "tokenizer.json").read_text(encoding="utf-8")) == tokenizer.to_dict()
    assert (out / "generate.wasm").read_bytes() == guest_wasm_path().read_bytes()
    bundle = load_export(out)
    assert bundle.config == cfg and bundle.tokenizer == tokenizer and bundle.model == model_bytes


def test_onnx_logits_match_the_jax_forward(model) -> None:  # type: ignore[no-untyped-def]
    import jax
    import jax.numpy as jnp
    import onnxruntime as ort

    cfg, theta, _, out = model
    fwd = jax.jit(lambda p, idx: forward(cfg, p, idx))
    session = ort.InferenceSession(str(out / "model.onnx"), providers=["CPUExecutionProvider"])
    windows = np.random.default_rng(1).integers(0, cfg.vocab_size, size=(3, 1, cfg.block_size)).astype(np.int32)
    params = {k: jnp.asarray(v) for k, v in theta.items()}
    for window in windows:
        got = session.run(["logits"], {"idx": window.astype(np.float32)})[0]
        want = np.asarray(fwd(params, jnp.asarray(window)))
        assert got.shape == (1, cfg.block_size, cfg.vocab_size)
        assert np.max(np.abs(got - want)) <= 1e-4
        assert np.std(want) > 0.1  # real logits, not a degenerate graph
    assert json.loads((out / "manifest.json").read_text())["onnx"]["max_abs_logit_diff_vs_jax"] <= 1e-4


def test_export_refuses_a_tokenizer_that_does_not_fit(model, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    from pcp_p2p.export.onnx_export import export_onnx

    cfg, theta, _, _ = model
    with pytest.raises(ModelMismatch) as exc:
        export_onnx(cfg, theta, CharTokenizer.from_text("abc"), tmp_path / "x", run_id="r", theta_cid="t")
    assert "3 characters" in one_line(exc) and not (tmp_path / "x").exists()


# --- the sampler both engines share ------------------------------------------------


def test_the_sampler_is_the_documented_rule() -> None:
    assert SplitMix64(0).next_u64() == 0xE220A8397B1DCDAF  # SplitMix64's published first output for seed 0
    rng = SplitMix64(123)
    assert all(0.0 <= rng.uniform() < 1.0 for _ in range(1000))
    for x in (0.0, -1e-9, -0.3, -1.0, -20.5, -699.0):
        assert math.isclose(exp_det(x), math.exp(x), rel_tol=4e-16)
    assert exp_det(-701.0) == 0.0
    logits = [0.5, 3.0, 3.0, -1.0]
    assert sample_token(logits, 0.0, SplitMix64(9)) == 1  # greedy: the first largest
    draws = [sample_token(logits, 1.0, rng) for _ in range(2000)]
    assert {draws.count(i) > 0 for i in (1, 2)} == {True} and draws.count(1) + draws.count(2) > 1800
    with pytest.raises(InvalidInput):  # NaN orders differently in Python and C: refused on both sides
        sample_token([0.0, float("nan")], 1.0, rng)


# --- the wasm guest against the native engine --------------------------------------


@pytest.mark.parametrize("seed,temperature", [(7, 1.0), (0, 0.0)], ids=["sampled", "greedy"])
def test_wasm_generation_equals_native(model, seed: int, temperature: float) -> None:  # type: ignore[no-untyped-def]
    from pcp_p2p.export.generate import sample_text

    cfg, theta, tokenizer, out = model
    prompt = "ROMEO: ô"
    native = sample_text(cfg, theta, tokenizer, prompt, 48, temperature=temperature, seed=seed)
    wasm = generate_wasm(out, prompt, 48, temperature=temperature, seed=seed)
    assert wasm == native
    assert len(native) == len(prompt) + 48 and native.startswith(prompt)
    if temperature > 0:
        assert len(set(native[len(prompt):])) > 3  # sampled, not stuck on one character
        assert generate_wasm(out, prompt, 48, temperature=temperature, seed=seed + 1) != wasm


def _pcp(*args: str) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    return subprocess.run([sys.executable, "-m", "pcp_p2p.cli", *args], capture_output=True, text=True,
                          timeout=120, env=env, stdin=subprocess.DEVNULL)


def test_pcp_generate_runs_an_export_in_the_wasm_engine(model) -> None:  # type: ignore[no-untyped-def]
    _, _, _, out = model
    res = _pcp("generate", "--export", str(out), "--prompt", "ROMEO:", "--tokens", "30", "--seed", "3", "--json")
    assert res.returncode == 0, res.stderr[-2000:]
    got = json.loads(res.stdout)
    assert got["text"] == generate_wasm(out, "ROMEO:", 30, seed=3)
    assert (got["run_id"], got["theta"], got["round"]) == ("run-x", "theta-y", 3)


# --- bad input: one clear line each ------------------------------------------------


def test_a_truncated_model_is_refused(model, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    bad = copy_of(model[3], tmp_path)
    data = (bad / "model.onnx").read_bytes()
    (bad / "model.onnx").write_bytes(data[: len(data) // 2])
    with pytest.raises(CorruptModel) as exc:
        load_export(bad)
    assert "truncated" in one_line(exc)
    res = _pcp("generate", "--export", str(bad), "--tokens", "5")
    errors = [ln for ln in res.stderr.splitlines() if ln.startswith("pcp: error: ")]
    assert res.returncode == 1 and len(errors) == 1 and "truncated" in errors[0], res.stderr[-2000:]
    assert "Traceback" not in res.stderr


def test_a_corrupt_model_is_refused_by_the_manifest_and_by_the_host(model, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    bad = copy_of(model[3], tmp_path)
    (bad / "model.onnx").write_bytes(b"\x08\x07not an onnx model at all" * 64)
    manifest = json.loads((bad / "manifest.json").read_text())
    with pytest.raises(CorruptModel):
        load_export(bad)  # size and sha256 differ from the manifest's
    # The guest given the bytes anyway (no manifest check): the wasi-nn host refuses them.
    with pytest.raises(CorruptModel) as exc:
        run_guest(bad, ["--tokens", "2"])
    assert "not a valid ONNX model" in one_line(exc)
    # Same size and sha256 as the manifest says, but not ONNX: the parse check refuses it.
    (bad / "model.onnx").write_bytes(b"\xff" * 100)
    manifest["onnx"].update(bytes=100, sha256=hashlib.sha256(b"\xff" * 100).hexdigest())
    (bad / "manifest.json").write_text(json.dumps(manifest))
    with pytest.raises(CorruptModel) as exc:
        load_export(bad)
    assert "not an ONNX model" in one_line(exc)


def test_a_tokenizer_that_does_not_match_the_config_is_refused(model, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    bad = copy_of(model[3], tmp_path)
    vocab = model[2].to_dict()["vocab"]
    (bad / "tokenizer.json").write_text(json.dumps({"kind": "char", "vocab": vocab[:-1]}))
    want = f"the tokenizer has {len(vocab) - 1} characters but the model's vocab_size is {len(vocab)}"
    with pytest.raises(ModelMismatch) as exc:
        load_export(bad)
    assert want in one_line(exc)
    with pytest.raises(GuestError) as guest:  # the guest checks too, under any host
        run_guest(bad, ["--tokens", "2"])
    assert one_line(guest) == f"generate.wasm: error: {want}"


def test_a_prompt_outside_the_vocabulary_is_refused(model) -> None:  # type: ignore[no-untyped-def]
    with pytest.raises(InvalidInput) as exc:
        generate_wasm(model[3], "ROMEO: Z", 3)
    assert "'Z'" in one_line(exc)
    with pytest.raises(GuestError) as guest:  # and by the guest itself
        run_guest(model[3], ["--prompt", "Zé", "--tokens", "2"])
    assert one_line(guest) == "generate.wasm: error: character 'Z' is not in the vocabulary"


def _nonexistent_output_guest(model_bytes: bytes, path: Path) -> Path:
    """A WAT guest that loads the model and asks wasi-nn for output #5 (the model has one)."""
    import wasmtime

    data = "".join(f"\\{b:02x}" for b in model_bytes)
    pages = (1024 + len(model_bytes)) // 65536 + 1
    wat = f"""
    (module
      (import "wasi_ephemeral_nn" "load" (func $load (param i32 i32 i32 i32 i32) (result i32)))
      (import "wasi_ephemeral_nn" "init_execution_context" (func $init (param i32 i32) (result i32)))
      (import "wasi_ephemeral_nn" "get_output" (func $get (param i32 i32 i32 i32 i32) (result i32)))
      (import "wasi_snapshot_preview1" "proc_exit" (func $exit (param i32)))
      (memory (export "memory") {pages})
      (data (i32.const 1024) "{data}")
      (func (export "_start")
        (i32.store (i32.const 0) (i32.const 1024))
        (i32.store (i32.const 4) (i32.const {len(model_bytes)}))
        (if (call $load (i32.const 0) (i32.const 1) (i32.const 1) (i32.const 0) (i32.const 8))
          (then (call $exit (i32.const 2))))
        (if (call $init (i32.load (i32.const 8)) (i32.const 12))
          (then (call $exit (i32.const 3))))
        (if (call $get (i32.load (i32.const 12)) (i32.const 5) (i32.const 16) (i32.const 64) (i32.const 80))
          (then (call $exit (i32.const 1))))))
    """
    path.write_bytes(wasmtime.wat2wasm(wat))
    return path


def test_a_guest_asking_for_a_tensor_that_does_not_exist(model, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    out = model[3]
    guest = _nonexistent_output_guest((out / "model.onnx").read_bytes(), tmp_path / "asks-output-5.wasm")
    with pytest.raises(NoSuchTensor) as exc:
        run_guest(out, [], wasm=guest)
    assert one_line(exc) == "the guest asked for output tensor #5, but the model has 1 output(s): logits"


# --- the commands against a swarm (slow: four client nodes join it in turn) ---------


@pytest.mark.slow
@pytest.mark.timeout(600)
async def test_pcp_export_and_generate_engines_against_a_swarm(tmp_path: Path) -> None:
    """``pcp export --run`` / ``--checkpoint`` and ``pcp generate --engine wasm`` = native, over real libp2p."""
    from contextlib import AsyncExitStack

    import trio
    from conftest import TEST_CAPS

    from pcp_p2p.compile.model import preset
    from pcp_p2p.core.identity import Identity
    from pcp_p2p.dht.records import MAX_TTL_S, sign_record
    from pcp_p2p.diloco.algorithm.checkpoint import Checkpoint, encode_checkpoint
    from pcp_p2p.diloco.algorithm.outer import OuterState
    from pcp_p2p.diloco.algorithm.params import pack_tensors
    from pcp_p2p.diloco.protocol.commits import commit_seq
    from pcp_p2p.diloco.protocol.messages import CommitRecord, sign
    from pcp_p2p.diloco.protocol.spec import parse_spec, run_id_of, sign_spec
    from pcp_p2p.node.node import NodeConfig, open_node

    corpus = tmp_path / "corpus.txt"
    corpus.write_text(TEXT * 50, encoding="utf-8")
    tokenizer = CharTokenizer.from_text(TEXT)
    cfg = preset("tiny", vocab_size=tokenizer.vocab_size)
    theta = init_params(cfg, seed=11)
    owner, shepherd = Identity.generate(), Identity.generate()
    signed = sign_spec(parse_spec(f'name = "export"\n[model]\npreset = "tiny"\n[data]\ndataset = "{corpus}"\n'), owner)
    run_id = run_id_of(signed)
    ckpt_bytes, theta_cid = encode_checkpoint(Checkpoint(run_id, 1, OuterState.initial(theta, round=4)))

    def node_cfg(name: str, **kw: object) -> NodeConfig:
        return NodeConfig(tmp_path / name, listen=("/ip4/127.0.0.1/tcp/0",), capabilities=TEST_CAPS,
                          op_timeout=2.0, **kw)  # type: ignore[arg-type]

    async def pcp(*args: str) -> subprocess.CompletedProcess[bytes]:
        env = {**os.environ, "PYTHONPATH": str(ROOT)}
        return await trio.run_process(
            [sys.executable, "-m", "pcp_p2p.cli", *args, "--bootstrap", boot.addrs()[0],
             "--data-dir", str(tmp_path / "cli"), "--timeout", "60"],
            capture_stdout=True, capture_stderr=True, check=False, env=env, stdin=subprocess.DEVNULL)

    async with AsyncExitStack() as stack:
        boot = await stack.enter_async_context(open_node(node_cfg("boot", role="bootstrap")))
        holder = await stack.enter_async_context(open_node(node_cfg("holder", bootstrap=(boot.addrs()[0],))))
        await holder.bootstrapped.wait()
        assert await holder.blobs.publish(pack_tensors(theta)) == theta_cid
        ckpt_cid = await holder.blobs.publish(ckpt_bytes)
        rec = sign(CommitRecord(run_id, 1, 3, 0, "prev", theta_cid, ckpt_cid, (shepherd.peer_id,), 1000, 2.0, None,
                                shepherd.peer_id), shepherd)
        await boot.put_record(sign_record(owner, "run", run_id, signed, ttl_s=MAX_TTL_S))
        await boot.put_record(sign_record(shepherd, "commit", run_id, rec, ttl_s=MAX_TTL_S, seq=commit_seq(rec)))

        for source, out in ((["--run", run_id], tmp_path / "by-run"),
                            (["--checkpoint", ckpt_cid], tmp_path / "by-ckpt")):
            res = await pcp("export", *source, "--format", "onnx", "--out", str(out), "--json")
            assert res.returncode == 0, res.stderr.decode()[-3000:]
            manifest = json.loads(res.stdout)
            assert (manifest["run_id"], manifest["theta_cid"], manifest["checkpoint_cid"], manifest["round"]) == \
                (run_id, theta_cid, ckpt_cid, 4)
            assert manifest["model"] == cfg.to_dict() and load_export(out).tokenizer == tokenizer
        assert (tmp_path / "by-run" / "model.onnx").read_bytes() == (tmp_path / "by-ckpt" / "model.onnx").read_bytes()

        texts = {}
        for engine in ("native", "wasm"):
            res = await pcp("generate", "--run", run_id, "--engine", engine, "--tokens", "40", "--seed", "5", "--json")
            assert res.returncode == 0, res.stderr.decode()[-3000:]
            texts[engine] = json.loads(res.stdout)["text"]
        assert texts["wasm"] == texts["native"] == generate_wasm(tmp_path / "by-run", "ROMEO:", 40, seed=5)


def test_the_commands_refuse_flags_that_do_not_fit(model, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:  # type: ignore[no-untyped-def]
    from pcp_p2p.cli import main

    for argv, want in (
        (["generate", "--tokens", "3"], "needs --run RUN_ID and --bootstrap"),
        (["generate", "--export", str(model[3]), "--engine", "native"], "use --engine wasm"),
        (["generate", "--export", str(tmp_path)], "is not a pcp export: it has no manifest.json"),
        (["generate", "--export", str(model[3]), "--temperature", "nan"], "--temperature must be a finite number"),
    ):
        assert main(argv) == 1
        err = capsys.readouterr().err
        assert err.count("pcp: error:") == 1 and want in err, err
    with pytest.raises(SystemExit) as usage:
        main(["export", "--out", str(tmp_path), "--bootstrap", "/ip4/127.0.0.1/tcp/1"])
    assert usage.value.code == 2 and "--run --checkpoint is required" in capsys.readouterr().err
