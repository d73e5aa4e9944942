"""A tiny random Qwen2 causal LM and word-level tokenizer, built locally (no network), saved in fp32."""
from __future__ import annotations

import os

VOCAB = 128


def build(path: str, *, tie_word_embeddings: bool = False, moe: bool = False, hidden: int = 64, layers: int = 2,
          dtype: str = "float32") -> str:
    """Qwen2 (or, with ``moe``, Qwen3-MoE with 4 packed experts) saved under ``path``."""
    import torch
    from tokenizers import Tokenizer
    from tokenizers.models import WordLevel
    from tokenizers.pre_tokenizers import Whitespace
    from transformers import PreTrainedTokenizerFast, Qwen2Config, Qwen2ForCausalLM, Qwen3MoeConfig, Qwen3MoeForCausalLM

    if os.path.exists(os.path.join(path, "config.json")):
        return path
    os.makedirs(path, exist_ok=True)
    words = ["<pad>", "<eos>", "<unk>"] + [f"w{i}" for i in range(VOCAB - 3)]
    tok = Tokenizer(WordLevel({w: i for i, w in enumerate(words)}, unk_token="<unk>"))
    tok.pre_tokenizer = Whitespace()
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", eos_token="<eos>", unk_token="<unk>")
    fast.chat_template = "{% for m in messages %}{{ m['content'] }} {% endfor %}"
    fast.save_pretrained(path)
    common = dict(vocab_size=VOCAB, hidden_size=hidden, intermediate_size=2 * hidden, num_hidden_layers=layers,
                  num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=256,
                  tie_word_embeddings=tie_word_embeddings, pad_token_id=0, eos_token_id=1, bos_token_id=1)
    if moe:
        config = Qwen3MoeConfig(**common, head_dim=hidden // 2, moe_intermediate_size=hidden // 2, num_experts=4,
                                num_experts_per_tok=2, decoder_sparse_step=1, mlp_only_layers=[])
        model_cls = Qwen3MoeForCausalLM
    else:
        config, model_cls = Qwen2Config(**common), Qwen2ForCausalLM
    torch.manual_seed(1234)
    model = model_cls(config).to(getattr(torch, dtype))
    model.save_pretrained(path)
    return path
