"""Checkpoints: Fair Cast state is saved with Trainer checkpoints and ``resume_from_checkpoint`` restores it, so
a run stopped and resumed serves bit-identical copies to one that ran straight through."""
from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file
from transformers import TrainerCallback

from faircast_plugins.export import export_served

import faircast_plugins.trl  # noqa: F401  (patches TRL)
from helpers import grpo_args, grpo_trainer, named_params


class ServedRecorder(TrainerCallback):
    """Added after the Fair Cast callback: records the served copy (the params) and masters at each version."""

    def __init__(self, trainer):
        self.trainer, self.served, self.masters = trainer, {}, {}

    def _record(self, state):
        self.served[state.global_step] = {n: p.detach().clone() for n, p in named_params(self.trainer).items()}
        self.masters[state.global_step] = {n: m.clone() for n, m in self.trainer._faircast.masters.items()}

    def on_train_begin(self, args, state, control, **kwargs):
        self._record(state)

    def on_step_end(self, args, state, control, **kwargs):
        self._record(state)


def train(model_dir, dataset, out, mode, resume=None, **flags):
    args = grpo_args(out, max_steps=4, save_strategy="steps", save_steps=2, learning_rate=1e-4, faircast=True,
                     faircast_mode=mode, faircast_seed=99, **flags)
    trainer = grpo_trainer(model_dir, dataset, args)
    recorder = ServedRecorder(trainer)
    trainer.add_callback(recorder)
    trainer.train(resume_from_checkpoint=resume)
    return trainer, recorder


@pytest.mark.parametrize("mode", ["stochastic", "error_feedback"])
def test_resume_serves_bit_identical_copies(tiny_model_dir, prompts_dataset, tmp_path, mode):
    straight_trainer, straight = train(tiny_model_dir, prompts_dataset, tmp_path / "a", mode)
    assert sorted(straight.served) == [0, 1, 2, 3, 4]
    ckpt = tmp_path / "a" / "checkpoint-2"

    # the checkpoint holds the fp32 masters (not the served copy) and the Fair Cast state
    saved = load_file(str(ckpt / "model.safetensors"))
    for name, master in straight.masters[2].items():
        assert torch.equal(saved[name], master), name
    assert any(not torch.equal(saved[n], q) for n, q in straight.served[2].items())
    info = json.loads((ckpt / "faircast.json").read_text())
    assert info["version"] == 2 and info["seed"] == 99 and info["mode"] == mode

    # the served copy of the checkpoint can be rebuilt offline, bit for bit, from the masters + Fair Cast state
    export_served(ckpt, tmp_path / "served", state=ckpt / "faircast_state.pt")
    exported = load_file(str(tmp_path / "served" / "model.safetensors"))
    for name, q in straight.served[2].items():
        assert exported[name].dtype == torch.bfloat16 and torch.equal(exported[name].float(), q), name

    _, resumed = train(tiny_model_dir, prompts_dataset, tmp_path / "b", mode, resume=str(ckpt))
    assert sorted(resumed.served) == [2, 3, 4]
    for version in (2, 3, 4):
        for name, q in straight.served[version].items():
            assert torch.equal(resumed.served[version][name], q), (version, name)
    # and the served copies did move between versions (the comparison is not vacuous)
    assert any(not torch.equal(straight.served[4][n], straight.served[2][n]) for n in straight.served[2])


def test_resume_without_state_is_refused_unless_asked(tiny_model_dir, prompts_dataset, tmp_path, caplog):
    """Issue 14.19, one rule on every backend: without the Fair Cast state, an error-feedback resume is refused;
    ``faircast_resume_without_state=True`` restarts the residuals on purpose (and then the copy differs)."""
    from faircast_plugins.patching import FairCastPatchError

    _, straight = train(tiny_model_dir, prompts_dataset, tmp_path / "a", "error_feedback")
    ckpt = tmp_path / "a" / "checkpoint-2"
    (ckpt / "faircast_state.pt").unlink()
    with pytest.raises(FairCastPatchError, match="faircast_state.pt, which does not exist.*faircast_resume_without_state"):
        train(tiny_model_dir, prompts_dataset, tmp_path / "b", "error_feedback", resume=str(ckpt))
    with caplog.at_level("WARNING", logger="faircast_plugins"):
        _, resumed = train(tiny_model_dir, prompts_dataset, tmp_path / "c", "error_feedback", resume=str(ckpt),
                           faircast_resume_without_state=True)
    assert "starts fresh at weight version 2" in caplog.text
    assert sorted(resumed.served) == [2, 3, 4]
    assert any(not torch.equal(resumed.served[2][n], q) for n, q in straight.served[2].items())
