"""``python -m faircast_plugins.openrlhf.train_ppo_ray``: OpenRLHF's own parser, asserts and ``train()``.

Each test runs the real ``openrlhf.cli.train_ppo_ray`` as ``__main__`` with the given argv, through
OpenRLHF's parsing, ``hierarchize`` and argument checks, up to ``train()``'s first step that would launch
Ray actors (``get_strategy``), where the test stops it and inspects the args every actor would receive.
"""
from __future__ import annotations

import hashlib
import os
import subprocess

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


@pytest.mark.parametrize("mode", ["error_feedback", "sticky"])
def test_faircast_flags_reach_the_args_every_actor_gets(launch, mode):
    from faircast_plugins.openrlhf import config_from_args, policy

    args = launch(BASE + ["--faircast", "--faircast.mode", mode, "--faircast.seed", "42", "--faircast.audit"])
    assert vars(args.faircast) == {"enable": True, "mode": mode, "seed": 42, "ema_decay": 0.0, "audit": True,
                                   "policy_metrics_every": 0, "policy_metrics_seqs": 2}
    config = config_from_args(args)
    assert (config.enabled, config.mode, config.seed, config.audit) == (True, mode, 42, True)
    # The class Ray ships to the policy workers now runs Fair Cast's init (stored by reference).
    assert _shipped_init() is policy.init_model_from_pretrained
    assert args.actor.model_name_or_path == "tiny-model"  # OpenRLHF's own args untouched


def test_enable_alias_and_defaults(launch):
    args = launch(BASE + ["--faircast.enable"])
    assert vars(args.faircast) == {"enable": True, "mode": "stochastic", "seed": 0, "ema_decay": 0.0, "audit": False,
                                   "policy_metrics_every": 0, "policy_metrics_seqs": 2}


def test_policy_metrics_flags_reach_the_policy_config_without_faircast(launch):
    """--faircast.policy_metrics_every alone (Fair Cast off: the metric then shows the standard export's lag) patches
    the policy actor, whose init attaches the probe."""
    from faircast_plugins.openrlhf import config_from_args, policy

    args = launch(BASE + ["--faircast.policy_metrics_every", "10", "--faircast.policy_metrics_seqs", "4"])
    config = config_from_args(args)
    assert (config.enabled, config.policy_metrics_every, config.policy_metrics_seqs) == (False, 10, 4)
    assert config.active and _shipped_init() is policy.init_model_from_pretrained


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
    (["--faircast", "--ds.tensor_parallel_size", "2"], "Fair Cast with DeepSpeed AutoTP (--ds.tensor_parallel_size > 1)"),
    (["--faircast.policy_metrics_every", "-1"], "faircast.policy_metrics_every"),
    (["--faircast.policy_metrics_every", "10", "--faircast.policy_metrics_seqs", "0"], "faircast.policy_metrics_seqs"),
    (["--faircast.policy_metrics_every", "10", "--ds.ring_attn_size", "2", "--ds.packing_samples"],
     "--faircast.policy_metrics_every is not supported with ring attention (--ds.ring_attn_size 2)"),
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


# OpenRLHF's Ray examples that examples/openrlhf/ copies (OpenRLHF/OpenRLHF at this commit; path -> git blob id).
UPSTREAM_COMMIT = "3c3be6234e0cb353e76bb8019947db9dfe99fca7"
EXAMPLES = {
    "train_ppo_with_reward_fn.sh": "142cbf62f8300b316b61e7bfbcd0ce3777bf6ca6",
    "train_dapo_ray_hybrid_engine.sh": "37dab000a1a37696a038993f6502e7148f342484",
}
EXAMPLE_DIR = os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))), "examples", "openrlhf")
NOTES_END = "# ---- end of the Fair Cast notes: below is OpenRLHF's script ----\n"
# The documented changes, as (upstream text, example text).
ENTRY = ("python3 -m openrlhf.cli.train_ppo_ray \\\n", "python3 -m faircast_plugins.openrlhf.train_ppo_ray \\\n   --faircast \\\n")
# openrlhf 0.11.2 spells the TIS correction of the upstream scripts (clamp the token-level ratio into [0.5, 5]) so:
IS_CORRECTION = ("   --algo.advantage.is_correction_enable\n",
                 "   --algo.advantage.is_correction_level token --algo.advantage.is_correction_mode clip\n")


