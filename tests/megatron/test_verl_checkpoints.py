"""Fair Cast's state in verl's Megatron checkpoints (megatron-review.md finding 9), without verl: a stand-in of verl
0.9.1's ``MegatronEngine.save_checkpoint`` / ``load_checkpoint`` whose save finalises the checkpoint inside the call
(``MegatronCheckpointManager._finalize_save``: manifest, HDFS upload, retention), wrapped by the wrappers
faircast_plugins/verl/megatron.py installs on the real class."""
from __future__ import annotations

import os
import shutil
from types import SimpleNamespace

import pytest

from faircast_plugins.patching import FairCastPatchError
from faircast_plugins.verl import megatron as verl_megatron


class _FairCast:
    """What the wrappers use of a MegatronFairCast: its per-rank state file."""

    def __init__(self, mode: str):
        self.caster = SimpleNamespace(version=7, config=SimpleNamespace(describe=lambda: f"mode={mode}"))
        self.loaded = None

    def state_path(self, directory):
        return os.path.join(directory, "faircast_state_rank00000.pt")

    def save(self, directory):
        with open(self.state_path(directory), "w") as f:
            f.write("state")

    def load(self, directory, *, step=None):
        if not os.path.exists(self.state_path(directory)):  # the old stateless fallback: the scheduler's step count
            self.caster.version = step
            return
        self.loaded = directory


class _Engine:
    """verl's engine: save writes the model, then finalises (the upload copies the directory as it is now)."""

    def __init__(self, hdfs):
        self.hdfs = hdfs
        self.lr_scheduler = SimpleNamespace(num_steps=0)  # use_checkpoint_opt_param_scheduler=False: not restored

    def save_checkpoint(self, local_path, hdfs_path=None, global_step=0, max_ckpt_to_keep=None, **kwargs):
        os.makedirs(local_path, exist_ok=True)
        with open(os.path.join(local_path, "model.pt"), "w") as f:
            f.write("model")
        shutil.copytree(local_path, self.hdfs, dirs_exist_ok=True)  # _finalize_save: hdfs_io.copy

    def load_checkpoint(self, local_path, hdfs_path=None, del_local_after_load=True, **kwargs):
        assert os.path.exists(os.path.join(local_path, "model.pt"))

    def to(self, device, model=True, optimizer=True, grad=True):
        pass

    def train_batch(self, data, *args, **kwargs):  # wrapped too (the policy metrics), not called here
        raise AssertionError("not called by these tests")


def _wrapped_engine(tmp_path, mode="stochastic", fresh=False):
    cls = type("MegatronEngine", (_Engine,), {})
    for target, factory in verl_megatron.PATCHES._wanted:
        attr = target.rsplit(".", 1)[-1]
        setattr(cls, attr, factory(getattr(_Engine, attr)))
    engine = cls(str(tmp_path / "hdfs"))
    fc = _FairCast(mode)
    setattr(engine, verl_megatron.ATTR, fc)
    setattr(engine, getattr(verl_megatron, "FRESH_ATTR", "_unused"), fresh)
    return engine, fc


@pytest.mark.parametrize("mode", ["stochastic", "sticky", "error_feedback"])
def test_state_is_in_the_checkpoint_verl_finalises_and_a_resume_without_it_is_refused(tmp_path, mode):
    engine, fc = _wrapped_engine(tmp_path, mode)
    engine.save_checkpoint(str(tmp_path / "local"), hdfs_path="hdfs://x")
    assert sorted(os.listdir(tmp_path / "hdfs")) == ["faircast_state_rank00000.pt", "model.pt"]  # uploaded with it
    engine.load_checkpoint(str(tmp_path / "hdfs"))
    assert fc.loaded == str(tmp_path / "hdfs")

    os.remove(tmp_path / "hdfs" / "faircast_state_rank00000.pt")  # a checkpoint written without Fair Cast's state
    with pytest.raises(FairCastPatchError, match="resume_without_state=true"):
        engine.load_checkpoint(str(tmp_path / "hdfs"))
    assert fc.caster.version == 7  # not restarted at the scheduler's 0


def test_resume_without_state_is_an_explicit_choice(tmp_path):
    engine, fc = _wrapped_engine(tmp_path, fresh=True)
    os.makedirs(tmp_path / "old")
    open(tmp_path / "old" / "model.pt", "w").close()
    engine.load_checkpoint(str(tmp_path / "old"))
    assert fc.loaded is None and fc.caster.version == 7


def test_state_goes_to_host_memory_when_verl_offloads_the_optimizer(tmp_path):
    """``MegatronEngine.to("cpu", optimizer=True)`` (verl's optimizer_offload around the rollout) moves Fair Cast's
    per-element state off the device too; a model-only offload does not (gpu-review-3 finding 4)."""
    calls = []

    class Engine(_Engine):
        def to(self, device, model=True, optimizer=True, grad=True):
            calls.append((device, model, optimizer))

    cls = type("MegatronEngine", (Engine,), {})
    for target, factory in verl_megatron.PATCHES._wanted:
        attr = target.rsplit(".", 1)[-1]
        setattr(cls, attr, factory(getattr(Engine, attr)))
    engine = cls(str(tmp_path))
    fc = _FairCast("error_feedback")
    fc.offloaded = 0

    def offload_state():
        fc.offloaded += 1
        return 0

    fc.offload_state = offload_state
    setattr(engine, verl_megatron.ATTR, fc)
    engine.to("cpu", model=True, optimizer=False, grad=False)
    assert fc.offloaded == 0
    engine.to("cpu", model=True, optimizer=True, grad=True)
    assert fc.offloaded == 1
    engine.to("cuda", model=True, optimizer=True)
    assert fc.offloaded == 1 and len(calls) == 3
