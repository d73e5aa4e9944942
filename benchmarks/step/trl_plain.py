"""TRL, one process: what ``faircast: true`` costs one GRPO optimizer step and the engine sync after it.

Each arm is a real ``GRPOTrainer`` (the patched TRL, so Fair Cast's callback and backend are the ones a user gets)
on the same random Qwen3 (fp32 masters, ``bf16=True`` compute, AdamW). A step is what the trainer does around one
optimizer step, on a fixed batch: the loss under the trainer's autocast, ``backward``, the callback's
``on_pre_optimizer_step``, ``optimizer.step()``, ``on_optimizer_step``, ``zero_grad``; then the weight sync a
vLLM engine receives (TRL's export stream through the callback, each tensor cast to bf16 as vLLM's ``copy_``
does). Generation and rewards are the same with the flag on and off and are left out.

    python benchmarks/step/trl_plain.py [--smoke] [--reps N] [--arms 'flag off,stochastic']

``--policy-seqs K`` adds two arms, "flag off + policy probe" and "stochastic + policy probe", that run the
``faircast/policy_*`` probe (``faircast_policy_metrics_every``, :mod:`faircast_plugins.policy_lag`) at every step on
K sequences of the step's batch (the last 3/4 of each sequence as its completion): their ratio minus 1, divided by
N, is what the probe costs a step at ``faircast_policy_metrics_every: N`` (printed for N = 10).
"""
from __future__ import annotations

import os
import sys
import tempfile

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import harness  # noqa: E402

for var, value in (("HF_HUB_OFFLINE", "1"), ("TOKENIZERS_PARALLELISM", "false"), ("WANDB_DISABLED", "true"),
                   ("VLLM_NO_USAGE_STATS", "1")):
    os.environ.setdefault(var, value)

import torch  # noqa: E402

PATH = "TRL, one process (shadow masters)"
MEM_TARGET = 2.0  # B/param for stochastic/sticky (issue #21)


PROBE = " + policy probe"