def _upstream_text(script: str) -> str:
    """Undo exactly the documented changes: the notes, the entry point and --faircast, the 0.11.2 spelling."""
    head, sep, text = script.partition(NOTES_END)
    assert sep and all(line.startswith("#") for line in head.splitlines()), "the Fair Cast notes are comment lines"
    assert text.count(ENTRY[1]) == 1
    text = text.replace(ENTRY[1], ENTRY[0])
    assert text.count(IS_CORRECTION[1]) <= 1
    return text.replace(IS_CORRECTION[1], IS_CORRECTION[0])


@pytest.mark.parametrize("name", sorted(EXAMPLES))
def test_example_is_openrlhfs_own_script_plus_faircast(name):
    """examples/openrlhf/<name> is OpenRLHF's examples/scripts/<name> at UPSTREAM_COMMIT but for the documented
    changes: with them undone, the text has upstream's git blob id (sha1 of "blob <size>\\0" + content)."""
    script = open(os.path.join(EXAMPLE_DIR, name)).read()
    assert UPSTREAM_COMMIT in script and EXAMPLES[name] in script  # the provenance note
    data = _upstream_text(script).encode()
    blob = hashlib.sha1(b"blob %d\0" % len(data) + data).hexdigest()
    assert blob == EXAMPLES[name], f"{name} differs from OpenRLHF's examples/scripts/{name} beyond the documented changes"


# bash runs the example with python3 (and `ray job submit ... --`) replaced by functions that print the arguments.
_PRINT_ARGV = 'python3() { printf "%s\\0" "$@"; }; ray() { while [ "$#" -gt 0 ] && [ "$1" != "--" ]; do shift; done; shift; "$@"; }; source "$1"'


def _example_argv(name: str) -> list:
    proc = subprocess.run(["bash", "-c", _PRINT_ARGV, "bash", os.path.join(EXAMPLE_DIR, name)],
                          capture_output=True, text=True, check=True)
    argv = proc.stdout.split("\0")[:-1]
    assert argv[:2] == ["-m", "faircast_plugins.openrlhf.train_ppo_ray"], argv[:2]
    return argv[2:]


EXPECTED = {  # a few values each example must arrive with, to see that the whole command line was parsed
    "train_ppo_with_reward_fn.sh": {("ds", "zero_stage"): 3, ("ds", "adam_offload"): True,
                                    ("algo", "advantage", "estimator"): "gae", ("train", "colocate_actor_ref"): True},
    "train_dapo_ray_hybrid_engine.sh": {("ds", "zero_stage"): 3, ("train", "colocate_all"): True,
                                        ("algo", "advantage", "estimator"): "group_norm",
                                        ("algo", "advantage", "is_correction_level"): "token",
                                        ("algo", "advantage", "is_correction_mode"): "clip",
                                        ("algo", "dynamic_filtering_enable"): True},
}


@pytest.mark.parametrize("name", sorted(EXAMPLES))
def test_example_parses_with_openrlhf(launch, name):
    """Every argument of the example is one the installed OpenRLHF (0.11.2) accepts, through its own parser and
    argument checks, and the only Fair Cast argument is --faircast."""
    argv = _example_argv(name)
    assert [a for a in argv if a.startswith("--faircast")] == ["--faircast"]
    args = launch(argv)
    assert args.faircast.enable is True and args.faircast.mode == "stochastic"
    assert args.actor.model_name_or_path == "OpenRLHF/Llama-3-8b-sft-mixture"
    for path, want in EXPECTED[name].items():
        value = args
        for part in path:
            value = getattr(value, part)
        assert value == want, (".".join(path), value)


def test_policy_actor_refuses_autotp_before_loading_the_model():
    """The policy actor's init checks the hierarchized args too (a run started without this CLI)."""
    from types import SimpleNamespace

    from faircast_plugins.openrlhf.policy import check_supported
    from faircast_plugins.patching import FairCastPatchError

    def args(tp, enable=True):
        return SimpleNamespace(faircast=SimpleNamespace(enable=enable),
                               ds=SimpleNamespace(tensor_parallel_size=tp, lora=SimpleNamespace(rank=0)))

    with pytest.raises(FairCastPatchError, match=r"--ds.tensor_parallel_size > 1"):
        check_supported(args(2))
    assert check_supported(args(1)).active
    assert not check_supported(args(2, enable=False)).active  # Fair Cast off: nothing to refuse
