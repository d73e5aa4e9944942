"""Hand-written converters that mimic megatron-bridge's ``megatron_to_hf`` for the tiny GPT of tests/megatron (a
test-only stand-in where megatron-bridge is not installed): each takes the full (TP=1) Megatron tensor and returns
``{HF name: tensor}``, as the bridge's QKVMapping, GatedMLPMapping and AutoMapping do at tensor parallelism 1."""
from __future__ import annotations

import re
from typing import Callable, Dict, Optional

import torch


def qkv(heads: int, groups: int, q: str, k: str, v: str) -> Callable:
    """Megatron's fused QKV (per query group: its query heads, then one key and one value head) -> q, k, v."""
    per = heads // groups

    def convert(w: torch.Tensor) -> Dict[str, torch.Tensor]:
        head_dim = w.shape[0] // (groups * (per + 2))
        x = w.reshape(groups, (per + 2) * head_dim, *w.shape[1:])
        rest = w.shape[1:]
        return {q: x[:, : per * head_dim].reshape(heads * head_dim, *rest),
                k: x[:, per * head_dim: (per + 1) * head_dim].reshape(groups * head_dim, *rest),
                v: x[:, (per + 1) * head_dim:].reshape(groups * head_dim, *rest)}

    return convert


def gated(gate: str, up: str) -> Callable:
    """SwiGLU's ``linear_fc1`` = [gate; up] along dim 0."""
    return lambda w: dict(zip((gate, up), torch.chunk(w, 2, dim=0)))


def same(name: str) -> Callable:
    return lambda w: {name: w}


def plus_one(name: str) -> Callable:
    """A zero-centred-norm export (adds 1): arithmetic, to be refused."""
    return lambda w: {name: w + 1}


_LAYER = {
    "input_layernorm.weight": "input_layernorm.weight",
    "pre_mlp_layernorm.weight": "post_attention_layernorm.weight",
    "self_attention.linear_proj.weight": "self_attn.o_proj.weight",
    "mlp.linear_fc2.weight": "mlp.down_proj.weight",
}


def llama_like(heads: int = 4, groups: int = 2, tied: bool = False) -> Callable[[str], Optional[Callable]]:
    """``Megatron name -> converter`` for a Llama-style GPT (local layer spec), as megatron-bridge's LlamaBridge maps it."""

    def lookup(name: str) -> Optional[Callable]:
        if name == "embedding.word_embeddings.weight":
            return same("model.embed_tokens.weight")
        if name == "output_layer.weight" and not tied:
            return same("lm_head.weight")
        if name == "decoder.final_layernorm.weight":
            return same("model.norm.weight")
        m = re.match(r"decoder\.layers\.(\d+)\.(.*)$", name)
        if not m:
            return None
        layer, rest = m.group(1), m.group(2)
        prefix = f"model.layers.{layer}."
        e = re.match(r"mlp\.experts\.local_experts\.(\d+)\.linear_fc([12])\.weight$", rest)  # global expert ids
        if e:
            expert = f"{prefix}mlp.experts.{e.group(1)}."
            return gated(expert + "gate_proj.weight", expert + "up_proj.weight") if e.group(2) == "1" else \
                same(expert + "down_proj.weight")
        if rest == "mlp.router.weight":
            return same(prefix + "mlp.gate.weight")
        if rest == "self_attention.linear_qkv.weight":
            return qkv(heads, groups, *(prefix + f"self_attn.{p}_proj.weight" for p in "qkv"))
        if rest == "mlp.linear_fc1.weight":
            return gated(prefix + "mlp.gate_proj.weight", prefix + "mlp.up_proj.weight")
        return same(prefix + _LAYER[rest]) if rest in _LAYER else None

    return lookup
