"""Fixtures for the TRL adapter tests: a tiny random Qwen3 and a locally trained tokenizer, no downloads.

The model is shaped so that vLLM's CPU attention accepts it (head_dim 32) and saved in bf16, the dtype the
colocate vLLM engine then serves; the trainers load it as fp32 (their default), so the masters start on the
bf16 grid.
"""
from __future__ import annotations

import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("VLLM_NO_USAGE_STATS", "1")
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("WANDB_DISABLED", "true")

import pytest
import torch

TINY_TEXT = [
    "the cat sat on the mat", "a cat and a dog", "cat cat cat", "the dog ran after the cat",
    "hello world", "numbers 0 1 2 3 4 5 6 7 8 9", "once upon a time there was a cat",
] * 20


def build_tokenizer(path: str):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    specials = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
    trainer = trainers.BpeTrainer(vocab_size=300, special_tokens=specials,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(TINY_TEXT, trainer)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok, eos_token="<|endoftext|>", pad_token="<|endoftext|>", bos_token=None,
        padding_side="left",
    )
    fast.save_pretrained(path)
    return fast


def build_model(path: str, vocab_size: int):
    from transformers import Qwen3Config, Qwen3ForCausalLM

    torch.manual_seed(0)
    config = Qwen3Config(
        vocab_size=320, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=2,
        num_key_value_heads=1, head_dim=32, max_position_embeddings=256, tie_word_embeddings=False,
        eos_token_id=0, pad_token_id=0, bos_token_id=None,
    )
    assert vocab_size <= config.vocab_size
    model = Qwen3ForCausalLM(config)
    model.to(torch.bfloat16).save_pretrained(path)
    return path


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory) -> str:
    path = str(tmp_path_factory.mktemp("tiny-qwen3"))
    tok = build_tokenizer(path)
    build_model(path, len(tok))
    return path


@pytest.fixture(scope="session")
def prompts_dataset():
    from datasets import Dataset

    prompts = ["the cat", "a dog", "hello", "once upon", "numbers 1", "the mat", "cat and", "world"] * 8
    return Dataset.from_dict({"prompt": prompts})


def cat_reward(completions, **kwargs):
    """More 'cat' is better, shorter is better: enough signal for a nonzero policy gradient."""
    return [min(c.count("cat"), 4) - 0.01 * len(c) for c in completions]
