"""Training micro-batches in OpenRLHF 0.11.2's own layout, built by its own functions (tests only).

Each sample is a list of turns ``(tokens, acted)``: the first is the prompt, then the model's actions (``acted``)
and the environment's observations in between (multi-turn). It goes through what a real run does with a rollout:
``SamplesGenerator._process_response_into_experience`` (``action_mask`` over the whole sequence minus its first
token, ``[1, T-1]``, 0 on prompt and observation tokens), ``Experience.concat_experiences`` (the experience maker),
then the replay buffer's ``split_experience_batch`` + ``remove_padding_in_sequences`` and its ``collate_fn``'s
``make_experience_batch`` (right padding). The import of ``samples_generator`` needs the vLLM stubs of
:mod:`shims`.
"""
from __future__ import annotations

from typing import List, Sequence, Tuple

Turn = Tuple[Sequence[int], bool]

PAD_ID = 0


def _response(turns: List[Turn]) -> dict:
    """The dict a rollout worker returns for one sample (the fields ``_process_response_into_experience`` reads)."""
    tokens, ranges = [], []
    for part, acted in turns:
        if acted:
            ranges.append((len(tokens), len(tokens) + len(part)))
        tokens.extend(part)
    return {"observation_tokens": tokens, "action_ranges": ranges, "rollout_log_probs": None, "reward": 1.0,
            "prompt": "p", "label": "l"}


def experience_batch(samples: List[List[Turn]], max_len: int = 64):
    """One training micro-batch (an ``Experience``) of ``samples``, as OpenRLHF's trainer receives it."""
    from openrlhf.trainer.ppo_utils.experience import (Experience, make_experience_batch, remove_padding_in_sequences,
                                                       split_experience_batch)
    from openrlhf.trainer.ppo_utils.samples_generator import SamplesGenerator

    # the method reads nothing of its instance
    singles = [SamplesGenerator._process_response_into_experience(None, _response(s), max_len=max_len) for s in samples]
    rollout = Experience.concat_experiences(singles, PAD_ID)
    return make_experience_batch(remove_padding_in_sequences(split_experience_batch(rollout)))
