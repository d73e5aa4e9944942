"""Teacher-forced scoring: a policy's exact expected and greedy success on held-out problems.

Success means the completion starts with the answer, so for one prompt

* expected success at temperature 1 = P(answer tokens | prompt) = exp(sum of the answer tokens' log-probs);
* greedy success = every answer token is the argmax given the prompt and the answer tokens before it.

Both come from one forward pass, with no sampling noise. (For a tokenizer that can spell the answer in several
ways, this counts the canonical spelling only; the built-in task's character tokenizer has one.)
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import List, Sequence

import torch

from .task import Problem


@dataclass
class Encoded:
    """Problems as token ids: ``prompt_ids[i] + answer_ids[i]`` is what the policy is scored on."""

    prompt_ids: List[List[int]]
    answer_ids: List[List[int]]


def encode(tokenizer, problems: Sequence[Problem]) -> Encoded:
    prompts = [tokenizer(p.prompt, add_special_tokens=False)["input_ids"] for p in problems]
    answers = [tokenizer(p.answer, add_special_tokens=False)["input_ids"] for p in problems]
    empty = [p.answer for p, a in zip(problems, answers) if not a]
    if empty:
        raise ValueError(f"answers that tokenize to nothing: {empty[:3]}")
    return Encoded(prompts, answers)


def summarize(answer_logprobs: Sequence[float], greedy_ok: Sequence[bool]) -> dict:
    n = len(answer_logprobs)
    return {
        "expected": sum(float(torch.tensor(lp).exp()) for lp in answer_logprobs) / n,
        "greedy": sum(bool(g) for g in greedy_ok) / n,
    }


@torch.no_grad()
def score_model(model, enc: Encoded, batch_size: int = 500) -> dict:
    """Expected and greedy success of an HF causal LM (its current weights) on ``enc``."""
    was_training = model.training
    model.eval()
    device = next(model.parameters()).device
    logprobs, greedy = [], []
    for start in range(0, len(enc.prompt_ids), batch_size):
        rows = [p + a for p, a in zip(enc.prompt_ids[start:start + batch_size], enc.answer_ids[start:start + batch_size])]
        width = max(map(len, rows))
        ids = torch.zeros(len(rows), width, dtype=torch.long, device=device)
        mask = torch.zeros_like(ids)
        for i, r in enumerate(rows):
            ids[i, :len(r)] = torch.tensor(r)
            mask[i, :len(r)] = 1
        logits = model(input_ids=ids, attention_mask=mask).logits.float()
        lp = torch.log_softmax(logits, dim=-1)
        for i, r in enumerate(rows):
            n_ans = len(enc.answer_ids[start + i])
            pos = torch.arange(len(r) - n_ans - 1, len(r) - 1, device=device)  # positions predicting the answer
            target = ids[i, pos + 1]
            logprobs.append(float(lp[i, pos, target].sum()))
            greedy.append(bool((lp[i, pos].argmax(-1) == target).all()))
    model.train(was_training)
    return summarize(logprobs, greedy)
