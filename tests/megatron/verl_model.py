"""Tiny Hugging Face checkpoints (bf16 safetensors, an offline word-level tokenizer) for verl's Megatron engine tests:
a Llama (GQA 4/2, SwiGLU, untied) and a Qwen3-MoE (4 experts, top 2, q/k norms)."""
from __future__ import annotations

import os


def make(path: str, moe: bool = False, vocab: int = 128) -> str:
    import torch
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import AutoModelForCausalLM, PreTrainedTokenizerFast

    if os.path.exists(os.path.join(path, "model.safetensors")):
        return path
    os.makedirs(path, exist_ok=True)
    common = dict(vocab_size=vocab, hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                  max_position_embeddings=256, tie_word_embeddings=False, bos_token_id=1, eos_token_id=2,
                  pad_token_id=0, torch_dtype="bfloat16")
    if moe:
        from transformers import Qwen3MoeConfig

        config = Qwen3MoeConfig(intermediate_size=128, moe_intermediate_size=48, num_experts=4, num_experts_per_tok=2,
                                decoder_sparse_step=1, head_dim=16, norm_topk_prob=True, **common)
    else:
        from transformers import LlamaConfig

        config = LlamaConfig(intermediate_size=128, **common)
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(config).to(torch.bfloat16).save_pretrained(path, safe_serialization=True)
    words = ["<pad>", "<s>", "</s>", "<unk>"] + [f"w{i}" for i in range(vocab - 4)]
    tokenizer = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.Whitespace()
    PreTrainedTokenizerFast(tokenizer_object=tokenizer, bos_token="<s>", eos_token="</s>", pad_token="<pad>",
                            unk_token="<unk>").save_pretrained(path)
    return path
