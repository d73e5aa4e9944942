"""The FSDP2 policy probe alone, its two master paths alternated in one run: what one measurement costs each way.

The step benchmark (fsdp2.py) times whole steps, whose noise on a loaded machine can hide a difference of a few
hundred ms; this times only the measurement (``policy_scope`` + ``probe.measure`` + the rows' gather), on the same
26.2M-parameter Qwen3 under ``fully_shard`` (bf16 ``MixedPrecisionPolicy``, every decoder layer and the root) with the
stochastic FSDP cast patches registered, 2 gloo ranks, the first K sequences of the same 8 x 64 batch, and in each
repetition runs, back to back and in turn first:

``one-gather``
    today's path (:mod:`faircast_plugins.fsdp_policy`): the master forward with FSDP's hooks off, one fp32
    all-gather per parameter group;
``per-parameter``
    the session-15 path: the master forward inside FSDP's own forward (its bf16 all-gather and cast again) and each
    parameter's fp32 master gathered alone (benchmarks/step/fsdp_policy_arms.py).

It prints each path's median and best ms per measurement, the paired median ratio, and a plain fp32 forward of the
same sequences on an unsharded copy (the floor: two of them are the probe's compute), and checks the two paths'
rows are bit-identical.

    python benchmarks/step/fsdp2_probe_paths.py [--reps 9] [--policy-seqs 2] [--batch 8] [--seq 64] [--smoke]
"""
from __future__ import annotations

import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import harness  # noqa: E402
from fsdp_policy_arms import per_parameter_master  # noqa: E402

import torch  # noqa: E402


def main() -> int:
    parser = harness.arguments(__doc__.split("\n")[0])
    parser.add_argument("--world", type=int, default=2, help="local gloo ranks (default 2)")
    parser.add_argument("--policy-seqs", type=int, default=2, help="sequences scored per rank (default 2)")
    args = parser.parse_args()
    harness.as_ranks(args.world)
    size = harness.settle(args)
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    from faircast_plugins import FairCastConfig, FairCaster, fsdp
    from faircast_plugins.fsdp_policy import FSDPPolicyViews
    from faircast_plugins.policy_lag import PolicyLagProbe, gather_rows

    dist.init_process_group("gloo")
    rank = dist.get_rank()
    params = harness.count_params(harness.build_model(size))
    harness.header("FSDP2 policy probe alone, 2 gloo ranks: one-gather vs per-parameter master", size, params, args)
    model = harness.build_model(size)
    plain = harness.build_model(size).eval()
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    for layer in model.model.layers:
        fully_shard(layer, mesh=mesh, mp_policy=policy)
    fully_shard(model, mesh=mesh, mp_policy=policy)
    ids = harness.batch(size, seed=1 + rank)
    with torch.no_grad():
        model(input_ids=ids[:1])  # FSDP's lazy init, as any trainer's first forward
    caster = FairCaster(FairCastConfig(enabled=True, mode="stochastic", seed=1234, backend=args.backend))
    with harness.quiet_logs():
        fsdp.apply_fsdp_cast_patches()
    fsdp.register_fsdp_module(model, caster)
    probe, prompt = PolicyLagProbe(1, args.policy_seqs), max(1, size.seq // 4)

    def measure() -> torch.Tensor:
        views = FSDPPolicyViews(model)
        with views.scope():
            probe.measure(model, 0, ids[:, :prompt], torch.ones_like(ids[:, :prompt]), ids[:, prompt:],
                          torch.ones_like(ids[:, prompt:]), served=views.served, master=views.master,
                          swap=views.swapped, collective=True)
        return gather_rows(probe.take())

    def one_gather() -> torch.Tensor:
        return measure()

    def per_parameter() -> torch.Tensor:
        with per_parameter_master():
            return measure()

    paths = {"one-gather": one_gather, "per-parameter": per_parameter}
    times = {name: [] for name in paths}
    rows = {}
    for fn in paths.values():  # warm-up
        fn()
    for rep in range(args.reps):
        order = list(paths) if rep % 2 == 0 else list(reversed(paths))
        for name in order:
            dist.barrier()
            start = time.perf_counter()
            rows[name] = paths[name]()
            dist.barrier()
            times[name].append(time.perf_counter() - start)
    floor = []
    with torch.no_grad(), torch.autocast("cpu", enabled=False):
        for _ in range(args.reps):
            start = time.perf_counter()
            plain(input_ids=ids[: args.policy_seqs])
            floor.append(time.perf_counter() - start)
    if rank == 0:
        new, old = times["one-gather"], times["per-parameter"]
        harness.say(f"probe on {args.policy_seqs} sequences x {size.seq} tokens per rank, {args.reps} repetitions "
                    f"(paths alternated, each first in turn)")
        for name, ts in times.items():
            harness.say(f"  {name:<14} median {1000 * statistics.median(ts):8.1f} ms   best {1000 * min(ts):8.1f} ms")
        ratio = statistics.median(n / o for n, o in zip(new, old))
        harness.say(f"  one-gather / per-parameter, paired median: {ratio:.2f}x (best: {min(new) / min(old):.2f}x)")
        harness.say(f"  floor: one plain fp32 forward of the same sequences, unsharded: median "
                    f"{1000 * statistics.median(floor):.1f} ms (the probe runs two)")
        harness.say(f"  rows bit-identical between the paths: {torch.equal(rows['one-gather'], rows['per-parameter'])}")
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
