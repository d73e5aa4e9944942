"""Served-copy checkpoints (faircast export / verify) on a tiny real transformers model saved in fp32.

The expected bits are always computed independently of the export code: ``fair_cast`` of the master tensor
with ``derive_key(seed, version, name)``, or ``.to(torch.bfloat16)`` for the round-to-nearest control.
"""
from __future__ import annotations

import json
import os
import shutil
import struct
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file

transformers = pytest.importorskip("transformers", reason="tests-core installs transformers; needed for real HF checkpoints")

from faircast_plugins import FairCastConfig, FairCaster, derive_key, fair_cast, sticky_key  # noqa: E402
from faircast_plugins.cli import main as cli_main  # noqa: E402
from faircast_plugins.export import (  # noqa: E402
    MANIFEST,
    STATE_FILE,
    ExportError,
    export_served,
    iter_served,
    read_manifest,
    save_state,
    verify_served,
)

SEED, VERSION = 1234, 7


def _tiny_model(tie: bool):
    config = transformers.Qwen2Config(
        vocab_size=320, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=2,
        num_key_value_heads=1, max_position_embeddings=64, tie_word_embeddings=tie,
    )
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    with torch.no_grad():  # a few "training steps" worth of drift, so norms and biases are not bf16-exact
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 1e-3)
    return model


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory):
    """fp32 checkpoints: single file untied, sharded untied, sharded tied; each with side files."""
    root = tmp_path_factory.mktemp("ckpts")
    out = {}
    for label, tie, shard in (("single", False, None), ("sharded", False, "60KB"), ("tied", True, "60KB")):
        model = _tiny_model(tie)
        path = root / label
        model.save_pretrained(path, **({"max_shard_size": shard} if shard else {}))
        (path / "tokenizer_config.json").write_text('{"model_max_length": 64}')
        torch.save({"not": "copied"}, path / "optimizer.pt")
        out[label] = (path, model)
    return out


def _masters(model):
    """What the trainer holds: named_parameters of the unwrapped model (tied ones once, under the first name)."""
    return {n: p.detach().clone() for n, p in model.named_parameters()}


def _read_all(directory: Path) -> dict:
    tensors = {}
    for f in sorted(directory.glob("*.safetensors")):
        with safe_open(str(f), framework="pt") as h:
            for name in h.keys():
                tensors[name] = h.get_tensor(name)
    return tensors


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(torch.int16)


@pytest.mark.parametrize("label", ["single", "sharded", "tied"])
def test_export_equals_fair_cast_of_every_master(ckpts, tmp_path, label):
    path, model = ckpts[label]
    out = tmp_path / "served"
    manifest = export_served(path, out, seed=SEED, version=VERSION)
    served = _read_all(out)
    masters = _masters(model)
    stored = set(_read_all(path))
    assert set(served) == stored  # same tensors as the input checkpoint (a tied lm_head is not stored)
    assert len(list(out.glob("*.safetensors"))) == len(list(path.glob("*.safetensors")))
    assert (len(list(path.glob("*.safetensors"))) > 1) == (label != "single")
    for name, x in masters.items():
        expected = fair_cast(x, key=derive_key(SEED, VERSION, name))
        assert served[name].dtype == torch.bfloat16
        assert torch.equal(_bits(served[name]), _bits(expected)), name
        assert manifest["tensors"][name]["action"] == "cast"
    assert manifest["seed"] == SEED and manifest["version"] == VERSION and manifest["mode"] == "stochastic"
    assert read_manifest(out)["tensors"] == manifest["tensors"]
    if label == "tied":
        assert "lm_head.weight" not in served and "lm_head.weight" not in masters
    # side files: config/tokenizer copied (config marked bf16), optimizer state and the input index are not
    assert (out / "tokenizer_config.json").read_text() == '{"model_max_length": 64}'
    assert not (out / "optimizer.pt").exists()
    assert json.loads((out / "config.json").read_text())["dtype"] == "bfloat16"
    if label != "single":
        index = json.loads((out / "model.safetensors.index.json").read_text())
        assert set(index["weight_map"]) == stored
        assert index["metadata"]["total_size"] == sum(t.numel() * 2 for t in served.values())


