"""The session-15 FSDP2 probe path as an arm beside today's, for benchmarks/step/fsdp2.py and verl_fsdp2.py.

``stochastic + policy probe (per-parameter master)``: the same probe with the master forward run as session 15 ran it
(FSDP's own forward, its bf16 all-gather and cast included, and each parameter's fp32 master gathered alone by
:func:`faircast_plugins.fsdp_policy.full_master`), so before and after are timed in one run, paired per repetition.
"""
from __future__ import annotations

from contextlib import contextmanager

import harness
from trl_plain import PROBE

OLD_PROBE = PROBE + " (per-parameter master)"
OLD_ARM = ("stochastic" + OLD_PROBE, "stochastic", False)


@contextmanager
def per_parameter_master():
    """Inside, :class:`~faircast_plugins.fsdp_policy.FSDPPolicyViews` takes the session-15 master path."""
    from faircast_plugins import fsdp_policy

    original = fsdp_policy._one_gather_blocker
    fsdp_policy._one_gather_blocker = lambda states: "benchmark: the session-15 per-parameter master"
    try:
        yield
    finally:
        fsdp_policy._one_gather_blocker = original


def old_path_step(step):
    """``step`` run on the session-15 master path."""
    def run() -> None:
        with per_parameter_master():
            step()

    return run


def old_path_summary(result: dict, every: int = 10) -> None:
    """The two paths' probe arms against the same stochastic base arm, side by side."""
    rows = {r["arm"]: r for r in result["rows"]}
    base, new, old = rows.get("stochastic"), rows.get("stochastic" + PROBE), rows.get(OLD_ARM[0])
    if not (base and new and old):
        return
    for label, row in (("one fp32 all-gather per group (now)", new), ("per-parameter master (session 15)", old)):
        ratio = row["ratio_median"] / base["ratio_median"]
        probe_ms = row["breakdown_ms"].get("hook: policy probe")
        harness.say(f"  stochastic, {label:<36} {ratio:.2f}x its base arm -> every {every}: "
                    f"{100 * (ratio - 1) / every:+.1f}% of a step" + (f"; probe {probe_ms:.0f} ms instrumented" if
                                                                     probe_ms else ""))


def probe_timers(timers: harness.Timers) -> None:
    """Where the probe's time goes: its forwards (gathers, casts and hooks inside), the per-token stats, and inside
    the forwards the fp32 master gathers, the served widening and FSDP's own all-gathers (these last in the training
    step's forward and backward too)."""
    from torch.distributed.fsdp._fully_shard import _fsdp_param_group

    from faircast_plugins import fsdp_policy, policy_lag

    timers.wrap(policy_lag, "_completion_logits", "probe: forwards (all below inside)")
    timers.wrap(policy_lag, "sequence_stats", "probe: sequence_stats")
    for name, label in (("full_master", "probe: fp32 master gather"), ("_widened", "probe: served widening"),
                        ("gathered_group", "probe: fp32 group gather")):
        if hasattr(fsdp_policy, name):
            timers.wrap(fsdp_policy, name, label)
    timers.wrap(_fsdp_param_group, "foreach_all_gather", "FSDP bf16 all-gather (step and probe)")
    timers.wrap(_fsdp_param_group, "foreach_all_gather_copy_out", "FSDP bf16 all-gather (step and probe)")
