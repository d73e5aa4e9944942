"""A tiny random Qwen3, a locally trained tokenizer and a prompt set, for running the examples on CPU offline.

    python examples/trl/tiny.py tiny        # writes tiny/ (model, tokenizer) and tiny/data/train.jsonl

The model is saved in bf16 (the dtype a vLLM engine serves); GRPO loads it as fp32 masters.
Head dim 32, so vLLM's CPU attention accepts it.
"""
from __future__ import annotations

import json
import os
import sys

from faircast_plugins.doctor.tiny import PROMPTS, build_model, build_tokenizer  # the builders `faircast doctor` uses


def cat_reward(completions, **kwargs):
    """More 'cat' is better, shorter is better: enough signal for a nonzero policy gradient."""
    return [min(c.count("cat"), 4) - 0.01 * len(c) for c in completions]


def make_tiny(path: str) -> str:
    """Write the tiny model, tokenizer and ``data/train.jsonl`` under ``path``; returns ``path``."""
    os.makedirs(os.path.join(path, "data"), exist_ok=True)
    tok = build_tokenizer(path)
    assert len(tok) <= 320
    build_model(path)
    with open(os.path.join(path, "data", "train.jsonl"), "w") as f:
        f.writelines(json.dumps({"prompt": p}) + "\n" for p in PROMPTS)
    return path


if __name__ == "__main__":
    print(make_tiny(sys.argv[1] if len(sys.argv) > 1 else "tiny"))
