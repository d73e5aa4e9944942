"""Clear refusals of the DeepSpeed patch, on real DeepSpeed engines (world size 1, gloo, in this process)."""
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