def make_arm_factory(model_dir: str, out_dir: str, size: harness.Size, backend: str, master_bytes: int = 2,
                     policy_seqs: int = 0):
    import faircast_plugins.trl  # noqa: F401  (patches TRL, its configs included: import first)
    from datasets import Dataset
    from trl import GRPOConfig, GRPOTrainer

    from faircast_plugins.doctor.tiny import PROMPTS
    from faircast_plugins.trl.patches import find_callback

    ids = harness.batch(size)

    def reward(completions, **kwargs):
        return [0.0 for _ in completions]

    def make(label: str, mode, audit: bool) -> harness.Arm:
        probe = label.endswith(PROBE)
        args = GRPOConfig(
            faircast_policy_metrics_every=1 if probe else 0, faircast_policy_metrics_seqs=max(1, policy_seqs),
            output_dir=os.path.join(out_dir, label.replace(" ", "_")), faircast=mode is not None,
            faircast_mode=mode or "stochastic", faircast_audit=audit, faircast_seed=1234, faircast_backend=backend, faircast_master_bytes=master_bytes,
            bf16=True, use_cpu=True,
            per_device_train_batch_size=2, num_generations=2, max_completion_length=4, beta=0.0, learning_rate=1e-4,
            lr_scheduler_type="constant", warmup_steps=0, report_to="none", save_strategy="no", seed=0,
            dataloader_num_workers=0,
        )
        with harness.quiet_logs():
            trainer = GRPOTrainer(model=model_dir, reward_funcs=reward, args=args,
                                  train_dataset=Dataset.from_dict({"prompt": PROMPTS[:4]}))
        trainer.create_optimizer()
        optimizer = trainer.optimizer
        callback = find_callback(trainer)
        model = trainer.accelerator.unwrap_model(trainer.model)
        if callback is not None:
            callback.on_train_begin(args, trainer.state, trainer.control)
        sent = {}
        prompt = max(1, size.seq // 4)
        inputs = {"prompt_ids": ids[:, :prompt], "prompt_mask": torch.ones_like(ids[:, :prompt]),
                  "completion_ids": ids[:, prompt:], "completion_mask": torch.ones_like(ids[:, prompt:])}

        def step() -> None:
            if probe:  # what the patched compute_loss does on a due step, before the loss
                callback.measure_policy(inputs, trainer.state.global_step, 1.0)
                callback.policy.take()
            model.train()
            with trainer.compute_loss_context_manager():
                loss = harness.lm_loss(model, ids)
            trainer.accelerator.backward(loss)
            if callback is not None:
                callback.on_pre_optimizer_step(args, trainer.state, trainer.control)
            optimizer.step()
            if callback is not None:
                callback.on_optimizer_step(args, trainer.state, trainer.control)
            optimizer.zero_grad(set_to_none=True)
            trainer.state.global_step += 1
            stream = model.named_parameters()
            with torch.no_grad():
                for name, tensor in (callback.export(stream) if callback is not None else stream):
                    sent[name] = tensor.to(torch.bfloat16)  # what vLLM's bf16 parameter receives
            sent.clear()

        def state_bytes():
            if callback is None:
                return {}
            return harness.fair_cast_bytes({"callback": callback}, harness.model_storages(model, optimizer))

        arm = harness.Arm(label, mode, audit, step=step, state_bytes=state_bytes, params=harness.count_params(model))
        arm.callback = callback
        return arm

    return make


def hooks(timers: harness.Timers, arm: harness.Arm) -> None:
    cb = arm.callback
    if cb is None:
        return
    timers.wrap(cb, "on_pre_optimizer_step", "hook: before step (copies)")
    timers.wrap(cb, "on_optimizer_step", "hook: after step (copies + cast)")
    timers.wrap_generator(cb, "export", "hook: export")
    if cb.policy is not None:
        timers.wrap(cb, "measure_policy", "hook: policy probe")


def main() -> int:
    harness.reexec_for_rss()
    parser = harness.arguments(__doc__.split("\n")[0])
    parser.add_argument("--policy-seqs", type=int, default=0,
                        help="also time the faircast/policy_* probe on this many sequences per step (arms "
                             "'flag off + policy probe', 'stochastic + policy probe')")
    parser.add_argument("--master-bytes", type=int, choices=(2, 4), default=2,
                        help="faircast_master_bytes of the Fair Cast arms (2: low 16 bits, the default; 4: fp32)")
    args = parser.parse_args()
    size = harness.settle(args)
    with tempfile.TemporaryDirectory(prefix="faircast-step-trl-") as tmp:
        from faircast_plugins.doctor.tiny import build_tokenizer

        build_tokenizer(tmp)
        model = harness.build_model(size)
        params = harness.count_params(model)
        model.save_pretrained(tmp)  # fp32: the trainers load it as their masters
        del model
        path = f"{PATH}, {args.master_bytes} B masters"
        harness.header(path, size, params, args)
        if args.policy_seqs:
            harness.ALL_ARMS.extend([("flag off" + PROBE, None, False), ("stochastic" + PROBE, "stochastic", False)])
            if args.arms:
                args.arms += f",flag off{PROBE},stochastic{PROBE}"
        result = harness.measure(path, make_arm_factory(tmp, tmp, size, args.backend, args.master_bytes,
                                                        args.policy_seqs), hooks, params, args, mem_target=MEM_TARGET)
        if args.policy_seqs:
            policy_summary(result, args.policy_seqs, size)
    return 0


def policy_summary(result: dict, seqs: int, size: harness.Size, every: int = 10) -> None:
    """The probe's cost per step at faircast_policy_metrics_every = ``every``: (probe arm / its base arm - 1) / every."""
    rows = {r["arm"]: r for r in result["rows"]}
    harness.say(f"\npolicy probe ({seqs} sequences of {size.seq} tokens, two fp32 forwards each; the batch is "
                f"{size.batch} x {size.seq}): cost per step at faircast_policy_metrics_every={every}")
    for base in ("flag off", "stochastic"):
        on = rows.get(base + PROBE)
        if on is None or base not in rows:
            continue
        ratio = on["ratio_median"] / rows[base]["ratio_median"]  # each paired with flag off in its repetition
        probe_ms = on["breakdown_ms"].get("hook: policy probe")
        harness.say(f"  {base:<12} probe every step {ratio:.2f}x its base arm -> every {every}: "
                    f"{100 * (ratio - 1) / every:+.1f}% of a step (paired median ratios"
                    + (f"; probe {probe_ms:.0f} ms instrumented)" if probe_ms else ")"))


if __name__ == "__main__":
    sys.exit(main())
