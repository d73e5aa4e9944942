"""GRPO and RLOO with ``use_transformers_continuous_batching=True`` (no vLLM): transformers' ``generate_batch``
(paged attention, its own generation thread) on the policy itself, which TRL casts to bf16 in place.

With Fair Cast on, measured on the real TRL 1.16 / transformers code:

* every forward inside ``generate_batch`` runs on bf16 weights equal to ``fair_cast(master)`` at the current
  weight version, bit for bit (not round-to-nearest of the master);
* every other forward (old log-probs, loss) runs on fp32 parameters holding that same copy;
* after each generation the policy is back as it was: the same ``Parameter`` objects, fp32, the floating buffers
  (rotary ``inv_freq``) the very tensors they were, gradients accumulated before the generation untouched;
* SGD moves each fp32 master by exactly ``-lr * grad`` and the masters keep sub-bf16 precision.

Negative control (flag off, and audit-only): TRL's own behaviour, i.e. generation on round-to-nearest of the fp32
weights, and the parameters and buffers stay bf16 from the first generation on.

The checkpoint used here is fp32 and off the bf16 grid, so the copy served at version 0 already tells
``fair_cast`` from round-to-nearest. The paged cache is kept small (``CB_CONFIG``): transformers sizes it from
free memory by default, which on a CPU host means gigabytes and tens of seconds per generation.
"""
from __future__ import annotations

import threading

import pytest
import torch

import faircast_plugins.trl  # noqa: F401  (patches TRL)
from faircast_plugins import fair_cast
from faircast_plugins.trl import FairCastUnsupportedError
from helpers import SGDStepRecorder, expected_served, grpo_args, grpo_trainer, named_params, on_bf16_grid

SEED = 1234
CB_CONFIG = {"num_blocks": 8, "block_size": 32, "max_batch_tokens": 256}
CB = dict(use_transformers_continuous_batching=True, transformers_continuous_batching_config=CB_CONFIG, bf16=True)
# Gradient accumulation 2, two optimizer steps per generation batch, old log-probs by a separate forward.
GRPO_SHAPE = dict(gradient_accumulation_steps=2, num_iterations=2, max_steps=4, optim="sgd", learning_rate=1e-3)
# One generation per micro-batch: the second generation of each step runs with the first micro-batch's gradients.
RLOO_SHAPE = dict(gradient_accumulation_steps=2, steps_per_generation=1, max_steps=2, optim="sgd", learning_rate=1e-3)