def test_iter_served_matches_export_and_differs_from_nearest(ckpts, tmp_path):
    path, model = ckpts["sharded"]
    served = dict(iter_served(path, seed=SEED, version=VERSION))
    masters = _masters(model)
    changed = total = 0
    for name, x in masters.items():
        assert torch.equal(_bits(served[name]), _bits(fair_cast(x, key=derive_key(SEED, VERSION, name))))
        changed += int((_bits(served[name]) != _bits(x.to(torch.bfloat16))).sum())
        total += x.numel()
    # negative control: stochastic rounding is not round-to-nearest (roughly a quarter of random values round up)
    assert 0.1 < changed / total < 0.5
    # and the copy depends on the version and the seed
    other = dict(iter_served(path, seed=SEED, version=VERSION + 1))
    assert any(not torch.equal(_bits(other[n]), _bits(served[n])) for n in masters)
    other = dict(iter_served(path, seed=SEED + 1, version=VERSION))
    assert any(not torch.equal(_bits(other[n]), _bits(served[n])) for n in masters)


def test_nearest_mode_is_round_to_nearest(ckpts, tmp_path):
    path, model = ckpts["sharded"]
    out = tmp_path / "nearest"
    export_served(path, out, seed=SEED, version=VERSION, mode="nearest")
    served = _read_all(out)
    for name, x in _masters(model).items():
        assert torch.equal(_bits(served[name]), _bits(x.to(torch.bfloat16))), name
    assert verify_served(path, out).ok


def test_sticky_export_and_verify_from_the_cli(ckpts, tmp_path, capsys):
    path, model = ckpts["sharded"]
    out = tmp_path / "sticky"
    args = ["export", "--checkpoint", str(path), "--seed", str(SEED), "--version", str(VERSION), "--mode", "sticky"]
    assert cli_main([*args, "--out", str(out), "--quiet"]) == 0
    assert read_manifest(out)["mode"] == "sticky"
    served = _read_all(out)
    for name, x in _masters(model).items():
        assert torch.equal(_bits(served[name]), _bits(fair_cast(x, key=sticky_key(SEED, name), mode="sticky"))), name
    assert cli_main(["verify", "--checkpoint", str(path), "--served", str(out), "--quiet"]) == 0
    # the copy does not depend on the version (negative control: stochastic's does, see above)
    later = dict(iter_served(path, seed=SEED, version=VERSION + 1000, mode="sticky"))
    assert all(torch.equal(_bits(later[n]), _bits(served[n])) for n in served)
    # the reserved version is refused
    with pytest.raises(SystemExit):
        cli_main([*args[:5], "--version", str(2**64 - 1), "--out", str(tmp_path / "x")])
    assert "invalid _version value" in capsys.readouterr().err


@pytest.mark.parametrize("label", ["sharded", "tied"])
def test_export_loads_with_from_pretrained(ckpts, tmp_path, label):
    path, _ = ckpts[label]
    out = tmp_path / "served"
    export_served(path, out, seed=SEED, version=VERSION)
    served = _read_all(out)
    model = transformers.AutoModelForCausalLM.from_pretrained(out, dtype="auto")
    assert model.dtype == torch.bfloat16
    state = model.state_dict()
    for name, t in served.items():
        assert torch.equal(_bits(state[name]), _bits(t)), name
    if label == "tied":  # the head is the served embedding itself
        assert torch.equal(_bits(model.lm_head.weight), _bits(served["model.embed_tokens.weight"]))
    with torch.no_grad():
        logits = model(torch.tensor([[1, 2, 3, 4]])).logits
    assert logits.dtype == torch.bfloat16 and torch.isfinite(logits.float()).all()


def test_tied_head_stored_twice_is_served_as_the_embedding(ckpts, tmp_path):
    path, model = ckpts["tied"]
    both = tmp_path / "both"
    both.mkdir()
    shutil.copy(path / "config.json", both / "config.json")
    sd = {n: t.contiguous().clone() for n, t in model.state_dict().items()}
    assert torch.equal(sd["lm_head.weight"], sd["model.embed_tokens.weight"])
    save_file(sd, str(both / "model.safetensors"), metadata={"format": "pt"})
    manifest = export_served(both, tmp_path / "out", seed=SEED, version=VERSION)
    served = _read_all(tmp_path / "out")
    embed = fair_cast(sd["model.embed_tokens.weight"], key=derive_key(SEED, VERSION, "model.embed_tokens.weight"))
    assert torch.equal(_bits(served["lm_head.weight"]), _bits(embed))
    assert torch.equal(_bits(served["model.embed_tokens.weight"]), _bits(embed))
    assert manifest["tensors"]["lm_head.weight"]["action"] == "tie:model.embed_tokens.weight"
    assert verify_served(both, tmp_path / "out").ok
    # a "tied" head that differs from every embedding is ambiguous: refused
    sd["lm_head.weight"] = sd["lm_head.weight"] + 1.0
    save_file(sd, str(both / "model.safetensors"), metadata={"format": "pt"})
    with pytest.raises(ExportError, match="ties word embeddings"):
        export_served(both, tmp_path / "out2", seed=SEED, version=VERSION)
    assert not (tmp_path / "out2").exists()


