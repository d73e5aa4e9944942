"""DeepSpeed ZeRO-2 / ZeRO-3 at 2 gloo ranks on CPU: what ``faircast: true`` costs one step (TRL and OpenRLHF).

TRL's DeepSpeed backend and OpenRLHF's policy both attach Fair Cast the same way: ``apply_deepspeed_patch`` on the
policy's engine, which makes DeepSpeed's fp32 -> bf16 copy-back after each optimizer step write the served copy.
Each arm is a real ``deepspeed.initialize`` engine (bf16, torch's AdamW: no C++ op) on the same random Qwen3; a
step is ``engine(ids)`` -> loss, ``engine.backward``, ``engine.step()``, then the weight sync a vLLM engine
receives (each parameter, gathered under ZeRO-3, copied out in bf16, as OpenRLHF's broadcast reads it).

    python benchmarks/step/deepspeed_zero.py --stage 2 [--smoke] [--reps N] [--world 2] [--policy-seqs K]

``--policy-seqs K`` adds "flag off + policy probe" and "stochastic + policy probe": before every step the
``faircast/policy_*`` probe scores K sequences of the rank's batch the way OpenRLHF's policy actor does
(:mod:`faircast_plugins.openrlhf.policy_probe`: the DeepSpeed views of :mod:`faircast_plugins.deepspeed.policy_views`,
positions from the mask, every rank as many forwards; TRL's DeepSpeed backend runs the same views). Probe arm / base
arm - 1, divided by N, is its cost per step at ``policy_metrics_every: N`` (printed for N = 10).
"""
from __future__ import annotations

import importlib
import os
import sys
from contextlib import contextmanager

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import harness  # noqa: E402

os.environ.setdefault("DS_ACCELERATOR", "cpu")  # before DeepSpeed is imported
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import torch  # noqa: E402

MEM_TARGET = 0.0  # B/param for stochastic/sticky (issue #21)


def ds_config(stage: int, size: harness.Size) -> dict:
    return {
        "train_micro_batch_size_per_gpu": size.batch, "gradient_accumulation_steps": 1, "gradient_clipping": 1.0,
        "bf16": {"enabled": True}, "steps_per_print": 10**9, "wall_clock_breakdown": False,
        "zero_optimization": {"stage": stage, "stage3_param_persistence_threshold": 10_000},
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-4, "weight_decay": 0.0, "torch_adam": True}},
    }


def _tensors_of(obj, depth: int = 3):
    """Every tensor in an object's attributes and containers, a few levels down (the optimizer's flat buffers)."""
    out, seen = [], set()

    def walk(o, d):
        if id(o) in seen or d > depth:
            return
        seen.add(id(o))
        if isinstance(o, torch.Tensor):
            out.append(o)
        elif isinstance(o, dict):
            for v in o.values():
                walk(v, d + 1)
        elif isinstance(o, (list, tuple)):
            for v in o:
                walk(v, d + 1)
        elif hasattr(o, "__dict__") and not isinstance(o, (torch.nn.Module, type)) and d < depth:
            for v in vars(o).values():
                walk(v, d + 1)

    walk(obj, 0)
    return out


#: the probe arm that runs session 15's views (one collective per parameter; ZeRO-3 inside DeepSpeed's gathers)
LEGACY = " (per-parameter views)"


@contextmanager
def per_parameter_views(on: bool):
    """Inside (``on``), the DeepSpeed policy views fall back to session 15's: no windowed layout is found."""
    from faircast_plugins.deepspeed import master_windows

    original = master_windows.layout_of
    if on:
        master_windows.layout_of = lambda optimizer: None
    try:
        yield
    finally:
        master_windows.layout_of = original


