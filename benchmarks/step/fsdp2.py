"""FSDP2 at 2 gloo ranks on CPU: what ``faircast: true`` costs one step through TRL's FSDP2 backend.

Each arm is the same random Qwen3 under ``fully_shard`` (every decoder layer and the root; bf16
``MixedPrecisionPolicy``, fp32 gradient reduction; torch's AdamW) with TRL's ``FSDPBackend`` attached the way the
callback attaches it at train begin (``begin``: the shared FSDP cast patches, every trainable shard registered).
The trainer itself is not built: the backend gets a holder of the sharded model and this process's rank (what it
reads of a trainer), so the step is exactly the backend's: forward + loss, backward, ``optimizer.step()``,
``after_step`` (version += 1; error feedback casts its shards here), then the weight sync TRL's FSDP2 path sends
vLLM (each parameter gathered in fp32 with ``full_tensor()``, through the backend's ``export``, bf16 out).

``--policy-seqs K`` adds "flag off + policy probe" and "stochastic + policy probe": the ``faircast/policy_*`` probe
(``faircast_policy_metrics_every``) through the backend's FSDP views (:mod:`faircast_plugins.fsdp_policy`) on the
first K sequences of each rank's batch at every step, rows gathered over the ranks, before the loss as TRL's
``compute_loss`` runs it. (probe arm / its base arm - 1) / N is what it costs a step at ``every: N``.

``--per-parameter-arm`` (with ``--policy-seqs``) adds "stochastic + policy probe (per-parameter master)": the session-15
master path (benchmarks/step/fsdp_policy_arms.py), timed in the same run as today's.

    python benchmarks/step/fsdp2.py [--smoke] [--reps N] [--world 2] [--policy-seqs K [--per-parameter-arm]]
"""
from __future__ import annotations

import os
import sys
from types import SimpleNamespace

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import harness  # noqa: E402
from fsdp_policy_arms import OLD_ARM, old_path_step, old_path_summary, probe_timers  # noqa: E402
from trl_plain import PROBE, policy_summary  # noqa: E402

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import torch  # noqa: E402

MEM_TARGET = 0.0  # B/param for stochastic/sticky (issue #21)
PATH = "TRL FSDP2 backend, 2 gloo ranks (fully_shard + the shared FSDP cast patches)"


def make_arm_factory(size: harness.Size, kernel: str, policy_seqs: int = 0):
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    from faircast_plugins import FairCastConfig, FairCaster
    from faircast_plugins.policy_lag import PolicyLagProbe, gather_rows
    from faircast_plugins.trl.backends.fsdp import FSDPBackend

    rank, world = dist.get_rank(), dist.get_world_size()
    mesh = init_device_mesh("cpu", (world,))
    ids = harness.batch(size, seed=1 + rank)

    def make(label: str, mode, audit: bool) -> harness.Arm:
        model = harness.build_model(size)
        params = harness.count_params(model)
        policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
        for layer in model.model.layers:
            fully_shard(layer, mesh=mesh, mp_policy=policy)
        fully_shard(model, mesh=mesh, mp_policy=policy)
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4, weight_decay=0.0)
        backend = None
        probe = PolicyLagProbe(1, max(1, policy_seqs)) if PROBE in label else None
        prompt = max(1, size.seq // 4)
        if mode is not None or audit or probe is not None:
            config = FairCastConfig(enabled=mode is not None, mode=mode or "stochastic", audit=audit, seed=1234,
                                    backend=kernel, policy_metrics_every=int(probe is not None),
                                    policy_metrics_seqs=max(1, policy_seqs))
            holder = SimpleNamespace(
                model=model, args=SimpleNamespace(should_save=False),
                accelerator=SimpleNamespace(unwrap_model=lambda m: m, process_index=rank, num_processes=world,
                                            device=torch.device("cpu")))
            backend = FSDPBackend(holder, FairCaster(config))
            if probe is not None:
                backend.check_policy_metrics("GRPOTrainer")
            backend.prepare()
            with harness.quiet_logs():
                backend.begin(SimpleNamespace(global_step=0), None)
        sent = {}

        def measure() -> None:  # what the patched compute_loss does on a due step, then the log's gather
            with backend.policy_scope() as swap:
                served, master = backend.policy_views()
                probe.measure(model, 0, ids[:, :prompt], torch.ones_like(ids[:, :prompt]), ids[:, prompt:],
                              torch.ones_like(ids[:, prompt:]), served=served, master=master, swap=swap)
            gather_rows(probe.take())

        def step() -> None:
            if probe is not None:
                arm.measure()
            loss = harness.lm_loss(model, ids)
            loss.backward()
            if backend is not None:
                backend.before_step()
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            if backend is not None:
                backend.after_step()
            with torch.no_grad():
                stream = ((n, p.full_tensor()) for n, p in model.named_parameters())
                for name, tensor in (backend.export(stream) if backend is not None and backend.serves_export
                                     else stream):
                    sent[name] = tensor.to(torch.bfloat16)  # what vLLM's bf16 parameter receives
            sent.clear()

        def state_bytes():
            if backend is None:
                return {}
            # model_storages counts each DTensor parameter's local shard (its storage)
            return harness.fair_cast_bytes({"backend": backend}, harness.model_storages(model, optimizer))

        arm = harness.Arm(label, mode, audit, step=old_path_step(step) if label == OLD_ARM[0] else step,
                          state_bytes=state_bytes, params=params)
        arm.backend = backend
        arm.measure = measure
        return arm

    return make


def hooks(timers: harness.Timers, arm: harness.Arm) -> None:
    from faircast_plugins import fsdp

    if arm.backend is None:
        return
    timers.wrap(fsdp, "_cast_into", "hook: FSDP all-gather cast site")
    timers.wrap(arm.backend, "after_step", "hook: after step")
    timers.wrap_generator(arm.backend, "export", "hook: export")
    if arm.backend.config.measures_policy:
        timers.wrap(arm, "measure", "hook: policy probe")
        probe_timers(timers)


def main() -> int:
    harness.reexec_for_rss()
    parser = harness.arguments(__doc__.split("\n")[0])
    parser.add_argument("--world", type=int, default=2, help="local gloo ranks (default 2)")
    parser.add_argument("--policy-seqs", type=int, default=0,
                        help="also time the faircast/policy_* probe on this many sequences per rank and step (arms "
                             "'flag off + policy probe', 'stochastic + policy probe')")
    parser.add_argument("--per-parameter-arm", action="store_true",
                        help=f"with --policy-seqs, also the arm '{OLD_ARM[0]}' (the session-15 master path, timed in "
                             "the same run)")
    args = parser.parse_args()
    harness.as_ranks(args.world)
    size = harness.settle(args)
    torch.distributed.init_process_group("gloo")
    params = harness.count_params(harness.build_model(size))
    harness.header(PATH, size, params, args)
    if args.policy_seqs:
        harness.ALL_ARMS.extend([("flag off" + PROBE, None, False), ("stochastic" + PROBE, "stochastic", False)]
                                 + [OLD_ARM] * args.per_parameter_arm)
        if args.arms:
            args.arms += f",flag off{PROBE},stochastic{PROBE}" + f",{OLD_ARM[0]}" * args.per_parameter_arm
    result = harness.measure(PATH, make_arm_factory(size, args.backend, args.policy_seqs), hooks, params, args,
                             mem_target=MEM_TARGET)
    if args.policy_seqs and torch.distributed.get_rank() == 0:
        policy_summary(result, args.policy_seqs, size)
        old_path_summary(result)
    torch.distributed.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
