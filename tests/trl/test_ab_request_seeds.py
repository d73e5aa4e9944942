"""One sampling seed per engine request in the A/B harness (issue 36, item 1; ab-audit-2 §4.4).

Before: TRL's colocated rollouts passed one ``SamplingParams`` without a seed, so every request drew from the
engine's one stream (two arms diverge after their first different token, whatever their order), and the
sampled-success readout passed one ``SamplingParams(seed=s)`` for all 100 prompts, so every prompt drew the same
uniforms (identical frozen weights scored 2% to 56%).
"""
from __future__ import annotations

import pytest

from faircast_plugins.ab.request_seeds import (READOUT, ROLLOUT, request_seed, seed_every_request, seeded_params)


class Params:
    """A stand-in for vLLM's ``SamplingParams`` (only ``seed``, ``n`` and ``clone`` are used)."""

    def __init__(self, seed=None, n=1):
        self.seed, self.n = seed, n

    def clone(self):
        return Params(self.seed, self.n)


def test_the_seed_is_keyed_by_run_seed_step_prompt_and_sample_only():
    a, b = [1, 2, 3], [1, 2, 4]
    keys = {request_seed(s, t, p, k, st) for s in (0, 1) for t in (0, 1) for p in (a, b) for k in (0, 1)
            for st in (ROLLOUT, READOUT)}
    assert len(keys) == 32  # every component changes the seed
    assert request_seed(7, 3, a, 1) == request_seed(7, 3, list(a), 1)  # and nothing else enters it
    assert all(0 <= k < 2 ** 63 for k in keys)


def test_each_request_of_a_group_gets_its_sample_index_whatever_the_order():
    reqs = [{"prompt_token_ids": p} for p in ([5, 6], [5, 6], [7], [5, 6], [7])]
    seeds = [p.seed for p in seeded_params(Params(), reqs, 3, 9)]
    assert len(set(seeds)) == 5
    assert seeds[0] == request_seed(3, 9, [5, 6], 0) and seeds[3] == request_seed(3, 9, [5, 6], 2)
    # another arm, other batch order: the same (prompt, sample) draws with the same seed
    shuffled = [reqs[i] for i in (2, 0, 4, 1, 3)]
    again = [p.seed for p in seeded_params(Params(), shuffled, 3, 9)]
    assert sorted(again) == sorted(seeds)
    assert again[0] == request_seed(3, 9, [7], 0) and again[1] == request_seed(3, 9, [5, 6], 0)


def test_the_wrapper_seeds_a_shared_params_object_and_leaves_a_list_alone():
    calls = []

    class FakeLLM:
        def generate(self, prompts, sampling_params=None, use_tqdm=False):
            calls.append(sampling_params)

    llm, step = FakeLLM(), [4]
    seed_every_request(llm, 11, lambda: step[0])
    reqs = [{"prompt_token_ids": [1]}, {"prompt_token_ids": [1]}]
    llm.generate(reqs, sampling_params=Params(), use_tqdm=False)  # TRL's colocate call
    assert [p.seed for p in calls[-1]] == [request_seed(11, 4, [1], 0), request_seed(11, 4, [1], 1)]
    given = [Params(1), Params(2)]
    llm.generate(reqs, given)
    assert calls[-1] is given
    with pytest.raises(ValueError, match="n=1"):
        llm.generate(reqs, Params(n=2))


def test_the_sampled_readout_gives_every_prompt_its_own_draws_and_every_arm_the_same_ones():
    """``EngineEval.served``: one seed per prompt (before: one seed for all 100 prompts, so they shared draws), and
    the same seeds in two arms of the same run seed (common random numbers)."""
    from faircast_plugins.ab.run_one import EngineEval

    captured = []

    class Out:
        def __init__(self):
            self.outputs = [type("C", (), {"token_ids": [0]})()]

    class FakeLLM:
        def generate(self, prompts, sp, use_tqdm=False):
            captured.append(sp)
            return [Out() for _ in prompts]

    def evaluator():
        ev = EngineEval.__new__(EngineEval)
        ev.seed = 5
        ev.trainer = type("T", (), {"vllm_generation": type("G", (), {"llm": FakeLLM()})()})()
        ev.prompts = [{"prompt_token_ids": [3, i]} for i in range(100)]
        ev.n_ans = [1] * 100
        ev.enc = type("E", (), {"answer_ids": [[1]] * 100})()
        ev.SamplingParams = lambda **kw: Params(kw.get("seed"))
        ev.score = lambda: {}
        return ev

    evaluator().served(10)
    evaluator().served(10)
    first, second = captured
    assert isinstance(first, list) and len(first) == 100
    assert len({p.seed for p in first}) == 100, "the readout's prompts share a seed"
    assert [p.seed for p in first] == [p.seed for p in second]
    assert all(p.seed == request_seed(5, 10, [3, i], 0, READOUT) for i, p in enumerate(first))


def test_two_arms_with_equal_weights_draw_identical_completions(tiny_model_dir, monkeypatch):
    """A real vLLM CPU engine: with per-request seeds the same (prompt, sample) draws the same completion in two
    calls (two arms) even when the engine's own stream has moved on and the batch is in another order; without
    them (TRL's call: one unseeded ``SamplingParams``) the second call draws other completions."""
    from vllm import LLM, SamplingParams

    for k, v in {"RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "1", "MASTER_ADDR": "127.0.0.1"}.items():
        monkeypatch.setenv(k, v)
    from faircast_plugins.ab.runner import _free_port

    monkeypatch.setenv("MASTER_PORT", str(_free_port()))
    llm = LLM(model=tiny_model_dir, dtype="float32", seed=0, max_model_len=64, max_num_batched_tokens=4096,
              gpu_memory_utilization=0.3, distributed_executor_backend="external_launcher")
    tok = llm.get_tokenizer()
    prompts = [tok(p, add_special_tokens=False)["input_ids"] for p in ("the cat", "a dog sat", "one")]
    batch = [{"prompt_token_ids": p} for p in prompts for _ in range(4)]  # GRPO groups of 4
    params = SamplingParams(temperature=1.0, max_tokens=12)

    def completions(reqs):
        return [tuple(o.outputs[0].token_ids) for o in llm.generate(reqs, params, use_tqdm=False)]

    unseeded = [completions(batch), completions(batch)]
    assert unseeded[0] != unseeded[1], "the unseeded engine repeated itself: this test cannot see the bug"

    step = [0]
    seed_every_request(llm, 42, lambda: step[0])
    arm_a = completions(batch)
    reordered = [batch[i] for i in (5, 0, 11, 1, 6, 2, 10, 3, 7, 4, 9, 8)]  # another arm, another batch order
    arm_b = completions(reordered)

    def by_prompt_and_sample(reqs, outs):  # (prompt, k-th request of that prompt) -> completion
        seen, keyed = {}, {}
        for r, o in zip(reqs, outs):
            ids = tuple(r["prompt_token_ids"])
            keyed[ids, seen.get(ids, 0)] = o
            seen[ids] = seen.get(ids, 0) + 1
        return keyed

    assert by_prompt_and_sample(batch, arm_a) == by_prompt_and_sample(reordered, arm_b)
    assert completions(batch) == arm_a  # and the engine's own stream does not enter
    assert len(set(arm_a)) > len(prompts), "the samples of a group drew the same completion"
    step[0] = 1
    assert completions(batch) != arm_a  # the next step draws afresh
