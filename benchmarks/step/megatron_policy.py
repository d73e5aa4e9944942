"""What the ``faircast/policy_*`` probe costs a Megatron-core training step (faircast_plugins/megatron/policy.py).

One process, world 1 (gloo), CPU: a megatron-core GPT (local spec, bf16 params, distributed optimizer) trained by
megatron's own forward-backward schedule, four arms alive at once and timed in turn, the order rotated each
repetition: flag off, stochastic (Fair Cast's patch), and each of them with the probe measuring before every step
(``policy_metrics_every=1`` on the first ``--seqs`` sequences of the batch). Printed side by side: median ms per step,
the paired ratio to the arm without the probe, the probe's ms per measurement, and what it costs a step at
``policy_metrics_every=10`` (the target: <= 2%).

    OMP_NUM_THREADS=1 python benchmarks/step/megatron_policy.py [--smoke] [--reps 7] [--seqs 4] [--batch 8]
        [--breakdown 5]

``--breakdown K``: then K more measurements of the stochastic arm under cProfile, and where a measurement's time
goes (cumulative ms per measurement of the probe's parts: the forwards, the master view, the served widening, the
swap hooks, the statistics; cProfile's own overhead inflates the Python-heavy parts).

Needs megatron-core (tests-megatron's virtualenv); the CPU stand-ins of tests/megatron/cpu_shims.py are installed.
"""
from __future__ import annotations

import argparse
import datetime
import os
import statistics
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

from tests.megatron import cpu_shims  # noqa: E402

cpu_shims.install()

from megatron.core import parallel_state as ps  # noqa: E402
from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig  # noqa: E402
from megatron.core.distributed.finalize_model_grads import finalize_model_grads  # noqa: E402
from megatron.core.models.gpt import GPTModel  # noqa: E402
from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec  # noqa: E402
from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer  # noqa: E402
from megatron.core.pipeline_parallel import get_forward_backward_func  # noqa: E402
from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed  # noqa: E402
from megatron.core.transformer import TransformerConfig  # noqa: E402
from megatron.core.transformer.module import Float16Module  # noqa: E402

from faircast_plugins import FairCastConfig, FairCaster  # noqa: E402
from faircast_plugins.megatron import apply_megatron_patch  # noqa: E402
from faircast_plugins.patching import installed_version  # noqa: E402

SHAPES = {  # hidden, layers, heads, groups, ffn, vocab, batch, seq
    "default": (256, 4, 4, 2, 768, 4096, 8, 64),
    "smoke": (64, 2, 4, 2, 192, 512, 4, 16),
}


def build(shape, faircast: bool, probe: bool, seqs: int):
    hidden, layers, heads, groups, ffn, vocab, _, seq = shape
    model_parallel_cuda_manual_seed(1)
    torch.manual_seed(1)
    config = TransformerConfig(
        num_layers=layers, hidden_size=hidden, num_attention_heads=heads, num_query_groups=groups,
        ffn_hidden_size=ffn, gated_linear_unit=True, activation_func=torch.nn.functional.silu, normalization="RMSNorm",
        add_bias_linear=False, bf16=True, params_dtype=torch.bfloat16, pipeline_dtype=torch.bfloat16,
        use_cpu_initialization=True, hidden_dropout=0.0, attention_dropout=0.0)
    config.finalize_model_grads_func = finalize_model_grads
    gpt = GPTModel(config=config, transformer_layer_spec=get_gpt_layer_local_spec(), vocab_size=vocab,
                   max_sequence_length=seq, position_embedding_type="rope")
    ddp = DistributedDataParallelConfig(grad_reduce_in_fp32=True, use_distributed_optimizer=True)
    model = DistributedDataParallel(config=config, ddp_config=ddp, module=Float16Module(config, gpt))
    optimizer = get_megatron_optimizer(OptimizerConfig(optimizer="adam", lr=1e-4, bf16=True, params_dtype=torch.bfloat16,
                                                       use_distributed_optimizer=True, clip_grad=1.0), [model])
    fc = None
    if faircast or probe:
        cfg = FairCastConfig(enabled=faircast, seed=1, policy_metrics_every=1 if probe else 0,
                             policy_metrics_seqs=seqs)
        fc = apply_megatron_patch(optimizer, FairCaster(cfg), model_chunks=[model], measure_policy=probe)
    return model, optimizer, fc


