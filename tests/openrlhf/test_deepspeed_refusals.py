"""Clear refusals and checks of the DeepSpeed patch, on real DeepSpeed engines (world size 1, gloo, in this process)."""
from __future__ import annotations

import os
import socket
import sys

import pytest
import torch

from faircast_plugins import FairCastConfig, FairCaster
from faircast_plugins.patching import FairCastPatchError

import ds_worker  # noqa: E402  (tests/openrlhf is on sys.path via conftest)


@pytest.fixture(scope="module")
def deepspeed_world1():
    import deepspeed
    import deepspeed.comm.torch  # noqa: F401

    if not torch.distributed.is_initialized():
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK="0", WORLD_SIZE="1", LOCAL_RANK="0")
        sys.modules["deepspeed.comm.torch"].build_shm_op = lambda: None
        deepspeed.init_distributed(dist_backend="gloo")
    return deepspeed


def _engine(deepspeed, *, bf16=True, name="z2"):
    model = ds_worker.make_model()
    cfg = ds_worker.ds_config(name, 1)
    if not bf16:
        model = model.float()
        cfg["bf16"] = {"enabled": False}
    engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=cfg)
    return engine


def _caster(**kw):
    return FairCaster(FairCastConfig(enabled=True, seed=1, **kw))


def test_fp32_training_is_refused(deepspeed_world1):
    from faircast_plugins.deepspeed import apply_deepspeed_patch

    engine = _engine(deepspeed_world1, bf16=False)
    with pytest.raises(FairCastPatchError, match="needs bf16 training"):
        apply_deepspeed_patch(engine, _caster())
    assert "_faircast" not in engine.__dict__


def test_bf16_master_weights_is_refused(deepspeed_world1):
    from faircast_plugins.deepspeed import apply_deepspeed_patch

    engine = _engine(deepspeed_world1)
    # That mode needs DeepSpeedCPUAdam (a C++ JIT build), so the flag is set on a built engine's config,
    # which is exactly what the check reads.
    engine._config.bfloat16_config.bf16_master_weights_and_grads = True
    with pytest.raises(FairCastPatchError, match="bf16_master_weights_and_grads: the master itself is bf16"):
        apply_deepspeed_patch(engine, _caster())


def test_ema_cannot_start_in_the_middle_of_a_run(deepspeed_world1):
    """The EMA starts at version 0 (from the fresh engine's weights) or comes from a checkpoint; not from nowhere."""
    from faircast_plugins.deepspeed import apply_deepspeed_patch

    engine = _engine(deepspeed_world1)
    apply_deepspeed_patch(engine, FairCaster(FairCastConfig(enabled=True, seed=1, ema_decay=0.9), version=5))
    with pytest.raises(FairCastPatchError, match="no EMA state for .* at weight version 6"):
        ds_worker.train_step(engine, ds_worker.batch())


def test_ema_resume_needs_the_fair_cast_state(deepspeed_world1, tmp_path):
    """Resuming with ema_decay from a checkpoint written without Fair Cast would serve an EMA that never was."""
    from faircast_plugins.deepspeed import apply_deepspeed_patch

    plain = _engine(deepspeed_world1)
    ds_worker.train_step(plain, ds_worker.batch())
    plain.save_checkpoint(str(tmp_path), tag="t")
    resumed = _engine(deepspeed_world1)
    resumed.load_checkpoint(str(tmp_path), tag="t")
    with pytest.raises(FairCastPatchError, match=r"ema_decay=0.9 \(EMA of the master\) needs this rank's Fair Cast state"):
        apply_deepspeed_patch(resumed, _caster(ema_decay=0.9))


def test_disabled_config_leaves_the_engine_alone(deepspeed_world1):
    from faircast_plugins.deepspeed import apply_deepspeed_patch

    engine = _engine(deepspeed_world1)
    assert apply_deepspeed_patch(engine, FairCaster(FairCastConfig(enabled=False))) is None
    assert "_faircast" not in engine.__dict__


def test_a_step_that_casts_nothing_fails_loudly(deepspeed_world1):
    """If the copy-back lands somewhere Fair Cast does not map (a DeepSpeed change), the step must not pass."""
    from faircast_plugins.deepspeed import DeepSpeedFairCast, install_deepspeed_patch

    install_deepspeed_patch()
    engine = _engine(deepspeed_world1)
    caster = _caster()
    engine.__dict__["_faircast"] = DeepSpeedFairCast(engine, caster, named_params=[])  # maps no weight memory
    with pytest.raises(FairCastPatchError, match="none into the model's weights"):
        ds_worker.train_step(engine, ds_worker.batch())
    assert caster.version == 0  # the failed step did not advance the weight version


def test_unsupported_deepspeed_version_is_refused(monkeypatch):
    from faircast_plugins import patching
    from faircast_plugins.deepspeed.patch import PATCHES

    monkeypatch.setattr(patching, "installed_version", lambda dist: "0.18.9" if dist == "deepspeed" else None)
    with pytest.raises(FairCastPatchError, match=r"deepspeed>=0.19,<0.20; the installed deepspeed is 0.18.9"):
        PATCHES.check()