@pytest.fixture(scope="module")
def fp32_model_dir(tiny_model_dir, tmp_path_factory) -> str:
    """The tiny model saved in fp32 with every weight nudged off the bf16 grid (norms included)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    path = str(tmp_path_factory.mktemp("tiny-fp32"))
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.rand(p.shape, generator=gen) * 2e-3 * p.abs().clamp_min(1e-2))
    model.save_pretrained(path)
    AutoTokenizer.from_pretrained(tiny_model_dir).save_pretrained(path)
    return path


def grpo_trainer_for(model_dir, dataset, out, **flags):
    return grpo_trainer(model_dir, dataset, grpo_args(out, **flags))


def rloo_trainer(model_dir, dataset, out, **flags):
    from trl import RLOOConfig, RLOOTrainer

    from conftest import cat_reward

    args = RLOOConfig(output_dir=str(out), per_device_train_batch_size=4, num_generations=4, max_completion_length=8,
                      use_cpu=True, beta=0.0, report_to="none", save_strategy="no", logging_steps=1, seed=0,
                      data_seed=0, lr_scheduler_type="constant", **flags)
    return RLOOTrainer(model=model_dir, reward_funcs=cat_reward, args=args, train_dataset=dataset)


class Watch:
    """Records what the policy looked like in and around every continuous-batching generation, and every forward."""

    def __init__(self, trainer, *, faircast: bool, mode: str = "stochastic"):
        self.trainer, self.faircast, self.mode = trainer, faircast, mode
        self.model = trainer.accelerator.unwrap_model(trainer.model)
        self.initial_buffers = {n: b.clone() for n, b in self.model.named_buffers()}
        self.generations, self.turns, self.forwards = [], [], []
        self.in_generation = False
        self.cached_version, self.cached, self.residuals = -1, {}, {}
        self.before_turn = {}
        generate_batch, turn = self.model.generate_batch, trainer._generate_single_turn

        def watched_generate_batch(*args, **kwargs):
            self.generations.append(self.snapshot())
            self.in_generation = True
            try:
                return generate_batch(*args, **kwargs)
            finally:
                self.in_generation = False

        def watched_turn(*args, **kwargs):
            params = dict(self.model.named_parameters())
            self.before_turn = {n: p.detach().clone() for n, p in params.items()}
            grads = {n: (p.grad, p.grad.clone()) for n, p in params.items() if p.grad is not None}
            buffers = {n: b for n, b in self.model.named_buffers()}
            result = turn(*args, **kwargs)
            after = dict(self.model.named_parameters())
            self.turns.append(dict(
                version=trainer.state.global_step,
                same_params=all(after[n] is p for n, p in params.items()),
                dtypes={p.dtype for p in after.values()},
                values_kept=all(torch.equal(after[n].detach().float(), v.float()) for n, v in self.before_turn.items()),
                grads=len(grads),
                grads_kept=all(after[n].grad is g and torch.equal(g, v) and g.dtype == torch.float32
                               for n, (g, v) in grads.items()),
                buffers_kept=all(b is buffers[n] for n, b in self.model.named_buffers()),
                buffer_dtypes={b.dtype for b in self.model.buffers()},
            ))
            return result

        self.model.generate_batch = watched_generate_batch
        trainer._generate_single_turn = watched_turn
        self.handle = self.model.model.register_forward_pre_hook(self.on_forward)

    def expected(self) -> dict:
        """fair_cast of every master at the current version, computed here independently of the adapter: keyed
        by (seed, version, name) for stochastic rounding; for error feedback, replayed over the versions in order
        from a zero residual. The masters do not change within a version, so each version is computed once."""
        version = self.trainer.state.global_step
        assert self.trainer._faircast.caster.version == version
        if version != self.cached_version:
            masters = self.trainer._faircast.masters
            if self.mode == "error_feedback":
                assert version == self.cached_version + 1, "error feedback is replayed version by version"
                self.cached = {n: fair_cast(m, key=0, mode="error_feedback", backend="torch",
                                            residual=self.residuals.setdefault(n, torch.zeros_like(m)))
                               for n, m in masters.items()}
            else:
                self.cached = {n: expected_served(m, seed=SEED, version=version, name=n, mode=self.mode)
                               for n, m in masters.items()}
            self.cached_version = version
        return self.cached

    def snapshot(self) -> dict:
        params = named_params(self.trainer)
        snap = dict(version=self.trainer.state.global_step, dtypes={p.dtype for p in params.values()},
                    fp32_names={n for n, p in params.items() if p.dtype == torch.float32},
                    buffer_dtypes={b.dtype for b in self.model.buffers()})
        if self.faircast:
            want = self.expected()
            snap["mismatches"] = [n for n, p in params.items() if not torch.equal(p.detach(), want[n].to(p.dtype))]
            masters = self.trainer._faircast.masters
            snap["differs_from_nearest"] = sum(not torch.equal(want[n], masters[n].to(torch.bfloat16)) for n in want)
        else:  # TRL's cast of the weights it held just before this generation
            snap["mismatches"] = [n for n, p in params.items()
                                  if not torch.equal(p.detach(), self.before_turn[n].to(torch.bfloat16))]
            sr = {n: expected_served(w.float(), seed=SEED, version=snap["version"], name=n, mode="stochastic")
                  for n, w in self.before_turn.items()}
            snap["differs_from_fair_cast"] = sum(not torch.equal(p.detach(), sr[n]) for n, p in params.items())
        return snap

    def on_forward(self, module, args):
        params = named_params(self.trainer)
        record = dict(generation=self.in_generation, thread=threading.current_thread().name,
                      grad=torch.is_grad_enabled(), dtypes={p.dtype for p in params.values()},
                      fp32_names={n for n, p in params.items() if p.dtype == torch.float32})
        if self.faircast:
            want = self.expected()
            record["mismatches"] = sum(not torch.equal(p.detach(), want[n].to(p.dtype)) for n, p in params.items())
        self.forwards.append(record)

    def remove(self):
        self.handle.remove()


def train(build, model_dir, dataset, out, shape, **flags):
    trainer = build(model_dir, dataset, out, **CB, **shape, **flags)
    faircast = bool(flags.get("faircast"))
    watch = Watch(trainer, faircast=faircast, mode=flags.get("faircast_mode", "stochastic"))
    sgd = SGDStepRecorder(trainer, faircast=faircast)
    trainer.add_callback(sgd)
    trainer.train()
    watch.remove()
    return trainer, watch, sgd


def check_fair_cast_run(trainer, watch, sgd, *, steps: int, generations: int, grads_at_generation: bool = False,
                        fp32_in_generation=frozenset()):
    """``fp32_in_generation``: parameters TRL keeps fp32 while generating (``cast_lm_head_to_fp32``); they must
    hold the served copy all the same."""
    fp32 = {torch.float32}
    assert trainer.state.global_step == steps and trainer._faircast.caster.version == steps
    # Part 1: generate_batch ran on bf16 weights equal to fair_cast(master) at the current version.
    assert len(watch.generations) == generations, watch.generations
    for g in watch.generations:
        assert g["fp32_names"] == fp32_in_generation and g["dtypes"] <= {torch.bfloat16, torch.float32}, g
        assert torch.bfloat16 in g["dtypes"] and g["mismatches"] == [], g
    # the check above tells the copy from round-to-nearest (error feedback equals it at version 0, zero residual)
    assert sum(g["differs_from_nearest"] for g in watch.generations) > 0
    in_generation = [f for f in watch.forwards if f["generation"]]
    assert len(in_generation) >= generations  # generate_batch's forwards (on its own thread) were seen
    assert all(f["fp32_names"] == fp32_in_generation and f["dtypes"] <= {torch.bfloat16, torch.float32}
               and torch.bfloat16 in f["dtypes"] and f["mismatches"] == 0 for f in in_generation)
    # Part 2: old log-probs and loss forwards run on fp32 parameters holding that same copy.
    others = [f for f in watch.forwards if not f["generation"]]
    assert sum(f["grad"] for f in others) >= 2 * steps
    assert all(f["dtypes"] == fp32 and f["mismatches"] == 0 for f in others)
    # Around every generation the policy's own parameters were never cast: the same objects, fp32, same values;
    # the buffers (which TRL's cast replaces) are the same tensors again.
    assert len(watch.turns) == generations
    for t in watch.turns:
        assert t["same_params"] and t["dtypes"] == fp32 and t["values_kept"] and t["buffers_kept"], t
        assert t["buffer_dtypes"] == fp32 and t["grads_kept"], t
    assert any(t["grads"] for t in watch.turns) == grads_at_generation
    # The optimizer stepped the fp32 masters: exactly -lr * grad, keeping sub-bf16 precision.
    assert sgd.steps == steps and sgd.failures == [], sgd.failures[:5]
    assert sgd.moved_off_grid > 0
    params = named_params(trainer)
    assert {p.dtype for p in params.values()} == fp32 and all(on_bf16_grid(p.detach()) for p in params.values())
    assert not all(on_bf16_grid(m) for m in trainer._faircast.masters.values())
    for n, b in watch.model.named_buffers():
        assert b.dtype == torch.float32 and torch.equal(b, watch.initial_buffers[n]), n


def check_trl_behaviour(trainer, watch, *, generations: int):
    """TRL's own continuous batching: the first generation casts the policy to bf16 by round-to-nearest, for good."""
    assert len(watch.generations) == generations
    for g in watch.generations:
        assert g["dtypes"] == {torch.bfloat16} and g["buffer_dtypes"] == {torch.bfloat16}, g
        assert g["mismatches"] == [], g  # round-to-nearest of the weights held just before
    assert watch.generations[0]["differs_from_fair_cast"] > 0
    assert all(t["dtypes"] == {torch.bfloat16} and t["buffer_dtypes"] == {torch.bfloat16} for t in watch.turns)
    assert {p.dtype for p in named_params(trainer).values()} == {torch.bfloat16}
    assert {b.dtype for b in watch.model.buffers()} == {torch.bfloat16}