def _flip_bit(file: Path, tensor: str, element: int = 3, bit: int = 0) -> None:
    raw = bytearray(file.read_bytes())
    (hlen,) = struct.unpack("<Q", raw[:8])
    header = json.loads(raw[8:8 + hlen])
    begin = header[tensor]["data_offsets"][0]
    size = {"BF16": 2, "F32": 4}[header[tensor]["dtype"]]
    raw[8 + hlen + begin + element * size + bit // 8] ^= 1 << (bit % 8)  # little-endian element bytes
    file.write_bytes(bytes(raw))


def test_verify_passes_then_catches_one_flipped_bit(ckpts, tmp_path, capsys):
    path, _ = ckpts["sharded"]
    out = tmp_path / "served"
    export_served(path, out, seed=SEED, version=VERSION)
    report = verify_served(path, out)
    assert report.ok and report.checked == report.total == len(_read_all(path))
    assert cli_main(["verify", "--checkpoint", str(path), "--served", str(out), "--quiet"]) == 0
    assert "OK" in capsys.readouterr().out

    victim = "model.layers.1.mlp.up_proj.weight"
    file = out / read_manifest(out)["tensors"][victim]["file"]
    _flip_bit(file, victim)
    report = verify_served(path, out)
    assert not report.ok and report.mismatch == victim
    assert "1 of" in report.detail and "flat index 3" in report.detail and "modified after export" in report.detail
    assert cli_main(["verify", "--checkpoint", str(path), "--served", str(out), "--quiet"]) == 1
    printed = capsys.readouterr().out
    assert "MISMATCH" in printed and victim in printed


def test_verify_names_a_changed_checkpoint(ckpts, tmp_path):
    path, _ = ckpts["single"]
    ckpt = tmp_path / "ckpt"
    shutil.copytree(path, ckpt)
    out = tmp_path / "served"
    export_served(ckpt, out, seed=SEED, version=VERSION)
    victim = "model.norm.weight"
    _flip_bit(ckpt / "model.safetensors", victim, element=0, bit=30)  # an exponent bit: survives any bf16 cast
    report = verify_served(ckpt, out)
    assert not report.ok and report.mismatch == victim and "checkpoint changed" in report.detail


def test_truncated_shard_gives_clear_error_and_no_output(ckpts, tmp_path):
    path, _ = ckpts["sharded"]
    ckpt = tmp_path / "ckpt"
    shutil.copytree(path, ckpt)
    shard = sorted(ckpt.glob("*.safetensors"))[-1]
    with open(shard, "r+b") as f:
        f.truncate(shard.stat().st_size - 100)
    out = tmp_path / "out" / "served"
    with pytest.raises(ExportError, match=rf"{shard.name} is not a readable safetensors file.*truncated"):
        export_served(ckpt, out, seed=SEED, version=VERSION)
    assert not out.exists()
    assert not (tmp_path / "out").exists() or not any((tmp_path / "out").iterdir())
    assert cli_main(["export", "--checkpoint", str(ckpt), "--out", str(out), "--seed", "1", "--version", "0"]) == 2
    assert not out.exists()


def test_failure_mid_export_leaves_no_partial_directory(ckpts, tmp_path):
    path, _ = ckpts["sharded"]
    out = tmp_path / "served"
    seen = []

    def interrupt_after_three(done, total, name):
        seen.append(name)
        if len(seen) == 3:
            raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        export_served(path, out, seed=SEED, version=VERSION, progress=interrupt_after_three)
    assert len(seen) == 3
    assert list(tmp_path.iterdir()) == []  # neither the output nor the hidden temporary directory remains


def test_existing_output_is_refused_unless_overwrite(ckpts, tmp_path):
    path, model = ckpts["single"]
    out = tmp_path / "served"
    export_served(path, out, seed=SEED, version=VERSION, mode="nearest")
    with pytest.raises(ExportError, match="already exists"):
        export_served(path, out, seed=SEED, version=VERSION)
    assert read_manifest(out)["mode"] == "nearest"
    export_served(path, out, seed=SEED, version=VERSION, overwrite=True)
    assert read_manifest(out)["mode"] == "stochastic"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["served"]
    with pytest.raises(ExportError, match="must differ"):
        export_served(path, path, seed=SEED, version=VERSION, overwrite=True)


def test_missing_or_bad_manifest_is_a_clear_error(ckpts, tmp_path, capsys):
    path, _ = ckpts["single"]
    out = tmp_path / "served"
    export_served(path, out, seed=SEED, version=VERSION)
    good = (out / MANIFEST).read_text()
    (out / MANIFEST).unlink()
    with pytest.raises(ExportError, match="no faircast_manifest.json"):
        verify_served(path, out)
    assert cli_main(["verify", "--checkpoint", str(path), "--served", str(out)]) == 2
    assert "no faircast_manifest.json" in capsys.readouterr().err
    (out / MANIFEST).write_text(good[: len(good) // 2])
    with pytest.raises(ExportError, match="cannot read Fair Cast manifest"):
        verify_served(path, out)
    (out / MANIFEST).write_text(json.dumps({**json.loads(good), "format": "something-else"}))
    with pytest.raises(ExportError, match="unknown manifest format"):
        verify_served(path, out)
    broken = json.loads(good)
    del broken["seed"]
    (out / MANIFEST).write_text(json.dumps(broken))
    with pytest.raises(ExportError, match="'seed' must be int"):
        verify_served(path, out)
    extra = json.loads(good)
    extra["tensors"]["model.extra.weight"] = dict(extra["tensors"]["model.norm.weight"])
    (out / MANIFEST).write_text(json.dumps(extra))
    report = verify_served(path, out)
    assert not report.ok and report.mismatch == "model.extra.weight" and "tensor sets differ" in report.detail
    (out / MANIFEST).write_text(good)
    assert verify_served(path, out).ok


def test_dtype_policy(tmp_path):
    torch.manual_seed(1)
    ckpt = tmp_path / "ckpt"
    ckpt.mkdir()
    w = torch.randn(8, 16)
    tensors = {"w": w, "b16": torch.randn(5).to(torch.bfloat16), "steps": torch.arange(6), "mask": torch.rand(4) > 0.5}
    save_file(tensors, str(ckpt / "model.safetensors"), metadata={"format": "pt"})
    manifest = export_served(ckpt, tmp_path / "out", seed=SEED, version=VERSION)
    served = _read_all(tmp_path / "out")
    assert torch.equal(_bits(served["w"]), _bits(fair_cast(w, key=derive_key(SEED, VERSION, "w"))))
    for name in ("b16", "steps", "mask"):  # bf16 and non-floating tensors are copied unchanged
        assert served[name].dtype == tensors[name].dtype and torch.equal(served[name], tensors[name])
        assert manifest["tensors"][name]["action"] == "copy"
    assert verify_served(ckpt, tmp_path / "out").ok
    save_file({"b16": tensors["b16"]}, str(ckpt / "model.safetensors"), metadata={"format": "pt"})
    with pytest.raises(ExportError, match="no fp32 tensors"):
        export_served(ckpt, tmp_path / "out2", seed=SEED, version=VERSION)
    save_file({"w": w, "h": torch.randn(3).half()}, str(ckpt / "model.safetensors"), metadata={"format": "pt"})
    with pytest.raises(ExportError, match=r"h \(F16\).*fp32 checkpoints only"):
        export_served(ckpt, tmp_path / "out2", seed=SEED, version=VERSION)
    assert not (tmp_path / "out2").exists()


def test_not_a_checkpoint_and_bad_arguments(tmp_path, ckpts):
    (tmp_path / "empty").mkdir()
    with pytest.raises(ExportError, match="no model.safetensors"):
        export_served(tmp_path / "empty", tmp_path / "out", seed=SEED, version=VERSION)
    path, _ = ckpts["single"]
    with pytest.raises(ExportError, match="seed and the weight version"):
        export_served(path, tmp_path / "out", seed=SEED)
    with pytest.raises(ExportError, match="unknown Fair Cast mode"):
        export_served(path, tmp_path / "out", seed=SEED, version=1, mode="random")
    with pytest.raises(ExportError, match="error_feedback depends on the run's residuals"):
        export_served(path, tmp_path / "out", seed=SEED, version=1, mode="error_feedback")
    assert not (tmp_path / "out").exists()


def test_cli_export_with_progress(ckpts, tmp_path, capsys):
    path, model = ckpts["sharded"]
    out = tmp_path / "served"
    rc = cli_main(["export", "--checkpoint", str(path), "--seed", str(SEED), "--version", str(VERSION), "--out", str(out)])
    assert rc == 0
    captured = capsys.readouterr()
    assert "export 100%" in captured.err and f"version {VERSION}" in captured.out
    served = _read_all(out)
    for name, x in _masters(model).items():
        assert torch.equal(_bits(served[name]), _bits(fair_cast(x, key=derive_key(SEED, VERSION, name))))


def _train_with_caster(model, config, steps):
    """A stand-in training loop: perturb the masters, cast every version (as each sync does), advance."""
    caster = FairCaster(config)
    params = dict(model.named_parameters())
    served = None
    torch.manual_seed(5)
    for _ in range(steps):
        served = {n: caster.cast(n, p.detach()) for n, p in params.items()}  # the sync at this version
        with torch.no_grad():
            for p in params.values():
                p.add_(torch.randn_like(p) * 3e-4)
        caster.advance({n: p.detach() for n, p in params.items()})
    served = {n: caster.cast(n, p.detach()) for n, p in params.items()}  # the sync after the last step
    return caster, served


@pytest.mark.parametrize("config", [FairCastConfig(enabled=True, mode="error_feedback", seed=SEED),
                                    FairCastConfig(enabled=True, mode="stochastic", seed=SEED, ema_decay=0.9)],
                         ids=["error_feedback", "ema"])
def test_stateful_modes_export_from_the_saved_state(tmp_path, config, capsys):
    model = _tiny_model(tie=False)
    caster, served_live = _train_with_caster(model, config, steps=3)
    ckpt = tmp_path / "ckpt"
    model.save_pretrained(ckpt)
    state_file = save_state(caster, ckpt)
    assert state_file.name == STATE_FILE
    out = tmp_path / "served"
    manifest = export_served(ckpt, out, state=state_file)
    assert manifest["version"] == 3 and manifest["state_sha256"]
    served = _read_all(out)
    rne_differs = 0
    for name, q in served_live.items():
        assert torch.equal(_bits(served[name]), _bits(q)), name
        rne_differs += int((_bits(q) != _bits(dict(model.named_parameters())[name].detach().to(torch.bfloat16))).sum())
    assert rne_differs > 0  # negative control: the served copy is not round-to-nearest of the final master
    assert verify_served(ckpt, out).ok  # finds faircast_state.pt next to the checkpoint
    # an adapter may pass its live caster instead of a file: same bits, and the caster is left as it was
    before = caster.state_dict()["version"]
    live = dict(iter_served(ckpt, state=caster))
    assert all(torch.equal(_bits(live[n]), _bits(q)) for n, q in served_live.items())
    assert caster.version == before == 3
    # a state saved on a GPU run names the triton backend; the export casts with what is here, same bits
    gpu_state = torch.load(state_file, weights_only=True)
    gpu_state["config"]["backend"] = "triton"
    from_gpu = dict(iter_served(ckpt, state=gpu_state))
    assert all(torch.equal(_bits(from_gpu[n]), _bits(q)) for n, q in served_live.items())
    # without the state: error_feedback is refused; an EMA run's copy cannot be derived from the master alone
    if config.mode == "error_feedback":
        with pytest.raises(ExportError, match="pass the Fair Cast state"):
            export_served(ckpt, tmp_path / "x", seed=SEED, version=3, mode="error_feedback")
    else:
        plain = dict(iter_served(ckpt, seed=SEED, version=3))
        assert any(not torch.equal(_bits(plain[n]), _bits(q)) for n, q in served_live.items())
    # CLI: --seed/--version omitted -> the state next to the checkpoint is used
    assert cli_main(["export", "--checkpoint", str(ckpt), "--out", str(tmp_path / "cli"), "--quiet"]) == 0
    assert "using the Fair Cast state" in capsys.readouterr().err
    assert torch.equal(_bits(_read_all(tmp_path / "cli")["lm_head.weight"]), _bits(served["lm_head.weight"]))
    # a state that disagrees with the request is refused
    with pytest.raises(ExportError, match="version=3"):
        export_served(ckpt, tmp_path / "y", state=state_file, version=2)
    # a different state than the export's is refused by verify
    other = torch.load(state_file, weights_only=True)
    if config.mode == "error_feedback":
        other["error_feedback"]["model.norm.weight"]["residual"][0] += 1e-6
    else:
        other["ema"]["model.norm.weight"][0] += 1e-6
    with pytest.raises(ExportError, match="differs from the one the export was made with"):
        verify_served(ckpt, out, state=other)


def test_sharded_error_feedback_state_is_refused(tmp_path):
    model = _tiny_model(tie=False)
    caster = FairCaster(FairCastConfig(enabled=True, mode="error_feedback", seed=SEED))
    for n, p in model.named_parameters():  # a rank holding the second half of every parameter
        flat = p.detach().reshape(-1)
        half = flat.numel() // 2
        caster.cast(n, flat[half:].contiguous(), offset=half)
    caster.advance()
    ckpt = tmp_path / "ckpt"
    model.save_pretrained(ckpt)
    save_state(caster, ckpt)
    with pytest.raises(ExportError, match="is a shard .*full residuals"):
        export_served(ckpt, tmp_path / "out", state=ckpt / STATE_FILE)
    assert not (tmp_path / "out").exists()
    torch.save({"version": 1}, ckpt / STATE_FILE)
    with pytest.raises(ExportError, match="is not a Fair Cast state"):
        export_served(ckpt, tmp_path / "out", state=ckpt / STATE_FILE)
    with pytest.raises(ExportError, match="is not a Fair Cast state"):
        export_served(ckpt, tmp_path / "out", state={"config": {}})
    (ckpt / STATE_FILE).write_bytes(b"not a torch file")
    with pytest.raises(ExportError, match="cannot read Fair Cast state"):
        export_served(ckpt, tmp_path / "out", state=ckpt / STATE_FILE)
    os.remove(ckpt / STATE_FILE)
    with pytest.raises(ExportError, match="does not exist"):
        export_served(ckpt, tmp_path / "out", state=ckpt / STATE_FILE)


def test_bad_device_is_refused(ckpts, tmp_path):
    path, _ = ckpts["single"]
    with pytest.raises(ExportError, match="bad device"):
        export_served(path, tmp_path / "out", seed=SEED, version=VERSION, device="not-a-device")
    if not torch.cuda.is_available():
        with pytest.raises(ExportError, match="no CUDA device"):
            export_served(path, tmp_path / "out", seed=SEED, version=VERSION, device="cuda")
    assert not (tmp_path / "out").exists()


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device: casting on the GPU must give the CPU bits")
def test_cuda_export_equals_cpu_export(ckpts, tmp_path):
    path, _ = ckpts["sharded"]
    export_served(path, tmp_path / "cpu", seed=SEED, version=VERSION)
    export_served(path, tmp_path / "cuda", seed=SEED, version=VERSION, device="cuda")
    cpu, cuda = _read_all(tmp_path / "cpu"), _read_all(tmp_path / "cuda")
    assert cpu.keys() == cuda.keys()
    for name in cpu:
        assert torch.equal(_bits(cpu[name]), _bits(cuda[name])), name
    assert verify_served(path, tmp_path / "cuda", device="cuda").ok


def test_untied_head_is_cast_under_its_own_name(ckpts, tmp_path):
    path, model = ckpts["sharded"]  # untied: lm_head.weight is its own parameter
    served = dict(iter_served(path, seed=SEED, version=VERSION))
    head = dict(model.named_parameters())["lm_head.weight"].detach()
    assert torch.equal(_bits(served["lm_head.weight"]), _bits(fair_cast(head, key=derive_key(SEED, VERSION, "lm_head.weight"))))
    # without config.json nothing says the head is tied: head and embedding are cast independently
    bare = tmp_path / "bare"
    bare.mkdir()
    embed = torch.randn(16, 8)
    save_file({"lm_head.weight": embed.clone(), "model.embed_tokens.weight": embed}, str(bare / "model.safetensors"))
    manifest = export_served(bare, tmp_path / "out", seed=SEED, version=VERSION)
    assert manifest["tensors"]["lm_head.weight"]["action"] == "cast"


# -- per-rank FSDP states (the TRL adapter's faircast_state_rank*.pt) -------------------------------------------------


def _rank_states(mode: str, ema_decay: float, steps: int = 3):
    """Two 'ranks' each casting its dim-0 shard of two parameters for ``steps`` versions (as FSDP's patched cast does),
    saved with their shard layout; and one caster doing the same on the full tensors."""
    torch.manual_seed(0)
    config = FairCastConfig(enabled=True, mode=mode, seed=5, ema_decay=ema_decay, backend="torch")
    shapes = {"a.weight": (6, 4), "b.weight": (5,)}  # b: uneven shards (3 + 2 elements)
    masters = {n: torch.randn(sh) for n, sh in shapes.items()}
    full, ranks = FairCaster(config), [FairCaster(config), FairCaster(config)]
    layout = []
    for r in (0, 1):
        lay = {}
        for n, sh in shapes.items():
            flat = masters[n].reshape(-1)
            rows = (sh[0] + 1) // 2
            row = flat.numel() // sh[0]
            start, stop = r * rows * row, min(flat.numel(), (r + 1) * rows * row)
            lay[n] = [start, stop - start, list(sh)]
        layout.append(lay)

    def shards(r):
        return {n: (off, masters[n].reshape(-1)[off: off + k]) for n, (off, k, _) in layout[r].items()}

    for version in range(steps):
        if version:
            for n in masters:
                masters[n] += 1e-3 * torch.randn(shapes[n])
            full.advance(masters)
            for r in (0, 1):
                ranks[r].advance([(n, t) for n, (_, t) in shards(r).items()])
        expected = {n: full.cast(n, m) for n, m in masters.items()}
        for r in (0, 1):
            for n, (off, t) in shards(r).items():
                ranks[r].cast(n, t, offset=off)
    states = []
    for r in (0, 1):
        state = ranks[r].state_dict()
        state["fsdp"] = {"rank": r, "world_size": 2, "shards": layout[r]}
        states.append(state)
    return states, masters, expected


@pytest.mark.parametrize("mode, ema_decay", [("error_feedback", 0.0), ("stochastic", 0.5), ("sticky", 0.5)],
                         ids=["ef", "ema", "sticky-ema"])
def test_merged_rank_states_export_the_full_served_copy(tmp_path, mode, ema_decay):
    from faircast_plugins.export import merge_rank_states

    states, masters, expected = _rank_states(mode, ema_decay)
    for r, state in enumerate(states):
        torch.save(state, tmp_path / f"faircast_state_rank0000{r}.pt")
    ckpt = tmp_path / "ckpt"
    ckpt.mkdir()
    save_file({n: m.contiguous() for n, m in masters.items()}, ckpt / "model.safetensors")
    export_served(ckpt, tmp_path / "served", state=str(tmp_path / "faircast_state_rank*.pt"))
    with safe_open(tmp_path / "served" / "model.safetensors", "pt") as f:
        for n, q in expected.items():
            assert torch.equal(f.get_tensor(n), q), n
    merged = merge_rank_states(states)
    assert merged["version"] == 2
    section = merged["error_feedback"] if mode == "error_feedback" else merged["ema"]
    assert {n: tuple((v["residual"] if mode == "error_feedback" else v).shape) for n, v in section.items()} == {
        "a.weight": (6, 4), "b.weight": (5,)}


def test_merging_rank_states_refuses_what_does_not_fit():
    from faircast_plugins.export import merge_rank_states

    states, _, _ = _rank_states("error_feedback", 0.0)
    with pytest.raises(ExportError, match="one file per rank"):
        merge_rank_states(states[:1])
    with pytest.raises(ExportError, match="not per-rank Fair Cast states of FSDP shards"):
        merge_rank_states([{k: v for k, v in s.items() if k != "fsdp"} for s in states])
    later, _, _ = _rank_states("error_feedback", 0.0, steps=4)
    with pytest.raises(ExportError, match="disagree on version"):
        merge_rank_states([states[0], later[1]])
    gap = [dict(s, fsdp=dict(s["fsdp"], shards=dict(s["fsdp"]["shards"]))) for s in states]
    off, k, sh = gap[1]["fsdp"]["shards"]["a.weight"]
    gap[1]["fsdp"]["shards"]["a.weight"] = [off - 4, k, sh]  # overlaps rank 0's rows
    with pytest.raises(ExportError, match="overlap"):
        merge_rank_states(gap)