def test_other_engines_keep_round_to_nearest(deepspeed_world1):
    """Only the engine Fair Cast is attached to changes; another engine in the same process stays RTN."""
    from faircast_plugins.deepspeed import apply_deepspeed_patch

    policy, other = _engine(deepspeed_world1), _engine(deepspeed_world1)
    apply_deepspeed_patch(policy, _caster())
    for _ in range(3):
        ds_worker.train_step(policy, ds_worker.batch())
        ds_worker.train_step(other, ds_worker.batch())
    masters = ds_worker.full_masters(other)
    for name, p in other.module.named_parameters():
        assert torch.equal(p.data.view(torch.int16), masters[name].to(torch.bfloat16).view(torch.int16)), name
    assert policy.__dict__["_faircast"].caster.version == 3


# -- options refused at activation (issue 14, items 8, 9, 11) -------------------------------------------------------
def _with_config(engine, **extra):
    """``engine`` reading a real DeepSpeedConfig with ``extra`` on top of its own (what the refusals read).

    ZenFlow needs ZenFlowCPUAdam, NVMe offload an NVMe swap folder with aio, AutoTP/AutoEP more than one rank and
    MoQ fp16: the options are set on a built engine's config, the object the checks read."""
    from deepspeed.runtime.config import DeepSpeedConfig

    cfg = dict(engine._config._param_dict)
    for key, value in extra.items():
        cfg[key] = {**cfg.get(key, {}), **value} if isinstance(value, dict) else value
    engine._config = DeepSpeedConfig(cfg)
    return engine


REFUSED = {
    "zenflow_zero3": ("z3", {"zero_optimization": {"offload_optimizer": {"device": "cpu"}, "zenflow": {"topk_ratio": 0.1}}},
                      r"ZenFlow \(zero_optimization.zenflow\)"),
    "nvme_param_offload": ("z3", {"zero_optimization": {"offload_param": {"device": "nvme", "nvme_path": "/tmp/nvme"}}},
                           r"offload_param.device=nvme.*Use offload_param.device=cpu"),
    "moq_weight_quantization": ("z2", {"compression_training": {"weight_quantization": {
        "shared_parameters": {"enabled": True, "quantize_weight_in_forward": True},
        "different_groups": {"wq1": {"params": {"start_bits": 8, "target_bits": 8, "quantization_period": 0},
                                     "modules": ["proj"]}}}}},
                                r"weight quantization \(MoQ, compression_training.weight_quantization\)"),
    "zero3_quantized_initialization": ("z3", {"weight_quantization": {"quantized_initialization": {"num_bits": 8}}},
                                       r"weight_quantization.quantized_initialization"),
    "autotp": ("z2", {"tensor_parallel": {"autotp_size": 2}},
               r"AutoTP \(tensor_parallel.autotp_size=2.*--ds.tensor_parallel_size.*Shard with ZeRO-3"),
    "autoep": ("z2", {"expert_parallel": {"enabled": True, "autoep_size": 2}}, r"expert parallelism \(ep_size=2"),
}


@pytest.mark.parametrize("option", REFUSED)
def test_options_that_bypass_the_copy_back_are_refused(deepspeed_world1, option):
    """Each option is refused at activation with a message naming it; the same engine without it is accepted."""
    from faircast_plugins.deepspeed import apply_deepspeed_patch, remove_deepspeed_patch

    import deepspeed
    from deepspeed.runtime.config import DeepSpeedConfig

    stage, extra, message = REFUSED[option]
    if option.startswith("moq") and not hasattr(DeepSpeedConfig({"train_batch_size": 1}), "compression_config"):
        pytest.skip(f"DeepSpeed {deepspeed.__version__} has no compression training (MoQ): removed in 0.19.8")
    engine = _with_config(_engine(deepspeed_world1, name=stage), **extra)
    with pytest.raises(FairCastPatchError, match=message):
        apply_deepspeed_patch(engine, _caster())
    assert "_faircast" not in engine.__dict__
    control = _engine(deepspeed_world1, name=stage)  # negative control: the plain config of that stage
    assert apply_deepspeed_patch(control, _caster()) is not None
    remove_deepspeed_patch(control)


def test_deepspeed_moe_expert_parallelism_is_refused(deepspeed_world1):
    """Native DeepSpeed-MoE layers with ep_size > 1 name their local experts 0.. on every rank: refused. A real
    MoE layer object (its process groups are only built by an engine at ep_size ranks, so it is not trained here)."""
    from deepspeed.moe.layer import MoE

    from faircast_plugins.deepspeed.patch import _refused_options

    engine = _engine(deepspeed_world1)
    engine.module.moe = MoE(hidden_size=8, expert=torch.nn.Linear(8, 8), num_experts=4, ep_size=2)
    names = [n for n, _ in engine.module.moe.named_parameters() if "experts" in n]
    assert names[0].endswith("deepspeed_experts.0.weight"), names  # local ids, the same on every rank
    refused = list(_refused_options(engine))
    assert len(refused) == 1 and "ep_size=2" in refused[0], refused
    engine.module.moe = MoE(hidden_size=8, expert=torch.nn.Linear(8, 8), num_experts=4, ep_size=1)  # control
    assert list(_refused_options(engine)) == []


