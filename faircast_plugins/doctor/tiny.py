"""The tiny random Qwen3 and its locally trained tokenizer: built in-process on CPU, no downloads.

Used by ``faircast doctor trl`` and by the examples and tests (examples/trl/tiny.py). Head dim 32, so vLLM's CPU
attention accepts it; saved in bf16 (the dtype a vLLM engine serves), GRPO loads it as fp32 masters.
"""
from __future__ import annotations

TEXT = [
    "the cat sat on the mat", "a cat and a dog", "cat cat cat", "the dog ran after the cat",
    "hello world", "numbers 0 1 2 3 4 5 6 7 8 9", "once upon a time there was a cat",
] * 20
PROMPTS = ["the cat", "a dog", "hello", "once upon", "numbers 1", "the mat", "cat and", "world"] * 8


def build_tokenizer(path: str):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=300, special_tokens=["<|endoftext|>", "<|im_start|>", "<|im_end|>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(TEXT, trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|endoftext|>", pad_token="<|endoftext|>",
                                   padding_side="left")
    fast.save_pretrained(path)
    return fast


def build_model(path: str) -> None:
    import torch
    from transformers import Qwen3Config, Qwen3ForCausalLM

    torch.manual_seed(0)
    config = Qwen3Config(
        vocab_size=320, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=2,
        num_key_value_heads=1, head_dim=32, max_position_embeddings=256, tie_word_embeddings=False,
        eos_token_id=0, pad_token_id=0, bos_token_id=None,
    )
    Qwen3ForCausalLM(config).to(torch.bfloat16).save_pretrained(path)
