"""Config parsing: Python kwargs, YAML through TRL's own parser, the ``faircast-trl`` CLI, and clear errors."""
from __future__ import annotations

import json
import os
import pickle
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import faircast_plugins.trl as fc_trl
from faircast_plugins import FairCastConfig
from faircast_plugins.patching import FairCastPatchError


def test_python_kwargs_and_defaults():
    from trl import GRPOConfig, RLOOConfig
    from trl.experimental.online_dpo import OnlineDPOConfig

    args = GRPOConfig(output_dir="/tmp/x", faircast=True, faircast_mode="error_feedback", faircast_seed=5,
                      faircast_audit=True, use_cpu=True, report_to="none")
    cfg = fc_trl.faircast_config(args)
    assert cfg == FairCastConfig(enabled=True, mode="error_feedback", seed=5, audit=True)
    default = GRPOConfig(output_dir="/tmp/x", use_cpu=True, report_to="none")
    assert default.faircast is False and not fc_trl.faircast_config(default).active
    # a mapping works too, and is normalised to the flat fields
    mapped = GRPOConfig(output_dir="/tmp/x", faircast={"mode": "nearest", "seed": 3}, use_cpu=True, report_to="none")
    assert (mapped.faircast, mapped.faircast_mode, mapped.faircast_seed) == (True, "nearest", 3)
    for cls in (RLOOConfig, OnlineDPOConfig):
        assert cls(output_dir="/tmp/x", faircast="true", use_cpu=True, report_to="none").faircast is True
    # the subclass masquerades as TRL's class: training_args.bin pickles and unpickles to the same class
    assert GRPOConfig.__module__ == "trl.trainer.grpo_config" and GRPOConfig.__qualname__ == "GRPOConfig"
    again = pickle.loads(pickle.dumps(args))
    assert type(again) is GRPOConfig and again.faircast_mode == "error_feedback"


def test_every_option_survives_the_config():
    """``faircast: {backend: ..., audit_sample: ...}`` is kept (issue 14.18), and so are the flat fields."""
    from trl import GRPOConfig

    mapped = GRPOConfig(output_dir="/tmp/x", use_cpu=True, report_to="none",
                        faircast={"backend": "torch", "audit_sample": 7, "audit": True})
    cfg = fc_trl.faircast_config(mapped)
    assert (cfg.enabled, cfg.backend, cfg.audit_sample, cfg.audit) == (True, "torch", 7, True)
    flat = GRPOConfig(output_dir="/tmp/x", use_cpu=True, report_to="none", faircast=True, faircast_backend="torch",
                      faircast_audit_sample=9, faircast_resume_without_state="true")
    assert (fc_trl.faircast_config(flat).backend, fc_trl.faircast_config(flat).audit_sample) == ("torch", 9)
    assert flat.faircast_resume_without_state is True
    assert fc_trl.faircast_config(pickle.loads(pickle.dumps(flat))).audit_sample == 9
    with pytest.raises(ValueError, match="backend must be one of"):
        GRPOConfig(output_dir="/tmp/x", use_cpu=True, report_to="none", faircast=True, faircast_backend="gpu")


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"faircast_mode": "stochastc"}, "unknown Fair Cast mode 'stochastc'"),
        ({"faircast": "maybe"}, "must be true or false"),
        ({"faircast_seed": -1}, "seed must be an integer"),
        ({"faircast_ema_decay": 1.5}, "ema_decay must be in [0, 1)"),
        ({"faircast": {"mode": "nearest", "bogus": 1}}, "unknown faircast option(s) ['bogus']"),
    ],
)
def test_bad_values_give_clear_errors(kwargs, message):
    from trl import GRPOConfig

    with pytest.raises(ValueError) as err:
        GRPOConfig(output_dir="/tmp/x", use_cpu=True, report_to="none", **kwargs)
    assert message in str(err.value)


