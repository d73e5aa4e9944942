"""The A/B task: prompts with one verifiable answer, a reward, and a character tokenizer for the built-in task.

A task is a list of :class:`Problem` (``prompt``, ``answer``) split into training and held-out prompts. Success
means the completion starts with the answer (after stripping whitespace), so a policy's *expected* success on a
prompt is exactly the teacher-forced probability of the answer's tokens: the A/B's low-noise metric.

Built in (no downloads), 12 symbols: ``add2``, two-digit addition with a zero-padded three-digit answer (``37+45=``
-> ``082``); ``add3`` and ``add4``, the same with three and four digits (answers of 4 and 5 tokens: a per-token
mismatch between the served and master policies compounds over more tokens), 20,000 problems drawn from all of them. A user's own task: a jsonl file with ``prompt`` and ``answer`` fields (see
:func:`load_jsonl`).
"""
from __future__ import annotations

import json
import os
import random
from dataclasses import dataclass
from typing import List, Sequence, Tuple

EOS = "<|endoftext|>"
TASKS = ("add2", "add3", "add4")
#: Problems drawn for the tasks with too many to list (add3: 10**6, add4: 10**8).
SAMPLED_PROBLEMS = 20_000


@dataclass(frozen=True)
class Problem:
    prompt: str
    answer: str


def add2_problems(seed: int = 0, heldout: int = 1000) -> Tuple[List[Problem], List[Problem]]:
    """All 10,000 two-digit additions, shuffled with ``seed``: ``heldout`` of them held out, the rest for training."""
    problems = [Problem(f"{a:02d}+{b:02d}=", f"{a + b:03d}") for a in range(100) for b in range(100)]
    random.Random(seed).shuffle(problems)
    return problems[heldout:], problems[:heldout]


def add_problems(digits: int, seed: int = 0, heldout: int = 1000) -> Tuple[List[Problem], List[Problem]]:
    """``SAMPLED_PROBLEMS`` distinct ``digits``-digit additions drawn with ``seed``; the first ``heldout`` held out."""
    n = 10 ** digits
    picks = random.Random(seed).sample(range(n * n), SAMPLED_PROBLEMS)
    problems = [Problem(f"{i // n:0{digits}d}+{i % n:0{digits}d}=", f"{i // n + i % n:0{digits + 1}d}") for i in picks]
    return problems[heldout:], problems[:heldout]


def task_problems(task: str, seed: int = 0, heldout: int = 1000) -> Tuple[List[Problem], List[Problem]]:
    if task == "add2":
        return add2_problems(seed, heldout)
    if task in ("add3", "add4"):
        return add_problems(int(task[3]), seed, heldout)
    raise ValueError(f"unknown A/B task {task!r}; built in: {', '.join(TASKS)} (or --dataset FILE.jsonl)")


def load_jsonl(path: str, heldout: int, seed: int = 0) -> Tuple[List[Problem], List[Problem]]:
    """A user's task: one JSON object per line with string fields ``prompt`` and ``answer``.

    The rows are shuffled with ``seed``; the first ``heldout`` are held out for evaluation.
    """
    if not os.path.isfile(path):
        raise FileNotFoundError(f"A/B dataset {path!r} does not exist")
    rows: List[Problem] = []
    with open(path) as f:
        for lineno, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                obj = json.loads(line)
            except json.JSONDecodeError as e:
                raise ValueError(f"{path}:{lineno}: not JSON ({e.msg})") from None
            missing = [k for k in ("prompt", "answer") if not isinstance(obj, dict) or not isinstance(obj.get(k), str)]
            if missing:
                raise ValueError(
                    f"{path}:{lineno}: the A/B task needs string fields 'prompt' and 'answer' on every line; "
                    f"missing or not a string: {', '.join(missing)}"
                )
            if not obj["answer"].strip():
                raise ValueError(f"{path}:{lineno}: empty 'answer'")
            rows.append(Problem(obj["prompt"], obj["answer"].strip()))
    if len(rows) <= heldout:
        raise ValueError(f"{path} has {len(rows)} rows; the A/B holds out {heldout} for evaluation and needs more to train")
    random.Random(seed).shuffle(rows)
    return rows[heldout:], rows[:heldout]


def success(completion: str, answer: str) -> bool:
    return completion.strip().startswith(answer)


def make_reward(answers: dict):
    """A TRL reward function: 1.0 when the completion starts with the prompt's answer, else 0.0."""

    def exact_answer(prompts: Sequence[str], completions: Sequence[str], **kwargs) -> List[float]:
        return [float(success(c, answers[p])) for p, c in zip(prompts, completions)]

    return exact_answer


def build_char_tokenizer(path: str, symbols: str = "0123456789+="):
    """A one-token-per-character tokenizer (``symbols`` plus the EOS/pad token), saved to ``path``."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {EOS: 0, **{ch: i + 1 for i, ch in enumerate(symbols)}}
    tok = Tokenizer(models.WordLevel(vocab, unk_token=EOS))
    tok.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")
    tok.decoder = decoders.Fuse()
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token=EOS, pad_token=EOS, padding_side="left")
    fast.save_pretrained(path)
    return fast
