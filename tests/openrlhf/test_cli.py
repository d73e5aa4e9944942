"""``python -m faircast_plugins.openrlhf.train_ppo_ray``: OpenRLHF's own parser, asserts and ``train()``.

Each test runs the real ``openrlhf.cli.train_ppo_ray`` as ``__main__`` with the given argv, through
OpenRLHF's parsing, ``hierarchize`` and argument checks, up to ``train()``'s first step that would launch
Ray actors (``get_strategy``), where the test stops it and inspects the args every actor would receive.
"""
from __future__ import annotations

import pytest

# OpenRLHF's own minimal valid GRPO arguments (no critic: group_norm with a remote reward).
BASE = [
    "--actor.model_name_or_path", "tiny-model",
    "--reward.remote_url", "http://127.0.0.1:1/reward",
    "--algo.advantage.estimator", "group_norm",
    "--rollout.n_samples_per_prompt", "2",
]


class Launched(Exception):
    """train() reached the point where it builds the strategy and launches the Ray actors."""


@pytest.fixture
def launch(monkeypatch):
    import openrlhf.utils
    import ray

    from faircast_plugins.openrlhf import policy

    captured = {}

    def stop_at_launch(args):
        captured["args"] = args
        raise Launched

    monkeypatch.setattr(openrlhf.utils, "get_strategy", stop_at_launch)
    monkeypatch.setattr(ray, "is_initialized", lambda: True)  # no ray.init: nothing is launched

    def run(argv):
        from faircast_plugins.openrlhf.train_ppo_ray import main

        with pytest.raises(Launched):
            main(argv)
        return captured["args"]

    yield run
    policy.POLICY_PATCHES.remove()


def _shipped_init():
    from openrlhf.trainer.ray.ppo_actor import PolicyModelActor

    return PolicyModelActor.__ray_metadata__.modified_class.init_model_from_pretrained


def test_faircast_flags_reach_the_args_every_actor_gets(launch):
    from faircast_plugins.openrlhf import config_from_args, policy

    args = launch(BASE + ["--faircast", "--faircast.mode", "error_feedback", "--faircast.seed", "42", "--faircast.audit"])
    assert vars(args.faircast) == {"enable": True, "mode": "error_feedback", "seed": 42, "ema_decay": 0.0, "audit": True}
    config = config_from_args(args)
    assert (config.enabled, config.mode, config.seed, config.audit) == (True, "error_feedback", 42, True)
    # The class Ray ships to the policy workers now runs Fair Cast's init (stored by reference).
    assert _shipped_init() is policy.init_model_from_pretrained
    assert args.actor.model_name_or_path == "tiny-model"  # OpenRLHF's own args untouched


def test_enable_alias_and_defaults(launch):
    args = launch(BASE + ["--faircast.enable"])
    assert vars(args.faircast) == {"enable": True, "mode": "stochastic", "seed": 0, "ema_decay": 0.0, "audit": False}


def test_without_the_flag_nothing_is_patched(launch):
    from faircast_plugins.openrlhf import config_from_args, policy

    args = launch(BASE)
    assert args.faircast.enable is False
    assert not config_from_args(args).active
    assert _shipped_init() is not policy.init_model_from_pretrained


def test_ema_decay_reaches_the_policy_config(launch):
    from faircast_plugins.openrlhf import config_from_args

    args = launch(BASE + ["--faircast", "--faircast.ema_decay", "0.99"])
    assert args.faircast.ema_decay == 0.99
    config = config_from_args(args)
    assert config.enabled and config.ema_decay == 0.99 and config.mode == "stochastic"


@pytest.mark.parametrize("argv,message", [
    (["--faircast", "--faircast.mode", "sr"], "unknown Fair Cast mode 'sr'"),
    (["--faircast", "--faircast.seed", "-1"], "faircast.seed must be an integer"),
    (["--faircast", "--faircast.seed", "abc"], "faircast.seed must be an integer"),
    (["--faircast", "--faircast.ema_decay", "1.5"], "faircast.ema_decay must be in [0, 1)"),
    (["--faircast", "--faircast.ema_decay", "x"], "faircast.ema_decay must be a number"),
    (["--faircast", "--ds.lora.rank", "8"], "Fair Cast with LoRA (--ds.lora.rank > 0) is not supported"),
])
def test_bad_values_give_a_clear_error(launch, capsys, argv, message):
    from faircast_plugins.openrlhf.train_ppo_ray import main

    with pytest.raises(SystemExit) as exc:
        main(BASE + argv)
    assert exc.value.code == 2
    assert message in capsys.readouterr().err


def test_unknown_faircast_flag_is_an_error(capsys):
    from faircast_plugins.openrlhf.train_ppo_ray import main

    with pytest.raises(SystemExit):
        main(BASE + ["--faircast", "--faircast.bogus", "1"])
    assert "unrecognized arguments: --faircast.bogus" in capsys.readouterr().err


def test_unsupported_openrlhf_version_is_refused(monkeypatch):
    from faircast_plugins import patching
    from faircast_plugins.openrlhf import policy

    monkeypatch.setattr(patching, "installed_version", lambda dist: "0.10.0" if dist == "openrlhf" else None)
    with pytest.raises(patching.FairCastPatchError, match=r"openrlhf>=0.11.2,<0.12; the installed openrlhf is 0.10.0"):
        policy.patch_policy_actor()
    assert not policy.POLICY_PATCHES.active


def _example_argv():
    import os
    import shlex

    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    script = open(os.path.join(root, "examples", "openrlhf", "train_grpo_ray_hybrid_engine.sh")).read()
    tokens = shlex.split(script.replace("\\\n", " "), comments=True)
    start = tokens.index("faircast_plugins.openrlhf.train_ppo_ray") + 1
    return tokens[start:]


def test_example_script_parses_with_openrlhf(launch):
    """examples/openrlhf: every argument is one OpenRLHF 0.11.2 accepts, and only --faircast* is added."""
    argv = _example_argv()
    extra = [a for a in argv if a.startswith("--faircast")]
    assert extra == ["--faircast", "--faircast.seed", "--faircast.audit"]
    args = launch(argv)
    assert (args.faircast.enable, args.faircast.seed, args.faircast.audit) == (True, 1234, True)
    assert args.ds.zero_stage == 2 and args.train.colocate_all and args.algo.advantage.estimator == "group_norm"