# -- the weight version counts optimizer steps taken (issue 14, item 4) -------------------------------------------
def _step_with_inf_grads(engine):
    ids = ds_worker.batch()
    logits = engine(ids[:, :-1])
    loss = torch.nn.functional.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), ids[:, 1:].reshape(-1))
    engine.backward(loss * float("inf"))
    engine.step()


def _expected(masters, version):
    from faircast_plugins import derive_key, fair_cast

    return {n: fair_cast(m.contiguous(), key=derive_key(1, version, n)) for n, m in masters.items()}


def _assert_served(engine, expected, what):
    for name, p in engine.module.named_parameters():
        assert torch.equal(p.data.view(torch.int16), expected[name].view(torch.int16)), f"{what}: {name}"


@pytest.mark.parametrize("check_grad_overflow", [True, False])
def test_version_counts_the_optimizer_steps_taken(deepspeed_world1, check_grad_overflow):
    """bf16 ZeRO-2 skips a step with non-finite gradients (bf16.check_grad_overflow, on by default): the weights and
    the version stay. With the check off DeepSpeed takes the step (masters NaN), and the version counts it."""
    from faircast_plugins.deepspeed import apply_deepspeed_patch

    engine = _with_config(_engine(deepspeed_world1), bf16={"check_grad_overflow": check_grad_overflow})
    engine.optimizer.check_grad_overflow = check_grad_overflow  # read at the optimizer's construction
    fc = apply_deepspeed_patch(engine, _caster())
    before = {n: p.data.clone() for n, p in engine.module.named_parameters()}
    _step_with_inf_grads(engine)
    if check_grad_overflow:
        assert engine.skipped_steps == 1 and fc.caster.version == 0
        _assert_served(engine, before, "skipped step")
        ds_worker.train_step(engine, ds_worker.batch())
        assert fc.caster.version == 1
        _assert_served(engine, _expected(ds_worker.full_masters(engine), 1), "first step taken")
    else:
        assert engine.skipped_steps == 0 and fc.caster.version == 1
        assert all(torch.isnan(m).any() for m in ds_worker.full_masters(engine).values())


# -- universal checkpoint load (issue 14, item 10) ------------------------------------------------------------------
@pytest.mark.parametrize("config,attach", [("z2", "before_load"), ("z2", "after_load"), ("bf16opt", "after_load")])
def test_universal_checkpoint_load_serves_the_fair_cast_copy(deepspeed_world1, tmp_path, monkeypatch, config, attach):
    """A universal-checkpoint load re-derives the bf16 weights from the masters (update_lp_params): under Fair
    Cast they are fair_cast(master) at the loaded version, not round-to-nearest."""
    # BF16_Optimizer reports its memory (a full gc.collect, seconds in a pytest process) four times per engine.
    monkeypatch.setattr("deepspeed.runtime.bf16_optimizer.see_memory_usage", lambda *args, **kwargs: None)
    from argparse import Namespace

    from deepspeed.checkpoint.ds_to_universal import main as ds_to_universal

    from faircast_plugins.deepspeed import apply_deepspeed_patch

    trained = _engine(deepspeed_world1, name=config)
    apply_deepspeed_patch(trained, _caster())
    for _ in range(2):
        ds_worker.train_step(trained, ds_worker.batch())
    trained.save_checkpoint(str(tmp_path), tag="t")
    masters = ds_worker.full_masters(trained)  # what the load restores (the loaded engine's hp mapping does not read them)
    ds_to_universal(Namespace(input_folder=str(tmp_path / "t"), output_folder=str(tmp_path / "t_universal"),
                              num_extract_workers=1, num_merge_workers=1, keep_temp_folder=False, strict=True,
                              inject_missing_state=True))

    resumed = _with_config(_engine(deepspeed_world1, name=config), checkpoint={"load_universal": True})
    if attach == "before_load":
        fc = apply_deepspeed_patch(resumed, _caster())
    resumed.load_checkpoint(str(tmp_path), tag="t_universal")
    if attach == "after_load":
        fc = apply_deepspeed_patch(resumed, _caster())
    assert fc.caster.version == 2
    expected = _expected(masters, 2)
    rtn = {n: m.to(torch.bfloat16) for n, m in masters.items()}
    assert any(not torch.equal(expected[n], rtn[n]) for n in rtn)  # the check can tell the two apart
    _assert_served(resumed, expected, f"universal load, Fair Cast attached {attach}")
