"""Verifiable math reward for the GRPO example: 1 when the last \\boxed{} answer matches the label."""
import torch
from openrlhf.utils import extract_boxed_answer, grade_answer


def reward_func(queries, prompts, labels):
    rewards = torch.tensor(
        [float(grade_answer(extract_boxed_answer(q) or "", str(label))) for q, label in zip(queries, labels)]
    )
    return {"rewards": rewards, "scores": rewards, "extra_logs": {"accuracy": rewards}}
