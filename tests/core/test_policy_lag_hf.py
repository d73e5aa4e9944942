"""The policy-lag probe's forwards on transformers models (policy_lag.py): the attention implementation they run
with, the logits they keep, the modules' modes they leave."""
import functools

import pytest
import torch

transformers = pytest.importorskip("transformers")

from faircast_plugins.policy_lag import PolicyLagProbe, widened  # noqa: E402

#: an fp32-refusing stand-in for flash-attn, registered under its own name (AttentionInterface is global)
FLASH = "faircast_test_fp16_bf16_only"
P, C = 5, 6


def _refusing_kernel(query, key, value, attention_mask, query_length, is_causal, target_dtype=None, **kwargs):
    """flash_attn's CUDA kernel, as far as the probe meets it: fp16/bf16 only (its error message); else causal SDPA."""
    from transformers.modeling_flash_attention_utils import fa_peft_integration_check

    q, k, v = fa_peft_integration_check(query, key, value, target_dtype)
    if q.dtype not in (torch.float16, torch.bfloat16):
        raise RuntimeError(f"FlashAttention only support fp16 and bf16 data type (got {q.dtype})")
    k = k.repeat_interleave(q.shape[2] // k.shape[2], dim=2)
    v = v.repeat_interleave(q.shape[2] // v.shape[2], dim=2)
    out = torch.nn.functional.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                                                           is_causal=True)
    return out.transpose(1, 2)


@pytest.fixture
def flash(monkeypatch):
    """HF's own flash_attention_forward (its dtype choice and casts) under the name FLASH, with the kernel above."""
    from transformers import AttentionInterface
    from transformers.integrations import flash_attention

    monkeypatch.setattr(flash_attention, "_flash_attention_forward", _refusing_kernel)
    AttentionInterface.register(FLASH, flash_attention.flash_attention_forward)
    return FLASH


def _qwen2(attn, dtype=torch.float32, vocab=64, layers=2, seed=0):
    from transformers import Qwen2Config, Qwen2ForCausalLM

    config = Qwen2Config(vocab_size=vocab, hidden_size=32, intermediate_size=64, num_hidden_layers=layers,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=4096)
    config._attn_implementation = attn
    torch.manual_seed(seed)
    return Qwen2ForCausalLM(config).to(dtype)


def _batch(vocab=64, prompt=P, completion=C, seqs=2):
    ids = torch.randint(0, vocab, (seqs, prompt + completion), generator=torch.Generator().manual_seed(1))
    ones = torch.ones(seqs, prompt + completion, dtype=torch.long)
    return ids[:, :prompt], ones[:, :prompt], ids[:, prompt:], ones[:, prompt:]


def _rows(model, served, master, batch=None):
    probe = PolicyLagProbe(1, 2)
    probe.measure(model, 0, *(batch or _batch()), served=served, master=master)
    return probe.take()


@pytest.mark.parametrize("weights", ["fp32 params (TRL one process)", "bf16 module weights (DeepSpeed/FSDP views)"])
def test_flash_attention_model_is_measured_with_sdpa_and_put_back(flash, weights):
    """H3: verl and OpenRLHF load the policy with attn_implementation="flash_attention_2", whose kernel takes fp16/bf16
    only: the probe's fp32 forwards run with SDPA (fp32 works in its CUDA kernels) and give the rows of the SDPA
    model; the implementation is put back after."""
    if weights.startswith("fp32"):
        make = lambda attn: _qwen2(attn)  # noqa: E731
        views = lambda model: (lambda p: p.data.bfloat16().float(), lambda p: None)  # noqa: E731
    else:
        make = lambda attn: _qwen2(attn, torch.bfloat16)  # noqa: E731

        def views(model):
            masters = {id(p): p.detach().float() + 1e-3 for p in model.parameters()}
            return widened, lambda p: masters.get(id(p))
    reference = make("sdpa")
    want = _rows(reference, *views(reference))
    model = make(flash)
    got = _rows(model, *views(model))
    assert torch.equal(got, want)
    assert model.config._attn_implementation == flash
    assert all(getattr(m, "config", model.config)._attn_implementation == flash for m in model.modules())


def test_attention_implementation_is_put_back_when_the_forward_raises(flash):
    model = _qwen2(flash)

    def broken(p):
        raise RuntimeError("a view that fails")
    with pytest.raises(RuntimeError, match="a view that fails"):
        _rows(model, broken, lambda p: None)
    assert model.config._attn_implementation == flash


def test_attention_is_switched_on_wrappers_and_sub_configs(flash):
    """The probe is given the HF model or a wrapper around it (FSDP1, DeepSpeed's engine, OpenRLHF's Actor): every
    transformers config inside is switched, sub-configs of composite models (vision + text) too, and put back."""
    from transformers import Qwen2VLConfig

    from faircast_plugins.policy_lag import fp32_attention

    composite = Qwen2VLConfig()
    composite._attn_implementation = flash  # recursive: the text and vision configs too
    holder = torch.nn.Module()
    holder.config = composite
    wrapper = torch.nn.Sequential(torch.nn.Sequential(holder))
    configs = [composite, composite.text_config, composite.vision_config]
    with fp32_attention(wrapper):
        assert [c._attn_implementation for c in configs] == ["sdpa"] * 3
    assert [c._attn_implementation for c in configs] == [flash] * 3


def test_a_model_that_cannot_run_sdpa_is_refused_naming_attn_implementation(flash, monkeypatch):
    from transformers import Qwen2ForCausalLM

    from faircast_plugins.patching import FairCastPatchError

    model = _qwen2(flash)
    monkeypatch.setattr(Qwen2ForCausalLM, "_supports_sdpa", False)
    with pytest.raises(FairCastPatchError, match="attn_implementation"):
        _rows(model, lambda p: p.data.bfloat16().float(), lambda p: None)
    assert model.config._attn_implementation == flash


def test_eager_and_sdpa_models_are_left_as_they_are():
    from faircast_plugins.policy_lag import fp32_attention

    for attn in ("eager", "sdpa"):
        model = _qwen2(attn, layers=1)
        with fp32_attention(model):
            assert model.config._attn_implementation == attn


class _NoKeep(torch.nn.Module):
    """A causal LM whose forward has no ``logits_to_keep`` (logits at every position), around a Qwen2."""

    def __init__(self, inner):
        super().__init__()
        self.inner, self.config = inner, inner.config

    def forward(self, input_ids, attention_mask=None, use_cache=False, position_ids=None):
        return self.inner(input_ids=input_ids, attention_mask=attention_mask, use_cache=use_cache)


@pytest.mark.parametrize("keeps", [True, False], ids=["logits_to_keep", "no logits_to_keep"])
def test_logits_stay_under_the_budget_with_a_prompt_longer_than_the_completion(monkeypatch, keeps):
    """M1: LOGIT_BUDGET bounds the logits of both views: the forward computes only the completion's (+1) positions
    where it takes ``logits_to_keep`` (transformers' causal LMs), and the chunking counts every position it computes
    where it does not; the logits the probe holds are no view of a larger tensor."""
    import faircast_plugins.policy_lag as pl

    vocab, prompt, completion = 512, 48, 16
    model = _qwen2("sdpa", vocab=vocab, layers=1)
    model = model if keeps else _NoKeep(model)
    made, held = [], []
    original_forward, original_logits = type(model).forward, pl._completion_logits

    @functools.wraps(original_forward)  # the signature the probe reads
    def forward(self, *args, **kwargs):
        out = original_forward(self, *args, **kwargs)
        made.append(out.logits.untyped_storage().nbytes())
        return out

    def completion_logits(*args, **kwargs):
        out = original_logits(*args, **kwargs)
        held.append(out.untyped_storage().nbytes())
        return out
    monkeypatch.setattr(type(model), "forward", forward)
    monkeypatch.setattr(pl, "_completion_logits", completion_logits)
    # two whole sequences' logits, both views: four sequences' completions (+1 position) fit
    monkeypatch.setattr(pl, "LOGIT_BUDGET", 8 * 2 * (prompt + completion) * vocab)
    batch = _batch(vocab, prompt, completion, seqs=4)
    probe = PolicyLagProbe(1, 4)
    probe.measure(model, 0, *batch, served=lambda p: p.data.bfloat16().float(), master=lambda p: None)
    assert len(made) == len(held) and len(made) % 2 == 0
    for served, master in zip(made[::2], made[1::2]):  # each forward's logits, the served view's still held
        assert served + master <= pl.LOGIT_BUDGET
    for served, master in zip(held[::2], held[1::2]):
        assert served + master <= pl.LOGIT_BUDGET
    assert len(made) == (2 if keeps else 4)  # all four sequences in one forward per view, or two
    rows = probe.take()
    monkeypatch.setattr(pl, "LOGIT_BUDGET", 1 << 40)
    whole = PolicyLagProbe(1, 4)
    whole.measure(model, 0, *batch, served=lambda p: p.data.bfloat16().float(), master=lambda p: None)
    assert torch.allclose(rows, whole.take(), rtol=1e-9, atol=1e-12)


def test_keeps_logits_reads_the_model_through_its_wrappers():
    """FSDP1 / DDP hand their forward's keyword arguments to ``module``, PEFT to ``get_base_model()``."""
    from faircast_plugins.policy_lag import keeps_logits

    class Wrapper(torch.nn.Module):  # FSDP1's and DDP's shape: forward(*args, **kwargs) -> self.module(...)
        def __init__(self, module):
            super().__init__()
            self.module = module

        def forward(self, *args, **kwargs):
            return self.module(*args, **kwargs)

    class Peft(torch.nn.Module):  # PeftModelForCausalLM's shape: named arguments, the rest handed on
        def __init__(self, model):
            super().__init__()
            self.base = model

        def get_base_model(self):
            return self.base

        def forward(self, input_ids=None, attention_mask=None, **kwargs):
            return self.base(input_ids=input_ids, attention_mask=attention_mask, **kwargs)

    model = _qwen2("sdpa", layers=1)
    assert keeps_logits(model) and keeps_logits(Wrapper(model)) and keeps_logits(Wrapper(Peft(model)))
    assert not keeps_logits(_NoKeep(model)) and not keeps_logits(Wrapper(_NoKeep(model)))
    assert not keeps_logits(Wrapper(torch.nn.Linear(2, 2)))


def test_soft_capped_attention_is_measured_with_eager_not_sdpa(flash):
    """Gemma 2 caps its attention logits (attn_logit_softcapping), which flash-attn and eager apply and transformers'
    SDPA path drops (5.10-5.17: silently; 5.24: it raises): a flash-attention Gemma 2 is measured with eager
    attention, the function it trains (the rows of the eager model), and put back."""
    from transformers import Gemma2Config, Gemma2ForCausalLM

    def gemma2(attn, cap=0.5):
        config = Gemma2Config(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                              num_attention_heads=4, num_key_value_heads=2, head_dim=8, max_position_embeddings=256,
                              attn_logit_softcapping=cap)
        config._attn_implementation = attn
        torch.manual_seed(0)
        model = Gemma2ForCausalLM(config)
        with torch.no_grad():  # attention logits well past the cap: the cap changes the scores
            for name, p in model.named_parameters():
                if "q_proj" in name or "k_proj" in name:
                    p.mul_(30)
        return model

    views = (lambda p: p.data.bfloat16().float(), lambda p: None)
    eager, uncapped, model = _rows(gemma2("eager"), *views), _rows(gemma2("eager", None), *views), gemma2(flash)
    assert not torch.allclose(eager, uncapped, rtol=1e-3)  # the testbed sees the cap
    assert torch.equal(_rows(model, *views), eager)
    assert model.config._attn_implementation == flash
