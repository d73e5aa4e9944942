"""Issue 14, verl items 1-7: every path where Fair Cast could silently not take effect is either made to follow
the contract or refused at activation, each with a test that failed before the fix.

1. decoupled PPO (fully-async / v1 separate-async: old fp32 masters restored for the old log-probs);
2. a worker that did not load the plugin (the driver checks every worker's ``init_model`` answer);
3. ``rollout.quantization`` (fp8 accepted, others refused); 4. a skipped optimizer step (non-finite grad norm) keeps the version;
5. restored EMA / error-feedback state moves to the master's device once; 6. merged LoRA is an explicit opt-in;
7. verl's Fair Cast checkpoint goes through ``export.save_state`` (CPU tensors, shard layout, mergeable).
"""
from __future__ import annotations

import types

import pytest
import torch
from omegaconf import OmegaConf

from faircast_plugins import FairCaster, FairCastConfig, derive_key, fair_cast
from faircast_plugins.verl.config import check_supported, read_faircast

from .conftest import SEED
from .harness import compose, cpu_overrides
from .test_worker_stateful import EF, EMA, reference

SR = FairCastConfig(enabled=True, seed=SEED)


def bits(t: torch.Tensor) -> torch.Tensor:
    assert t.dtype == torch.bfloat16, t.dtype
    return t.view(torch.int16)


# -- 1. decoupled PPO -------------------------------------------------------------------------------------------

DECOUPLED = [(1, "fsdp2_decoupled", SR), (2, "fsdp_ef_decoupled", EF), (3, "fsdp2_ema_decoupled", EMA)]


@pytest.mark.parametrize("world, case, config", DECOUPLED, ids=[f"{c}-world{w}" for w, c, _ in DECOUPLED])
def test_decoupled_ppo_old_log_probs_use_the_copy_served_at_that_version(worker_runs, world, case, config):
    """verl's DetachActorWorker: version 0 is synced to the rollout and saved as pi_old; after two optimizer steps
    pi_old's masters are restored for the old log-probs, then the current ones. The old log-probs must run on the
    bits the rollout was served at version 0, and training then goes on exactly as without the detour."""
    _, runs = worker_runs(world)
    results = runs[case]
    r0 = results[0]
    served_v0, straight = r0["exported_v0"], reference(r0, config)
    assert r0["version"] == 2 and set(served_v0) == set(straight[0])
    for name, q in straight[0].items():
        assert torch.equal(bits(served_v0[name]), bits(q)), f"version-0 export of {name}"
        for r in results:
            assert torch.equal(bits(r["forward_old"][name]), bits(q)), f"rank {r['rank']}: old log-probs of {name}"
    for name, q in straight[2].items():  # the current version is untouched by the restore
        assert torch.equal(bits(r0["exported"][name]), bits(q)), f"export of {name} at version 2"
        for r in results:
            assert torch.equal(bits(r["forward"][name]), bits(q)), f"rank {r['rank']} forward of {name} at v2"
    # control: the restored masters cast at the current version (what the caster did before) are another copy
    stale = {n: fair_cast(m, key=derive_key(SEED, 2, n)) for n, m in r0["masters_v0"].items()}
    assert any(not torch.equal(bits(stale[n]), bits(q)) for n, q in served_v0.items())


# -- 2. every worker must have loaded Fair Cast -----------------------------------------------------------------


class _Group:
    """The parts of a verl worker group that method binding uses; ``answers`` are what each worker returns."""

    def __init__(self, answers, config=None):
        self.answers, self.world_size = answers, len(answers)
        self.ray_cls_with_init = types.SimpleNamespace(kwargs={"config": config} if config is not None else {})

    def execute_all(self, method_name, *args, **kwargs):
        return list(self.answers)

    def __getattr__(self, name):  # the other execute modes of the worker's methods (only init_model is called)
        if name.startswith("execute_"):
            return self.execute_all
        raise AttributeError(name)


def _bound_init_model(answers, config=None):
    """``init_model`` bound on a worker group the way verl's driver binds it (``WorkerGroup._bind_worker_method``
    with dispatch, execute and collect; no Ray)."""
    import verl.workers.engine_workers as workers
    from verl.single_controller.base.worker_group import WorkerGroup

    def generate(group, method_name, dispatch_fn, collect_fn, execute_fn, blocking):
        def call(*args, **kwargs):
            args, kwargs = dispatch_fn(group, *args, **kwargs)
            return collect_fn(group, execute_fn(method_name, *args, **kwargs))

        return call

    group = _Group(answers, config)
    WorkerGroup._bind_worker_method(group, workers.ActorRolloutRefWorker, generate)
    return group.init_model


def test_workers_report_their_activation(worker_runs):
    _, runs = worker_runs(2)
    for r in runs["fsdp2_on"]:
        assert r["init_status"] == {"faircast_status": {"requested": True, "active": True, "role": "actor_rollout"}}
    for r in runs["fsdp2_off"]:
        assert r["init_status"]["faircast_status"]["requested"] is False


