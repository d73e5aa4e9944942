"""One sampling seed per engine request, so that the A/B's arms share common random numbers.

A single ``SamplingParams(seed=s)`` for a whole batch seeds every request's generator with the same ``s``: every
prompt then draws the same uniforms (the sampled-success readout's 100 prompts were ~8 independent draws, not
100), and with no seed at all the engine's one global stream depends on how many tokens each earlier request
drew, so two arms diverge after their first different token. Here each request gets its own seed, keyed by

    (run seed, step, prompt, sample)

where *prompt* is the prompt's token ids (hashed) and *sample* counts the earlier requests of the same prompt in
the same call (the GRPO group's 0, 1, ... n-1). Nothing about the arm or the weights enters the key: two arms
with equal weights draw identical completions, and arms with different weights draw from the same uniforms
(common random numbers), whatever the batch's order.
"""
from __future__ import annotations

import copy
import hashlib
import struct
from typing import Callable, Dict, List, Sequence, Tuple

#: vLLM seeds a ``torch.Generator`` with the request's seed; kept below 2**63 so any signed-int64 path takes it.
SEED_BITS = 63


#: what the request is for: a training rollout, or the held-out sampled-success readout (never the same draws)
ROLLOUT, READOUT = 0, 1


def request_seed(run_seed: int, step: int, prompt_ids: Sequence[int], sample: int, stream: int = ROLLOUT) -> int:
    """The sampling seed of one request: a hash of (stream, run seed, step, prompt token ids, sample index)."""
    h = hashlib.blake2b(digest_size=8, person=b"fc-ab-request")
    h.update(struct.pack("<qqqq", int(stream), int(run_seed), int(step), int(sample)))
    h.update(struct.pack(f"<{len(prompt_ids)}q", *map(int, prompt_ids)))
    return int.from_bytes(h.digest(), "little") & ((1 << SEED_BITS) - 1)


def _prompt_ids(request) -> Tuple[int, ...]:
    if isinstance(request, dict) and "prompt_token_ids" in request:
        return tuple(request["prompt_token_ids"])
    raise TypeError("per-request seeds need token-id prompts ({'prompt_token_ids': [...]}); got "
                    f"{type(request).__name__}")


def seeded_params(params, requests: Sequence, run_seed: int, step: int, stream: int = ROLLOUT) -> List:
    """One copy of ``params`` per request, each with its :func:`request_seed`; a request's sample index is the
    number of earlier requests in ``requests`` with the same prompt."""
    seen: Dict[Tuple[int, ...], int] = {}
    out = []
    for request in requests:
        ids = _prompt_ids(request)
        sample = seen.get(ids, 0)
        seen[ids] = sample + 1
        p = params.clone() if hasattr(params, "clone") else copy.copy(params)
        p.seed = request_seed(run_seed, step, ids, sample, stream)
        out.append(p)
    return out


def seed_every_request(llm, run_seed: int, step_of: Callable[[], int]) -> None:
    """Wrap ``llm.generate`` (a vLLM ``LLM``): a call with one ``SamplingParams`` for many requests gets one seeded
    copy per request instead (:func:`seeded_params`, at the step ``step_of()`` returns). A call that already passes
    a list of parameters is left as it is."""
    generate = llm.generate

    def seeded_generate(prompts, sampling_params=None, *args, **kwargs):
        if sampling_params is not None and not isinstance(sampling_params, (list, tuple)):
            if getattr(sampling_params, "n", 1) != 1:
                raise ValueError("per-request seeds need n=1 per request (TRL's colocate mode repeats the prompt)")
            sampling_params = seeded_params(sampling_params, prompts, run_seed, step_of())
        return generate(prompts, sampling_params, *args, **kwargs)

    llm.generate = seeded_generate
