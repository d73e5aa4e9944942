"""A tiny random Qwen3 and a byte-level BPE tokenizer trained on the spot: for the demo and the tests, offline.

Shaped for vLLM's CPU attention (head_dim 32) and saved in bf16, the dtype a colocated vLLM engine then serves;
trainers load it as fp32 (their default), so the fp32 masters start exactly on the bf16 grid, as a run that
starts from a released bf16 checkpoint does. Needs ``transformers`` and ``tokenizers``.
"""
from __future__ import annotations

import os

CORPUS = [
    "the cat sat on the mat", "a cat and a dog", "cat cat cat", "the dog ran after the cat",
    "hello world", "numbers 0 1 2 3 4 5 6 7 8 9", "once upon a time there was a cat",
] * 20

PROMPTS = ["the cat", "a dog", "hello", "once upon", "numbers 1", "the mat", "cat and", "world"]


def build_tokenizer(path: str):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=300, special_tokens=["<|endoftext|>", "<|im_start|>", "<|im_end|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tok.train_from_iterator(CORPUS, trainer)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok, eos_token="<|endoftext|>", pad_token="<|endoftext|>", bos_token=None, padding_side="left",
    )
    fast.save_pretrained(path)
    return fast


def build_model(path: str, *, seed: int = 0, hidden: int = 64, layers: int = 2) -> str:
    import torch
    from transformers import Qwen3Config, Qwen3ForCausalLM

    torch.manual_seed(seed)
    config = Qwen3Config(
        vocab_size=320, hidden_size=hidden, intermediate_size=2 * hidden, num_hidden_layers=layers,
        num_attention_heads=hidden // 32, num_key_value_heads=1, head_dim=32, max_position_embeddings=256,
        tie_word_embeddings=False, eos_token_id=0, pad_token_id=0, bos_token_id=None,
    )
    Qwen3ForCausalLM(config).to(torch.bfloat16).save_pretrained(path)
    return path


def build_tiny_model(path: str, **kwargs) -> str:
    """Write tokenizer + model into ``path`` (created if needed) and return it."""
    os.makedirs(path, exist_ok=True)
    tok = build_tokenizer(path)
    assert len(tok) <= 320
    return build_model(path, **kwargs)


def cat_reward(completions, **kwargs):
    """More 'cat' is better, shorter is better: enough signal for a nonzero policy gradient."""
    return [min(c.count("cat"), 4) - 0.01 * len(c) for c in completions]