def batch(shape, step):
    *_, vocab, b, seq = shape
    g = torch.Generator().manual_seed(step)
    ids = torch.randint(0, vocab, (b, seq), generator=g)
    pos = torch.arange(seq).unsqueeze(0).expand(b, -1)
    mask = torch.zeros(b, seq, dtype=torch.long)
    mask[:, seq // 4:] = 1  # a quarter prompt, the rest completion
    return ids, pos, mask


def step(shape, arm, n):
    """One training step of ``arm``; returns (total seconds, probe seconds)."""
    model, optimizer, fc = arm
    ids, pos, mask = batch(shape, n)
    t0 = time.perf_counter()
    probe_s = 0.0
    if fc is not None and fc.policy is not None and fc.policy.due(fc.caster.version):
        fc.policy.measure(fc.caster.version, ids, pos, mask)
        fc.metrics()  # what the trainer logs: the rows gathered and summarised
        probe_s = time.perf_counter() - t0
    model.zero_grad_buffer()
    optimizer.zero_grad()
    labels = torch.roll(ids, -1, dims=1)

    def forward_step(_, m):
        out = m(ids, pos, None, labels=labels)
        return out, lambda o: (o.float().mean(), {})

    get_forward_backward_func()(forward_step_func=forward_step, data_iterator=iter([None]), model=[model],
                                num_microbatches=1, seq_length=ids.shape[1], micro_batch_size=ids.shape[0],
                                forward_only=False)
    optimizer.step()
    return time.perf_counter() - t0, probe_s


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--smoke", action="store_true", help="tiny shapes, 2 repetitions (CI)")
    parser.add_argument("--reps", type=int, default=7)
    parser.add_argument("--seqs", type=int, default=4, help="sequences the probe scores (policy_metrics_seqs)")
    parser.add_argument("--batch", type=int, default=None, help="sequences per step (default 8; smoke 4)")
    parser.add_argument("--breakdown", type=int, default=0, help="measurements profiled after the timing (0: none)")
    args = parser.parse_args()
    shape = SHAPES["smoke" if args.smoke else "default"]
    if args.batch:
        shape = (*shape[:6], args.batch, shape[7])
    reps = 2 if args.smoke else args.reps
    store = tempfile.mktemp(prefix="faircast_bench_store_")
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=0, world_size=1,
                            timeout=datetime.timedelta(seconds=300))
    ps.initialize_model_parallel()
    labels = ["flag off", "stochastic", "flag off + policy probe", "stochastic + policy probe"]
    arms = {label: build(shape, "stochastic" in label, "probe" in label, args.seqs) for label in labels}
    for label in labels:  # warm-up
        step(shape, arms[label], 0)
    times = {label: [] for label in labels}
    probes = {label: [] for label in labels}
    for rep in range(reps):
        order = labels[rep % len(labels):] + labels[:rep % len(labels)]
        for label in order:
            total, probe_s = step(shape, arms[label], rep + 1)
            times[label].append(total)
            probes[label].append(probe_s)
    hidden, layers, _, _, _, vocab, b, seq = shape
    n_params = sum(p.numel() for p in arms["flag off"][0].parameters())
    print(f"faircast step bench: Megatron-core {installed_version('megatron-core')} policy probe, world 1 (gloo, CPU), "
          f"torch {torch.__version__}, {torch.get_num_threads()} thread(s), {os.cpu_count()} logical CPUs")
    print(f"GPT (local spec) {n_params / 1e6:.1f}M params (hidden {hidden}, {layers} layers, vocab {vocab}), batch "
          f"{b}x{seq}, distributed optimizer; probe: {args.seqs} sequences x {seq} tokens, two fp32 forwards; "
          f"{reps} repetitions")
    print(f"{'arm':28s} {'ms med':>9s} {'ratio':>7s} {'probe ms':>9s}  (ratio: paired median over repetitions, to "
          f"the arm without the probe / to flag off)")
    for label in labels:
        base = label.replace(" + policy probe", "") if "probe" in label else "flag off"
        ratio = statistics.median(t / u for t, u in zip(times[label], times[base]))
        probe_ms = statistics.median(probes[label]) * 1e3 if "probe" in label else float("nan")
        print(f"{label:28s} {statistics.median(times[label]) * 1e3:9.1f} {ratio:6.3f}x {probe_ms:9.1f}")
    for label in ("flag off + policy probe", "stochastic + policy probe"):
        base = label.replace(" + policy probe", "")
        probe_ms = statistics.median(probes[label]) * 1e3
        step_ms = statistics.median(times[base]) * 1e3
        print(f"  {base:12s} probe {probe_ms:.1f} ms per measurement = {probe_ms / step_ms:.2f} steps -> every 10: "
              f"+{100 * probe_ms / step_ms / 10:.1f}% of a step (target <= 2%)")
    for label in ("flag off + policy probe", "stochastic + policy probe"):  # the least-disturbed repetition
        base = label.replace(" + policy probe", "")
        probe_ms, step_ms = min(probes[label]) * 1e3, min(times[base]) * 1e3
        print(f"  {base:12s} by minima (a loaded machine's least-disturbed repetition): probe {probe_ms:.1f} ms, step "
              f"{step_ms:.1f} ms -> every 10: +{100 * probe_ms / step_ms / 10:.1f}% of a step")
    if args.breakdown:
        breakdown(shape, arms["stochastic + policy probe"], args.breakdown)
    ps.destroy_model_parallel()
    dist.destroy_process_group()


