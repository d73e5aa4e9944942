"""The DeepSpeed copy-back follows the Fair Cast contract under every ZeRO stage, offload and world size.

Real DeepSpeed 0.19 on CPU (gloo), a tiny bf16 model whose weights sit where half a bf16 step (~1e-3) is
far above what Adam at lr 2e-5 moves in 6 steps. ``ds_worker.py`` trains it and records, after every
step, the full fp32 masters and the full bf16 weights (what OpenRLHF's ``broadcast_to_vllm`` sends).
"""
from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

from faircast_plugins import FairCastConfig, FairCaster, derive_key, fair_cast, sticky_key

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
import ds_worker  # noqa: E402

SR_CONFIGS = ["z0", "z0_fused", "bf16opt", "z1", "z2", "z2_offload", "z3", "z3_offload"]
OFF_CONFIGS = ["z0", "z2", "z3"]
EF_CONFIGS = ["z2", "z3"]
EMA_CONFIGS = SR_CONFIGS
WORLDS = [1, 2]
SCENARIOS = (
    [f"{c}:stochastic" for c in SR_CONFIGS] + [f"{c}:off" for c in OFF_CONFIGS] + [f"{c}:error_feedback" for c in EF_CONFIGS]
    + [f"{c}:ema" for c in EMA_CONFIGS] + ["z3:sticky"]
)
FAILURE_DRILLS = ["z2:partial", "z3:partial", "z2:nothing"]  # ds_worker.run_failure


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """{(config, mode, world, rank): record}, from one worker process group per world size."""
    out = {}
    for world in WORLDS:
        d = tmp_path_factory.mktemp(f"ds_world{world}")
        proc = subprocess.run(
            [sys.executable, os.path.join(HERE, "ds_worker.py"), str(d), str(world), *SCENARIOS, *FAILURE_DRILLS],
            capture_output=True, text=True, env={**os.environ, "DS_ACCELERATOR": "cpu"}, timeout=900,
        )
        assert proc.returncode == 0, f"DeepSpeed worker (world {world}) failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-6000:]}"
        for scenario in SCENARIOS + FAILURE_DRILLS:
            name, mode = scenario.split(":")
            for rank in range(world):
                out[(name, mode, world, rank)] = torch.load(d / f"{name}-{mode}.rank{rank}.pt", weights_only=False)
    return out