def test_yaml_through_trl_parser(tmp_path):
    """The exact parse ``trl grpo --config cfg.yaml`` runs, with the patched GRPOConfig."""
    from trl.scripts.grpo import make_parser

    cfg = tmp_path / "cfg.yaml"
    cfg.write_text("output_dir: out\nuse_cpu: true\nfaircast: true\nfaircast_mode: error_feedback\nfaircast_seed: 11\n")
    parser = make_parser()  # a fresh parser per parse: TrlParser keeps config values as defaults
    _, training_args, *_ = parser.parse_args_and_config(["--config", str(cfg), "--faircast_seed", "12"])
    cfg_parsed = fc_trl.faircast_config(training_args)
    assert cfg_parsed.enabled and cfg_parsed.mode == "error_feedback" and cfg_parsed.seed == 12
    _, off_args, *_ = make_parser().parse_args_and_config(["--output_dir", "out", "--use_cpu", "true"])
    assert off_args.faircast is False
    cfg.write_text("output_dir: out\nuse_cpu: true\nfaircast: true\nfaircast_mode: bogus\n")
    with pytest.raises(ValueError, match="unknown Fair Cast mode 'bogus'"):
        make_parser().parse_args_and_config(["--config", str(cfg)])


def test_unsupported_trl_version_is_refused(monkeypatch):
    from faircast_plugins.trl import patches

    monkeypatch.setattr(patches, "SUPPORTED", ">=9.0")
    with pytest.raises(FairCastPatchError, match=r"installed trl is 1\.16\.0"):
        patches.build_patch_set().check()


EXAMPLES = Path(__file__).resolve().parents[2] / "examples" / "trl"


def example_setup(tmp_path, tiny_model_dir):
    """Run from a folder where ``tiny`` is the tiny model, as examples/trl/grpo_tiny.yaml expects."""
    os.symlink(tiny_model_dir, tmp_path / "tiny")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(EXAMPLES), os.environ.get("PYTHONPATH", "")]),
           "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1"}
    return EXAMPLES / "grpo_tiny.yaml", env


def faircast_trl_exe():
    exe = shutil.which("faircast-trl", path=os.path.dirname(sys.executable)) or shutil.which("faircast-trl")
    if exe is None:
        pytest.skip("the faircast-trl console script is not installed (pip install -e .)")
    return exe


def test_faircast_trl_cli_runs_grpo_with_yaml_flag(tmp_path, tiny_model_dir):
    cfg, env = example_setup(tmp_path, tiny_model_dir)  # the example YAML has faircast: true
    run = subprocess.run(
        [faircast_trl_exe(), "grpo", "--config", str(cfg), "--faircast_mode", "error_feedback",
         "--num_processes", "1"],
        cwd=tmp_path, env=env, capture_output=True, text=True, timeout=900,
    )
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-6000:]
    out = tmp_path / "tiny-GRPO"
    info = json.loads((out / "faircast.json").read_text())
    assert info == {"enabled": True, "mode": "error_feedback", "seed": 0, "version": 4, "ema_decay": 0.0,
                    "model_weights": "fp32 masters"}
    state = torch.load(out / "faircast_state.pt", weights_only=True)
    assert state["version"] == 4 and state["error_feedback"]
    assert "Fair Cast ACTIVE for TRL 1.16.0" in run.stderr + run.stdout
    assert "faircast/lag_steps" in run.stdout + run.stderr  # the child's TRL logs carry the audit metrics


def test_plain_trl_cli_rejects_the_flag_without_the_wrapper(tmp_path, tiny_model_dir):
    """Why faircast-trl exists: TRL's own child process does not know the field (negative control)."""
    trl_exe = shutil.which("trl", path=os.path.dirname(sys.executable))
    if trl_exe is None:
        pytest.skip("the trl console script is not installed")
    import sysconfig

    if os.path.exists(os.path.join(sysconfig.get_paths()["purelib"], "faircast_trl_hook.pth")):
        pytest.skip("the opt-in faircast_trl_hook is installed in this environment, so plain trl knows the flag")
    cfg, env = example_setup(tmp_path, tiny_model_dir)
    run = subprocess.run([trl_exe, "grpo", "--config", str(cfg), "--num_processes", "1"], cwd=tmp_path, env=env,
                         capture_output=True, text=True, timeout=900)
    assert run.returncode != 0
    assert "faircast" in run.stderr


def test_example_script_runs_on_cpu(tmp_path, tiny_model_dir):
    """examples/trl/grpo.py --tiny: TRL's quickstart plus faircast=True, on the tiny model."""
    _, env = example_setup(tmp_path, tiny_model_dir)
    run = subprocess.run([sys.executable, str(EXAMPLES / "grpo.py"), "--tiny", "tiny"], cwd=tmp_path, env=env,
                         capture_output=True, text=True, timeout=900)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-6000:]
    assert "Fair Cast ACTIVE for TRL" in run.stderr and "faircast/lag_steps" in run.stdout + run.stderr