@pytest.mark.parametrize("mode,lm_head_fp32", [("stochastic", False), ("error_feedback", True)])
def test_grpo_generates_on_fair_cast_of_master_and_keeps_fp32_masters(fp32_model_dir, prompts_dataset, tmp_path,
                                                                      mode, lm_head_fp32):
    trainer, watch, sgd = train(grpo_trainer_for, fp32_model_dir, prompts_dataset, tmp_path / "on", GRPO_SHAPE,
                                faircast=True, faircast_mode=mode, faircast_seed=SEED,
                                cast_lm_head_to_fp32=lm_head_fp32)
    check_fair_cast_run(trainer, watch, sgd, steps=4, generations=2,
                        fp32_in_generation={"lm_head.weight"} if lm_head_fp32 else set())


def test_rloo_with_gradients_pending_at_generation(fp32_model_dir, prompts_dataset, tmp_path):
    trainer, watch, sgd = train(rloo_trainer, fp32_model_dir, prompts_dataset, tmp_path / "on", RLOO_SHAPE,
                                faircast=True, faircast_seed=SEED)
    check_fair_cast_run(trainer, watch, sgd, steps=2, generations=4, grads_at_generation=True)


def test_rloo_negative_control_flag_off_keeps_trl_behaviour(fp32_model_dir, prompts_dataset, tmp_path):
    trainer, watch, _ = train(rloo_trainer, fp32_model_dir, prompts_dataset, tmp_path / "off", RLOO_SHAPE)
    assert not hasattr(trainer, "_faircast")
    check_trl_behaviour(trainer, watch, generations=4)