def bits(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(torch.int16)


def expected_sr(masters: dict, version: int, mode: str = "stochastic") -> dict:
    def key(n):
        return sticky_key(ds_worker.SEED, n) if mode == "sticky" else derive_key(ds_worker.SEED, version, n)

    return {n: fair_cast(m.contiguous(), key=key(n), mode=mode) for n, m in masters.items()}


def assert_same_bits(a: dict, b: dict, what: str) -> None:
    assert a.keys() == b.keys()
    for n in a:
        diff = int((bits(a[n]) != bits(b[n])).sum())
        assert diff == 0, f"{what}: {n} differs in {diff} of {a[n].numel()} elements"


@pytest.mark.parametrize("world", WORLDS)
@pytest.mark.parametrize("config,mode", [(c, "stochastic") for c in SR_CONFIGS] + [("z3", "sticky")])
def test_served_copy_is_fair_cast_of_master(runs, config, mode, world):
    """After every step, the bf16 weights equal fair_cast(fp32 master) at that weight version, bit for bit
    (sticky: under its version-free key)."""
    for rank in range(world):
        rec = runs[(config, mode, world, rank)]
        assert rec["versions"] == list(range(1, ds_worker.STEPS + 1))
        for step, (masters, served) in enumerate(zip(rec["masters"], rec["served"]), start=1):
            assert_same_bits(served, expected_sr(masters, step, mode), f"{config} world {world} rank {rank} step {step}")
        # Fair Cast follows the master: some elements moved to the next bf16 value even though every update
        # was far below half a bf16 step.
        changed = sum(int((bits(rec["served"][-1][n]) != bits(rec["initial"][n])).sum()) for n in rec["initial"])
        assert changed > 0


def _same_masters(a: dict, b: dict) -> bool:
    return all(torch.equal(x[n], y[n]) for x, y in zip(a["masters"], b["masters"]) for n in x)


# Runs expected to train bit-identical fp32 masters (same batch on every rank). The groups differ for DeepSpeed's
# reasons, not Fair Cast's (same with Fair Cast off):
# - ZeRO-0: both of its wrappers (FP16_UnfusedOptimizer, FP16_Optimizer) run one Adam step on zero gradients when
#   they are built (initialize_optimizer_states), so Adam's step count, hence its bias correction, is one ahead:
#   the first real update is ~0.745 * lr instead of lr, in every element.
# - ZeRO-3: its engine replaces torch.nn.functional.linear with LinearFunctionForZeroStage3 (matmul, then the bias
#   added in bf16): other bf16 roundings, other gradients. It does so process-wide; ds_worker restores torch's
#   linear before each scenario so that no later scenario inherits it.
# z0 and z0_fused once differed in the last bits of model.norm.* from step 3 on (AVX-512 host, numba cast backend):
# the first Fair Cast cast raised torch's thread count from 1 to 2 (numba's OpenMP pool start), so the first run of
# the worker computed its step-1 bf16 LayerNorm gradients with 1 thread and every later run with 2 (other reduction
# order, gradients a few bf16 ulps apart). Fixed in the cpu backend (tests/core/test_cpu_cast.py); checked here by
# test_every_step_ran_on_the_thread_count_the_worker_set and by z0 == z0_fused below.
MASTER_GROUPS = [["z1", "z2", "z2_offload", "bf16opt"], ["z0", "z0_fused"], ["z3", "z3_offload"]]


def test_every_step_ran_on_the_thread_count_the_worker_set(runs):
    """ds_worker sets torch.set_num_threads(1); no Fair Cast cast may change it (it once did, see MASTER_GROUPS)."""
    for (config, mode, world, rank), rec in runs.items():
        if "threads" in rec:
            assert rec["threads"] == [1] * ds_worker.STEPS, f"{config}:{mode} world {world} rank {rank}: {rec['threads']}"


@pytest.mark.parametrize("mode", ["stochastic", "ema"])
def test_negative_control_master_groups_differ(runs, mode):
    """The master comparison below can fail: it tells the groups apart."""
    firsts = [(g[0], runs[(g[0], mode, 1, 0)]) for g in MASTER_GROUPS]
    for i, (name_a, a) in enumerate(firsts):
        for name_b, b in firsts[i + 1:]:
            assert not _same_masters(a, b), f"{name_a} and {name_b} trained the same masters"


@pytest.mark.parametrize("mode", ["stochastic", "ema"])
@pytest.mark.parametrize("group", MASTER_GROUPS, ids=lambda g: "+".join(g))
def test_served_copy_identical_across_stages_offload_and_world_sizes(runs, group, mode):
    """Same masters -> same served bits, whatever the stage, the offload, the world size or the rank."""
    ref = runs[(group[0], mode, 1, 0)]
    for world in WORLDS:
        for config in group:
            for rank in range(world):
                got = runs[(config, mode, world, rank)]
                assert _same_masters(got, ref), f"{config} world {world} trained other masters than {group[0]} world 1"
                for step in range(ds_worker.STEPS):
                    assert_same_bits(got["served"][step], ref["served"][step],
                                     f"{config} world {world} rank {rank} step {step + 1} vs {group[0]} world 1")


@pytest.mark.parametrize("world", WORLDS)
@pytest.mark.parametrize("config", OFF_CONFIGS)
def test_negative_control_flag_off_is_round_to_nearest_and_lags(runs, config, world):
    rec = runs[(config, "off", world, 0)]
    masters, served = rec["masters"][-1], rec["served"][-1]
    rtn = {n: m.to(torch.bfloat16) for n, m in masters.items()}
    assert_same_bits(served, rtn, f"{config} world {world} (Fair Cast off) vs round-to-nearest")
    # The served copy visibly lags: every master moved, yet no bf16 weight changed in 6 steps.
    moved = sum(int((m != rec["masters"][0][n]).sum()) for n, m in masters.items())
    assert moved > 0
    assert_same_bits(served, rec["initial"], f"{config} world {world}: round-to-nearest copy should not have moved")
    # ... while Fair Cast on the same masters gives a different copy.
    sr = expected_sr(masters, ds_worker.STEPS)
    assert any(not torch.equal(bits(sr[n]), bits(served[n])) for n in served)


@pytest.mark.parametrize("world", WORLDS)
@pytest.mark.parametrize("config", EF_CONFIGS)
def test_error_feedback_matches_the_reference_recursion(runs, config, world):
    """EF residuals live per ZeRO partition; the served copy must equal the recursion on the full masters."""
    rec = runs[(config, "error_feedback", world, 0)]
    residual = {n: torch.zeros_like(m) for n, m in rec["masters"][0].items()}
    for step, (masters, served) in enumerate(zip(rec["masters"], rec["served"]), start=1):
        want = {n: fair_cast(m.contiguous(), key=0, mode="error_feedback", residual=residual[n]) for n, m in masters.items()}
        assert_same_bits(served, want, f"EF {config} world {world} step {step}")


@pytest.mark.parametrize("world", WORLDS)
@pytest.mark.parametrize("config,mode", [(c, m) for m in ("stochastic", "error_feedback", "ema") for c in ("z2", "z3")]
                         + [("z3", "sticky")])
def test_checkpoint_resume_reproduces_the_served_copies(runs, config, mode, world):
    """Save after step 3, resume in a fresh engine (Fair Cast attached after the load, as OpenRLHF does)."""
    for rank in range(world):
        rec = runs[(config, mode, world, rank)]
        assert rec["resumed_version"] == 3
        for i, got in enumerate(rec["resumed"]):
            assert_same_bits(got, rec["served"][3 + i], f"{config} {mode} world {world} rank {rank} resumed step {4 + i}")


def test_zero3_persistent_params_hold_their_gathered_partitions(runs):
    """Right after every ZeRO-3 step, the full copy DeepSpeed keeps of each small ("persistent") parameter, which
    is what gets read and served, is the all-gather of its partitions, where the copy-back casts.

    Regression check: DeepSpeed on gloo can return from step() with a persistent parameter's all-gather still in
    flight (its data an unwritten buffer); ds_worker.train_step waits for it. The check itself is shown able to
    fail: it flags a persistent parameter whose data the worker corrupted on purpose. World 2 only: at world 1
    the full data is the partition itself (no gather).
    """
    world = 2
    scenarios = [s.split(":") for s in SCENARIOS if s.split(":")[0] in ("z3", "z3_offload")]
    for config, mode in scenarios:
        for rank in range(world):
            rec = runs[(config, mode, world, rank)]
            what = f"{config}:{mode} world {world} rank {rank}"
            assert "model.proj.bias" in rec["persistent_names"], f"{what}: no persistent parameter to check"
            control = rec["persistent_check_control"]
            assert control["flagged"] == [control["corrupted"]], f"{what}: the check missed corrupted data: {control}"
            assert len(rec["persistent_mismatches"]) == ds_worker.STEPS
            checks = [(f"step {i + 1}", bad) for i, bad in enumerate(rec["persistent_mismatches"])]
            checks += [(f"resumed step {i + 4}", bad) for i, bad in enumerate(rec["resumed_persistent_mismatches"])]
            for when, bad in checks:
                assert not bad, f"{what} {when}: full data of {bad} is not the all-gather of its partitions"


def test_audit_metrics_are_reported(runs):
    metrics = runs[("z2", "stochastic", 1, 0)]["metrics"]
    assert metrics[0]["faircast/version"] == 1.0
    later = metrics[-1]
    for key in ("faircast/served_changed_frac", "faircast/master_moved_frac", "faircast/lag_steps"):
        assert key in later, later
    assert later["faircast/master_moved_frac"] > 0.5


@pytest.mark.parametrize("world", WORLDS)
@pytest.mark.parametrize("mode", ["stochastic", "error_feedback", "ema"])
def test_weights_right_after_resume(runs, mode, world):
    """What a resume broadcast sends is the Fair Cast copy of the saved version. ZeRO-2 restores the saved bits;
    ZeRO-3 re-derives bf16 from the masters on load (round-to-nearest), which the patch casts again."""
    for config in ("z2", "z3"):
        for rank in range(world):
            rec = runs[(config, mode, world, rank)]
            assert_same_bits(rec["resumed_initial"], rec["served"][2], f"{config} {mode} world {world} rank {rank} after resume")


def expected_ema(rec: dict) -> list:
    """A single-process FairCaster with the same EMA, run on the full masters: the served copy after each step.

    The EMA starts at the master of version 0, which is exactly the initial bf16 weights (DeepSpeed builds its
    fp32 masters from them)."""
    ref = FairCaster(FairCastConfig(enabled=True, mode="stochastic", seed=ds_worker.SEED, ema_decay=ds_worker.EMA_DECAY))
    ref.cast_many({n: w.float() for n, w in rec["initial"].items()})  # version 0: the EMA starts at the master
    out = []
    for masters in rec["masters"]:
        ref.advance(masters)
        out.append({n: ref.cast(n, m.contiguous()) for n, m in masters.items()})
    return out


@pytest.mark.parametrize("world", WORLDS)
@pytest.mark.parametrize("config", EMA_CONFIGS)
def test_ema_serves_fair_cast_of_the_ema_of_the_master(runs, config, world):
    """ema_decay: each rank keeps the EMA of its own partition; the served copy equals fair_cast(EMA of the full
    master) of the reference, bit for bit, on every rank after every step. Negative control: that is not
    fair_cast(master), which ema_decay=0 serves."""
    for rank in range(world):
        rec = runs[(config, "ema", world, rank)]
        assert rec["versions"] == list(range(1, ds_worker.STEPS + 1))
        want = expected_ema(rec)
        for step, (served, expected) in enumerate(zip(rec["served"], want), start=1):
            assert_same_bits(served, expected, f"EMA {config} world {world} rank {rank} step {step}")
        differs = [sum(int((bits(s[n]) != bits(e[n])).sum()) for n in s)
                   for s, e in zip(rec["served"], (expected_sr(m, v) for v, m in enumerate(rec["masters"], start=1)))]
        assert all(d > 0 for d in differs), f"the EMA copy should differ from fair_cast(master): {differs}"
        # The master is still what the optimizer trains: it moved, and the served copy follows its EMA.
        assert any(not torch.equal(m, rec["masters"][0][n]) for n, m in rec["masters"][-1].items())
        changed = sum(int((bits(rec["served"][-1][n]) != bits(rec["initial"][n])).sum()) for n in rec["initial"])
        assert changed > 0


def test_ema_run_reports_the_audit_metrics(runs):
    metrics = runs[("z3", "ema", 2, 1)]["metrics"]
    assert [m["faircast/version"] for m in metrics] == [float(v) for v in range(1, ds_worker.STEPS + 1)]
    for key in ("faircast/served_changed_frac", "faircast/master_moved_frac", "faircast/lag_steps"):
        assert key in metrics[-1], metrics[-1]


@pytest.mark.parametrize("world", WORLDS)
@pytest.mark.parametrize("drill", FAILURE_DRILLS)
def test_a_copy_back_outside_fair_cast_fails_on_every_rank(runs, drill, world):
    """Each step must cast exactly the elements this rank's copy-back writes (ZeRO-3 NVMe swaps and any other path
    Fair Cast does not see would leave them round-to-nearest). The last rank writes half (``partial``) or all
    (``nothing``) of its copy-back outside Fair Cast: every rank raises (a collective check, so none hangs in
    DeepSpeed's next collective) and the version stays at the last step taken. The same steps without the drill
    cast exactly the expected count (test_served_copy_is_fair_cast_of_master)."""
    config, mode = drill.split(":")
    last = world - 1
    for rank in range(world):
        rec = runs[(config, mode, world, rank)]
        what = f"{drill} world {world} rank {rank}"
        assert rec["error"] is not None, f"{what}: the step passed"
        assert rec["version"] == 0, f"{what}: the failed step advanced the version"
        if rank == last and mode == "partial":
            assert "but this rank owns" in rec["error"], f"{what}: {rec['error']}"
        elif rank == last:
            assert "none into the model's weights" in rec["error"], f"{what}: {rec['error']}"
        else:
            assert f"failed on rank(s) [{last}]" in rec["error"], f"{what}: {rec['error']}"