def test_driver_refuses_a_worker_that_did_not_load_fair_cast():
    from faircast_plugins.patching import FairCastPatchError
    from faircast_plugins.verl.patches import STATUS_KEY

    active = {STATUS_KEY: {"requested": True, "active": True, "role": "actor_rollout"}}
    off = {STATUS_KEY: {"requested": False, "active": False, "role": "actor_rollout"}}
    with pytest.raises(FairCastPatchError, match=r"1 of 3 worker\(s\) \(worker index \[1\]\) did not load Fair Cast"):
        _bound_init_model([active, None, active])()  # None: verl's own init_model ran on worker 1
    assert _bound_init_model([active, active])() == [active, active]  # controls: all loaded, or nobody asked
    assert _bound_init_model([off, off])() == [off, off]


def test_driver_refuses_when_the_group_config_asks_and_no_worker_answers():
    from faircast_plugins.patching import FairCastPatchError

    with pytest.raises(FairCastPatchError, match="2 of 2 worker"):
        _bound_init_model([None, None], OmegaConf.create({"faircast": True}))()
    assert _bound_init_model([None, None])() == [None, None]  # control: nothing asked for Fair Cast in this group


def test_driver_check_needs_verls_one_to_all_dispatch():
    """The collect step is attached to ``init_model``'s ONE_TO_ALL registration; any other registration (or a
    second Fair Cast wrap) is refused at patch time, not left to misbehave in the driver."""
    from verl.single_controller.base.decorator import MAGIC_ATTR, Dispatch, register

    from faircast_plugins.patching import FairCastPatchError
    from faircast_plugins.verl.patches import _wrap_init_model, check_workers_activated

    def init_model(self):
        return None

    wrapped = _wrap_init_model(register(dispatch_mode=Dispatch.ONE_TO_ALL)(init_model))  # control: verl's own
    assert getattr(wrapped, MAGIC_ATTR)["dispatch_mode"]["collect_fn"] is check_workers_activated
    for other in (register(dispatch_mode=Dispatch.DP_COMPUTE_PROTO)(init_model), init_model):
        with pytest.raises(FairCastPatchError, match="not registered with Dispatch.ONE_TO_ALL"):
            _wrap_init_model(other)
    with pytest.raises(FairCastPatchError, match="already wrapped by Fair Cast"):
        _wrap_init_model(wrapped)


# -- 3. rollout.quantization, 6. merged LoRA ---------------------------------------------------------------------


@pytest.mark.parametrize("quantization", ["torchao", "ascend"])
def test_rollout_quantization_other_than_fp8_is_refused(quantization):
    cfg = compose(cpu_overrides("/x", "fsdp2", 8, 1) + ["+actor_rollout_ref.faircast=true",
                                                          f"actor_rollout_ref.rollout.quantization={quantization}"])
    with pytest.raises(ValueError, match=f"rollout.quantization='{quantization}'.*Supported with Fair Cast: fp8"):
        check_supported(read_faircast(cfg.actor_rollout_ref), cfg.actor_rollout_ref)


def test_rollout_quantization_fp8_is_accepted_without_a_config_file():
    """fp8: verl's quantizer runs after Fair Cast's bf16 stage (tests/verl/test_fp8_rollout.py); a
    quantization_config_file (which can change the block size) is refused."""
    base = cpu_overrides("/x", "fsdp2", 8, 1) + ["+actor_rollout_ref.faircast=true",
                                                 "actor_rollout_ref.rollout.quantization=fp8"]
    cfg = compose(base)
    check_supported(read_faircast(cfg.actor_rollout_ref), cfg.actor_rollout_ref)
    cfg = compose(base + ["actor_rollout_ref.rollout.quantization_config_file=/x/quant.json"])
    with pytest.raises(ValueError, match="quantization_config_file"):
        check_supported(read_faircast(cfg.actor_rollout_ref), cfg.actor_rollout_ref)


def test_fp8_loss_needs_rollout_quantization_fp8():
    """faircast.fp8_loss (the actor's forward on the fp8 copy, tests/verl/test_fp8_loss.py) is accepted with
    rollout.quantization=fp8 and refused without it (the engine would serve bf16)."""
    opt = "+actor_rollout_ref.faircast={enable:true,fp8_loss:true}"
    cfg = compose(cpu_overrides("/x", "fsdp2", 8, 1) + [opt, "actor_rollout_ref.rollout.quantization=fp8"])
    check_supported(read_faircast(cfg.actor_rollout_ref), cfg.actor_rollout_ref)
    cfg = compose(cpu_overrides("/x", "fsdp2", 8, 1) + [opt])
    with pytest.raises(ValueError, match="fp8_loss: true .* needs actor_rollout_ref.rollout.quantization=fp8"):
        check_supported(read_faircast(cfg.actor_rollout_ref), cfg.actor_rollout_ref)
    cfg = compose(cpu_overrides("/x", "fsdp2", 8, 1) + [opt, "actor_rollout_ref.rollout.quantization=fp8",
                                                          "actor_rollout_ref.model.lora_rank=4"])
    with pytest.raises(ValueError, match="fp8_loss with LoRA is not supported"):
        check_supported(read_faircast(cfg.actor_rollout_ref), cfg.actor_rollout_ref)