def make_arm_factory(stage: int, size: harness.Size, backend: str, policy_seqs: int = 0):
    from types import SimpleNamespace

    import deepspeed

    from faircast_plugins import FairCastConfig, FairCaster
    from faircast_plugins.deepspeed import apply_deepspeed_patch
    from faircast_plugins.openrlhf import policy_probe

    ids = harness.batch(size, seed=1 + torch.distributed.get_rank())

    from trl_plain import PROBE

    def make(label: str, mode, audit: bool) -> harness.Arm:
        probe = label.endswith(PROBE)
        model = harness.build_model(size).to(torch.bfloat16)
        params = harness.count_params(model)
        with harness.quiet_logs():
            engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(),
                                              config=ds_config(stage, size))
        config = FairCastConfig(enabled=mode is not None, mode=mode or "stochastic", audit=audit, seed=1234,
                                backend=backend, policy_metrics_every=1 if probe else 0,
                                policy_metrics_seqs=max(1, policy_seqs))
        caster = FairCaster(config)
        caster.policy_measured = probe  # as the adapters do when they attach the probe
        with harness.quiet_logs():
            fc = apply_deepspeed_patch(engine, caster)
        named = list(engine.module.named_parameters())
        sent = {}
        prompt = max(1, size.seq // 4)
        experience = SimpleNamespace(sequences=ids, attention_mask=torch.ones_like(ids),
                                     action_mask=torch.ones_like(ids[:, prompt:]))
        if probe:
            policy_probe.attach(SimpleNamespace(model=engine, is_vlm=False), config)

        def step() -> None:
            if probe:  # what OpenRLHF's wrapped training_step does on a due step, before the update
                with per_parameter_views(LEGACY in label):
                    policy_probe.measure(engine, experience, 1.0)
                policy_probe.take_metrics(engine)
            loss = harness.lm_loss(engine, ids)
            engine.backward(loss)
            engine.step()
            with torch.no_grad():
                for name, p in named:
                    with deepspeed.zero.GatheredParameters([p], enabled=stage == 3):
                        sent[name] = p.data.to(torch.bfloat16, copy=True)  # what the engine broadcasts to vLLM
            sent.clear()

        def state_bytes():
            if fc is None:
                return {}
            exclude = harness.model_storages(engine.module)
            exclude.update(harness.storages(_tensors_of(engine.optimizer)))
            return harness.fair_cast_bytes({"engine._faircast": fc}, exclude)

        arm = harness.Arm(label, mode, audit, step=step, state_bytes=state_bytes, params=params)
        arm.fc = fc
        return arm

    return make


def hooks(timers: harness.Timers, arm: harness.Arm) -> None:
    from faircast_plugins.deepspeed import patch
    from faircast_plugins.openrlhf import policy_probe

    if arm.label.endswith(" + policy probe"):
        probe_breakdown(timers)
    if arm.fc is None:
        return
    timers.wrap(patch._CopyBackInterceptor, "copy_", "hook: copy-back copy_ (cast + copies)")
    timers.wrap(patch, "_copy_back_problem", "hook: copy-back check")
    timers.wrap(patch, "_on_any_rank", "hook: check all-reduce")
    timers.wrap(patch.WeightLayout, "of_engine", "hook: weight layout")
    timers.wrap(patch.DeepSpeedFairCast, "take_model_step", "hook: whole take_model_step (incl. optimizer)")


def probe_breakdown(timers: harness.Timers) -> None:
    """The probe's parts: its whole measurement, the forwards (which include the views, the swap hooks and, under
    ZeRO-3, DeepSpeed's bf16 gathers), the master view (assembling DeepSpeed's fp32 partitions, collectives
    included), the served view (widening), the per-sequence statistics; and DeepSpeed ZeRO-3's module fetches (of
    the whole step: compare with the arm without the probe)."""
    from faircast_plugins import policy_lag
    from faircast_plugins.deepspeed import policy_views
    from faircast_plugins.openrlhf import policy_probe

    timers.wrap(policy_probe, "measure", "hook: policy probe")
    timers.wrap(policy_lag, "_completion_logits", "probe: forwards (incl. views, hooks, ZeRO-3 gathers)")
    timers.wrap(policy_lag, "sequence_stats", "probe: sequence_stats")
    timers.wrap(policy_views, "served_view", "probe: served view (widening)")
    if hasattr(policy_views, "master_view"):  # the per-parameter view (session 15)
        timers.wrap(policy_views, "master_view", "probe: master view (per-parameter assembly)")
    try:  # the windowed assembly
        from faircast_plugins.deepspeed import master_windows
    except ImportError:
        master_windows = None
    if master_windows is not None:
        timers.wrap(master_windows.MasterWindows, "__call__", "probe: master view (windows: loads + slices)")
        timers.wrap(master_windows.Zero12Layout, "load", "probe: master window loads (ZeRO-1/2 broadcasts)")
        timers.wrap(master_windows.Zero3Layout, "load", "probe: master window loads (ZeRO-3 all-gathers)")
    try:
        from deepspeed.runtime.zero.partitioned_param_coordinator import PartitionedParameterCoordinator
    except ImportError:
        return
    timers.wrap(PartitionedParameterCoordinator, "fetch_sub_module", "zero3: fetch_sub_module (whole step)")


def compare_summary(result: dict, every: int = 10) -> None:
    """Windowed vs per-parameter views in the same run: each probe arm's cost at ``every`` against stochastic, and
    the probe's own instrumented time per measurement."""
    from trl_plain import PROBE

    rows = {r["arm"]: r for r in result["rows"]}
    base = rows.get("stochastic")
    if base is None:
        return
    harness.say(f"\nviews side by side (same run; paired median ratios against 'stochastic'; cost per step at every={every})")
    for label in ("stochastic" + PROBE, "stochastic" + LEGACY + PROBE):
        row = rows.get(label)
        if row is None:
            continue
        ratio = row["ratio_median"] / base["ratio_median"]
        probe_ms = (row.get("breakdown_ms") or {}).get("hook: policy probe")
        extra = f", probe {probe_ms:.0f} ms instrumented" if probe_ms is not None else ""
        harness.say(f"  {label:<50} {ratio:.2f}x -> +{(ratio - 1) / every * 100:.1f}% of a step{extra}")


def main() -> int:
    harness.reexec_for_rss()
    parser = harness.arguments(__doc__.split("\n")[0])
    parser.add_argument("--stage", type=int, choices=(2, 3), default=2)
    parser.add_argument("--world", type=int, default=2, help="local gloo ranks (default 2)")
    parser.add_argument("--policy-seqs", type=int, default=0,
                        help="also time the faircast/policy_* probe on this many sequences per rank and step (arms "
                             "'flag off + policy probe', 'stochastic + policy probe')")
    parser.add_argument("--policy-compare", action="store_true",
                        help="with --policy-seqs: also the arm 'stochastic (per-parameter views) + policy probe', "
                             "session 15's views (one collective per parameter, ZeRO-3 inside DeepSpeed's gathers), "
                             "side by side with today's windowed views")
    args = parser.parse_args()
    harness.as_ranks(args.world)
    size = harness.settle(args)
    import deepspeed

    importlib.import_module("deepspeed.comm.torch").build_shm_op = lambda: None  # a JIT C++ build gloo never uses
    deepspeed.init_distributed(dist_backend="gloo")
    path = f"DeepSpeed ZeRO-{args.stage}, {args.world} gloo ranks (TRL and OpenRLHF: apply_deepspeed_patch)"
    params = harness.count_params(harness.build_model(size))
    harness.header(path, size, params, args, extra=f"deepspeed {deepspeed.__version__}")
    from trl_plain import PROBE, policy_summary

    if args.policy_seqs:
        harness.ALL_ARMS.extend([("flag off" + PROBE, None, False), ("stochastic" + PROBE, "stochastic", False)])
        if args.arms:
            args.arms += f",flag off{PROBE},stochastic{PROBE}"
        if args.policy_compare:
            harness.ALL_ARMS.append(("stochastic" + LEGACY + PROBE, "stochastic", False))
            if args.arms:
                args.arms += f",stochastic{LEGACY}{PROBE}"
    result = harness.measure(path, make_arm_factory(args.stage, size, args.backend, args.policy_seqs), hooks, params,
                             args, mem_target=MEM_TARGET)
    if args.policy_seqs and torch.distributed.get_rank() == 0:
        policy_summary(result, args.policy_seqs, size)
        if args.policy_compare:
            compare_summary(result)
    torch.distributed.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