#: (label, qualified name suffix of the function whose cumulative time it is) for --breakdown
PARTS = [
    ("both views' forwards (swaps + views included)", "policy.py:_logits"),
    ("  master view (MasterView.__call__)", "policy.py:__call__"),
    ("  served view (widened)", "policy_lag.py:widened"),
    ("  swap pre-hooks (views included)", "policy_lag.py:pre"),
    ("  swap post-hooks", "policy_lag.py:post"),
    ("statistics (vocab_parallel_sequence_stats)", "policy_lag.py:vocab_parallel_sequence_stats"),
    ("statistics (sequence_stats: TP 1)", "policy_lag.py:sequence_stats"),
    ("counted positions (packing)", "policy.py:counted_positions"),
    ("metrics (gather + summary)", "policy.py:metrics"),
]


def breakdown(shape, arm, k):
    """Where a measurement's time goes: ``k`` measurements of ``arm``'s probe under cProfile."""
    import cProfile
    import pstats

    _, _, fc = arm
    ids, pos, mask = batch(shape, 1000)
    profile = cProfile.Profile()
    t0 = time.perf_counter()
    for n in range(k):
        profile.enable()
        fc.policy.measure(10_000 + n, ids, pos, mask)
        fc.metrics()
        profile.disable()
    total = (time.perf_counter() - t0) / k * 1e3
    cumulative = {}
    for (path, _, name), (_, _, _, ct, _) in pstats.Stats(profile).stats.items():
        key = f"{os.path.basename(path)}:{name}"
        cumulative[key] = cumulative.get(key, 0.0) + ct
    print(f"breakdown of one measurement (stochastic arm, {k} measurements under cProfile): {total:.1f} ms")
    for label, key in PARTS:
        if key in cumulative:
            print(f"  {label:48s} {cumulative[key] / k * 1e3:8.1f} ms")


if __name__ == "__main__":
    main()