def test_merged_lora_needs_the_explicit_opt_in():
    merge = ["actor_rollout_ref.model.lora_rank=8", "actor_rollout_ref.model.lora.merge=true"]
    cfg = compose(cpu_overrides("/x", "fsdp2", 8, 1) + ["+actor_rollout_ref.faircast=true", *merge])
    with pytest.raises(ValueError, match="allow_merged_lora=true"):
        check_supported(read_faircast(cfg.actor_rollout_ref), cfg.actor_rollout_ref)
    opt_in = ["+actor_rollout_ref.faircast.enable=true", "+actor_rollout_ref.faircast.allow_merged_lora=true"]
    opted = compose(cpu_overrides("/x", "fsdp2", 8, 1) + opt_in + merge)
    fc = read_faircast(opted.actor_rollout_ref)
    assert fc.enabled and fc.mode == "stochastic"
    check_supported(fc, opted.actor_rollout_ref)
    bad = OmegaConf.create({"faircast": {"enable": True, "allow_merged_lora": "maybe"}})
    with pytest.raises(ValueError, match="allow_merged_lora must be true or false"):
        check_supported(fc, OmegaConf.merge(OmegaConf.to_container(opted.actor_rollout_ref), bad))


# -- 4. a skipped optimizer step -------------------------------------------------------------------------------


def test_skipped_optimizer_step_keeps_the_version(worker_runs):
    """verl skips the update when the grad norm is not finite: the weight version counts steps taken."""
    _, runs = worker_runs(1)
    r0 = runs["fsdp2_nan_step"][0]
    assert len(r0["masters_by_step"]) == 2  # optimizer_step was called twice
    assert all(torch.equal(r0["masters_by_step"][0][n], m) for n, m in r0["masters_v0"].items())  # first skipped
    assert r0["version"] == 1
    changed = 0
    for name, master in r0["masters"].items():
        expected = fair_cast(master, key=derive_key(SEED, 1, name))
        assert torch.equal(bits(r0["exported"][name]), bits(expected)), name
        assert torch.equal(bits(r0["forward"][name]), bits(expected)), name
        changed += int((bits(expected) != bits(fair_cast(master, key=derive_key(SEED, 2, name)))).sum())
    assert changed > 0  # control: version 2 would be another copy


# -- 5. restored state lives on the master's device ---------------------------------------------------------------


def test_restored_ema_and_served_copy_move_to_the_masters_device_once():
    """After ``load_state_dict`` (a resume reads on the CPU) the EMA and the cached error-feedback copy move to the
    master's device at their first use and stay there (the meta device stands in for an accelerator)."""
    x = torch.randn(64)
    ema = FairCaster(FairCastConfig(enabled=True, seed=SEED, ema_decay=0.5))
    ema.cast("w", x)
    resumed = FairCaster(ema.config)
    resumed.load_state_dict(ema.state_dict())
    resumed.source("w", x.to("meta"))
    assert resumed.state_dict()["ema"]["w"].device.type == "meta"
    resumed.advance([("w", x.to("meta"))])  # the EMA step runs where the master is
    assert resumed.state_dict()["ema"]["w"].device.type == "meta"

    ef = FairCaster(FairCastConfig(enabled=True, seed=SEED, mode="error_feedback"))
    ef.cast("w", x)
    resumed = FairCaster(ef.config)
    resumed.load_state_dict(ef.state_dict())
    resumed.cast("w", x.to("meta"))  # this version was cast already: the cached copy is served again
    assert resumed.state_dict()["error_feedback"]["w"]["served"].device.type == "meta"


# -- 7. the checkpoint goes through export.save_state ------------------------------------------------------------


def test_checkpoint_state_is_the_shared_per_rank_format(worker_runs):
    """verl's per-rank files carry the shard layout (CPU tensors): ``faircast export --state`` merges them into the
    full state, which re-derives the copy the run served after resuming."""
    from faircast_plugins.export import load_state

    out, runs = worker_runs(2)
    files = sorted((out / "ckpt_ef").glob("faircast_state_rank_*.pt"))
    assert len(files) == 2
    for rank, path in enumerate(files):
        saved = torch.load(path, weights_only=True)
        assert saved["fsdp"]["rank"] == rank and saved["fsdp"]["world_size"] == 2 and saved["fsdp"]["shards"]
        assert all(e["residual"].device.type == "cpu" for e in saved["error_feedback"].values())
    merged = load_state(str(out / "ckpt_ef" / "faircast_state_rank_*.pt"))
    caster = FairCaster(EF)
    caster.load_state_dict(merged)
    straight = runs["fsdp2_ef"][0]
    for name, master in straight["masters"].items():
        assert torch.equal(bits(caster.cast(name, master)), bits(straight["exported"][name])), name