def test_grpo_negative_controls_flag_off_and_audit_only_keep_trl_behaviour(fp32_model_dir, prompts_dataset, tmp_path):
    off, watch, _ = train(grpo_trainer_for, fp32_model_dir, prompts_dataset, tmp_path / "off", GRPO_SHAPE)
    assert not hasattr(off, "_faircast")
    check_trl_behaviour(off, watch, generations=2)
    audit, watch, _ = train(grpo_trainer_for, fp32_model_dir, prompts_dataset, tmp_path / "audit", GRPO_SHAPE,
                            faircast_audit=True, faircast_seed=SEED)
    assert audit._faircast.shadow is False
    check_trl_behaviour(audit, watch, generations=2)
    p_off, p_audit = named_params(off), named_params(audit)
    assert all(torch.equal(p_off[n], p_audit[n]) for n in p_off), "audit-only must not change training"
    logged = [h for h in audit.state.log_history if "faircast/master_moved_frac" in h]
    assert len(logged) >= 3
    # from the first generation on, the weights TRL trains are the bf16 copy it serves: no lag between them
    for h in logged[1:]:
        assert h["faircast/lag_steps"] == 0 and h["faircast/served_changed_frac"] == h["faircast/master_moved_frac"], h


@pytest.mark.parametrize("flags", [dict(faircast=True), dict(faircast_audit=True)])
def test_fsdp_with_continuous_batching_is_refused(tiny_model_dir, prompts_dataset, tmp_path, flags):
    args = grpo_args(tmp_path, fsdp=True, use_transformers_continuous_batching=True, **flags)
    with pytest.raises(FairCastUnsupportedError, match="casts the sharded fp32 masters"):
        grpo_trainer(tiny_model_dir, prompts_dataset, args)


def test_fp16_with_continuous_batching_is_refused(tiny_model_dir, prompts_dataset, tmp_path):
    args = grpo_args(tmp_path, faircast=True, use_transformers_continuous_batching=True)
    args.bf16, args.fp16 = False, True  # set after init: transformers refuses fp16 on a CPU-only host
    with pytest.raises(FairCastUnsupportedError, match="fp16=True"):
        grpo_trainer(tiny_model_dir, prompts_dataset, args)
