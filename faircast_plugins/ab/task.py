"""The A/B task: prompts with one verifiable answer, a reward, and a character tokenizer for the built-in task.

A task is a list of :class:`Problem` (``prompt``, ``answer``) split into training and held-out prompts. Success
means the completion starts with the answer (after stripping whitespace), so a policy's *expected* success on a
prompt is exactly the teacher-forced probability of the answer's tokens: the A/B's low-noise metric.

Built in (no downloads), 12 symbols: ``add2``, two-digit addition with a zero-padded three-digit answer (``37+45=``
-> ``082``); ``add3`` and ``add4``, the same with three and four digits (answers of 4 and 5 tokens: a per-token
mismatch between the served and master policies compounds over more tokens), 20,000 problems drawn from all of them.

For a pretrained language model (``--model smollm2``): ``word2``, two-step arithmetic word problems in English
("Mia has 47 stickers. She buys 6 packs with 8 stickers each. How many ..."), whose answer is a worked solution in
one fixed format, ``6 * 8 = 48. 47 + 48 = 95. Answer: 95`` and a line break: about 28 tokens of reasoning that end in a verifiable
number. Success means the completion starts with that whole solution, so the expected success stays exact (the
teacher-forced probability of every reasoning and answer token) and a per-token mismatch between the served and
master policies compounds over the chain. The prompt shows the format by three fixed worked examples.
``word2z``: the same problems (the same draws for a seed) with no worked examples in the prompt
(``Problem: ...\nSolution:``, ~35 tokens instead of ~214): the format is learnt by a short SFT warm start of the
pretrained model (the protocol's ``sft``), which keeps an RL step affordable on a CPU.

A user's own task: a jsonl file with ``prompt`` and ``answer`` fields (see :func:`load_jsonl`).
"""
from __future__ import annotations

import json
import os
import random
import re
from dataclasses import dataclass
from typing import List, Optional, Sequence, Tuple

EOS = "<|endoftext|>"
TASKS = ("add2", "add3", "add4", "word2", "word2z")
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


#: word2's people, items and the two operations (the second step adds what was bought or subtracts what was given).
NAMES = (("Mia", "She", "she"), ("Tom", "He", "he"), ("Ana", "She", "she"), ("Raj", "He", "he"), ("Lea", "She", "she"),
         ("Sam", "He", "he"), ("Ivy", "She", "she"), ("Ben", "He", "he"))
ITEMS = (("stickers", "packs"), ("apples", "bags"), ("pencils", "boxes"), ("cards", "decks"), ("marbles", "jars"),
         ("cookies", "trays"), ("stamps", "sheets"), ("shells", "buckets"))
#: Three worked examples before every word2 problem: the format (both operations) shown, never explained.
WORD2_EXAMPLES = (
    "Problem: Leo has 30 coins. He buys 4 bags with 5 coins each. How many coins does he have now?\n"
    "Solution: 4 * 5 = 20. 30 + 20 = 50. Answer: 50\n\n"
    "Problem: Zoe has 41 beads. She gives away 3 boxes with 6 beads each. How many beads does she have left?\n"
    "Solution: 3 * 6 = 18. 41 - 18 = 23. Answer: 23\n\n"
    "Problem: Max has 12 nuts. He buys 2 cans with 7 nuts each. How many nuts does he have now?\n"
    "Solution: 2 * 7 = 14. 12 + 14 = 26. Answer: 26\n\n")
#: Factor ranges and the start amount of word2: small enough that SmolLM2-135M starts above zero (calibration,
#: docs/ab/smollm2-calibration/: greedy ~6% on these, 0% with factors up to 9 and 12).
WORD2_FACTORS = (2, 5)
WORD2_START = (10, 50)


def word2_problem(rng: random.Random, shots: str = WORD2_EXAMPLES) -> Problem:
    """One two-step word problem and its worked solution in the fixed format, after the worked examples ``shots``."""
    (name, he, he_lower), (item, unit) = rng.choice(NAMES), rng.choice(ITEMS)
    b, c = rng.randint(*WORD2_FACTORS), rng.randint(*WORD2_FACTORS)
    if rng.random() < 0.5:
        a = rng.randint(*WORD2_START)
        text = (f"{name} has {a} {item}. {he} buys {b} {unit} with {c} {item} each. "
                f"How many {item} does {he_lower} have now?")
        steps, total = f"{b} * {c} = {b * c}. {a} + {b * c} = {a + b * c}.", a + b * c
    else:
        a = b * c + rng.randint(*WORD2_START)
        text = (f"{name} has {a} {item}. {he} gives away {b} {unit} with {c} {item} each. "
                f"How many {item} does {he_lower} have left?")
        steps, total = f"{b} * {c} = {b * c}. {a} - {b * c} = {a - b * c}.", a - b * c
    # the answer ends with the line break, so a longer number ("Answer: 634" for 63) is not a success
    return Problem(f"{shots}Problem: {text}\nSolution:", f" {steps} Answer: {total}\n")


def word2_problems(seed: int = 0, heldout: int = 1000, count: int = 10_000,
                   shots: str = WORD2_EXAMPLES) -> Tuple[List[Problem], List[Problem]]:
    """``count`` distinct word problems drawn with ``seed`` (of ~84,000 possible); the first ``heldout`` held out,
    the rest for training. ``shots=""``: word2z (the same problems, no worked examples)."""
    rng, seen, problems = random.Random(seed), set(), []
    while len(problems) < count:
        p = word2_problem(rng, shots)
        if p.prompt not in seen:
            seen.add(p.prompt)
            problems.append(p)
    return problems[heldout:], problems[:heldout]


def word2_answer(text: str) -> Optional[int]:
    """The number after the last ``Answer:`` in a completion (None if there is none): the verifiable answer."""
    found = re.findall(r"Answer:\s*(-?\d+)", text)
    return int(found[-1]) if found else None


def task_problems(task: str, seed: int = 0, heldout: int = 1000) -> Tuple[List[Problem], List[Problem]]:
    if task == "word2":
        return word2_problems(seed, heldout)
    if task == "word2z":
        return word2_problems(seed, heldout, shots="")
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
    """The completion starts with the answer, leading whitespace aside (an answer's trailing line break counts)."""
    return completion.lstrip().startswith(answer.lstrip())


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
