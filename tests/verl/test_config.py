"""The flag in verl configs (YAML, ``+`` override, wrapper), clear errors on bad values, and plugin activation."""
from __future__ import annotations

import importlib.metadata
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
from omegaconf import OmegaConf

from faircast_plugins.verl.config import check_supported, read_faircast

from .harness import compose, cpu_overrides

ROOT = Path(__file__).resolve().parents[2]
EXAMPLES = ROOT / "examples" / "verl"
WRAPPER_CONFIG = ROOT / "faircast_plugins" / "verl" / "hydra_config" / "faircast_ppo_trainer.yaml"


def validated(cfg):
    """verl's own driver-side validation, as main_ppo runs it."""
    from verl.trainer.ppo.utils import need_critic, need_reference_policy
    from verl.utils.config import validate_config

    validate_config(config=cfg, use_reference_policy=need_reference_policy(cfg), use_critic=need_critic(cfg))
    return cfg


def _run(args, **env):
    return subprocess.run([sys.executable, *args], cwd=ROOT, capture_output=True, text=True, timeout=600,
                          env={**os.environ, "PYTHONPATH": str(ROOT), **env})


# -- the flag reaches actor_rollout_ref.faircast ----------------------------------------------------------------


GRPO = "algorithm.adv_estimator=grpo"  # no critic: validation then loads only the (tiny) actor model


def test_plus_override_on_verls_own_config(model_dir):
    cfg = validated(compose(cpu_overrides(model_dir, "fsdp2", 8, 1) + [GRPO, "+actor_rollout_ref.faircast=true"]))
    fc = read_faircast(cfg.actor_rollout_ref)
    assert fc.enabled and fc.mode == "stochastic" and fc.seed == 0
    check_supported(fc, cfg.actor_rollout_ref)


def test_plus_override_mapping(model_dir):
    cfg = compose(cpu_overrides(model_dir, "fsdp", 8, 1)
                  + [GRPO, "+actor_rollout_ref.faircast={enable:true,mode:stochastic,seed:7,audit:true}"])
    fc = read_faircast(validated(cfg).actor_rollout_ref)
    assert fc.enabled and fc.seed == 7 and fc.audit


def test_absent_flag_means_off():
    cfg = compose(cpu_overrides("/x", "fsdp2", 8, 1))
    assert read_faircast(cfg.actor_rollout_ref) is None


@pytest.mark.parametrize("name", ["grpo_gsm8k_faircast", "grpo_tiny_cpu"])
def test_flag_in_user_yaml(name, model_dir):
    cfg = compose([f"actor_rollout_ref.model.path={model_dir}"], str(EXAMPLES / f"{name}.yaml"))
    validated(cfg)
    fc = read_faircast(cfg.actor_rollout_ref)
    assert fc.enabled
    check_supported(fc, cfg.actor_rollout_ref)
    assert cfg.algorithm.adv_estimator == "grpo"


@pytest.mark.parametrize("flag, enabled, seed", [("faircast=true", True, 0), ("faircast=false", False, 0),
                                                  ("faircast={enable:true,seed:9}", True, 9)])
def test_wrapper_config_top_level_flag(flag, enabled, seed, model_dir):
    cfg = validated(compose(cpu_overrides(model_dir, "fsdp2", 8, 1) + [GRPO, flag], str(WRAPPER_CONFIG)))
    fc = read_faircast(cfg.actor_rollout_ref)
    assert fc.enabled is enabled and fc.seed == seed


def test_wrapper_cli_composes_and_forwards_the_flag():
    """``python -m faircast_plugins.verl.main_ppo faircast=true --cfg job`` prints the composed job config."""
    proc = _run(["-m", "faircast_plugins.verl.main_ppo", "faircast=true", "--cfg", "job", "--resolve"])
    assert proc.returncode == 0, proc.stderr[-3000:]
    job = OmegaConf.create(proc.stdout)
    assert job.faircast is True and job.actor_rollout_ref.faircast is True
    assert job.algorithm.adv_estimator == "gae"  # verl's own defaults are untouched


def test_wrapper_rejects_bad_value_before_starting_anything(model_dir):
    """The wrapper validates the flag in the driver, before verl's main_ppo (and Ray) would start."""
    from faircast_plugins.verl.main_ppo import run

    cfg = compose(cpu_overrides(model_dir, "fsdp2", 8, 1) + [GRPO, "faircast=maybe"], str(WRAPPER_CONFIG))
    with pytest.raises(ValueError, match="actor_rollout_ref.faircast: faircast must be true or false, got 'maybe'"):
        run(cfg)


# -- clear errors ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("value, message", [
    ("maybe", "must be true or false"),
    ({"enable": True, "mode": "bogus"}, "unknown Fair Cast mode"),
    ({"enable": True, "sed": 1}, "unknown faircast option"),
    ({"enable": True, "seed": -1}, "seed must be an integer"),
    ({"enable": True, "ema_decay": 1.5}, "ema_decay must be in"),
])
def test_bad_values_are_clear_errors(value, message):
    with pytest.raises(ValueError, match="actor_rollout_ref.faircast") as err:
        read_faircast(OmegaConf.create({"faircast": value}))
    assert message in str(err.value)


@pytest.mark.parametrize("override, message", [
    ("actor_rollout_ref.actor.strategy=megatron,+actor_rollout_ref.actor.megatron.dtype=float16", "dtype=bfloat16"),
    ("actor_rollout_ref.actor.strategy=megatron,+actor_rollout_ref.actor.megatron.vanilla_mbridge=true", "vanilla_mbridge"),
    ("actor_rollout_ref.actor.strategy=megatron,actor_rollout_ref.model.lora_rank=8", "LoRA"),
    ("actor_rollout_ref.actor.strategy=megatron,actor_rollout_ref.rollout.quantization=fp8", "bf16 only"),
    ("actor_rollout_ref.model.lora_rank=8,actor_rollout_ref.actor.strategy=fsdp", "fsdp2 only"),
    ("actor_rollout_ref.rollout.dtype=float16", "bf16 rollout"),
])
def test_unsupported_setups_are_refused(override, message):
    """Refused before the model is built, with the reason (unmerged LoRA, below, is supported)."""
    cfg = compose(cpu_overrides("/x", "fsdp2", 8, 1) + ["+actor_rollout_ref.faircast=true", *override.split(",")])
    fc = read_faircast(cfg.actor_rollout_ref)
    with pytest.raises(ValueError, match=message):
        check_supported(fc, cfg.actor_rollout_ref)


POLICY = "+actor_rollout_ref.faircast={enable:true,policy_metrics_every:10}"


@pytest.mark.parametrize("override, message", [
    ("actor_rollout_ref.actor.ulysses_sequence_parallel_size=2", "ulysses_sequence_parallel_size=2"),
    ("actor_rollout_ref.model.use_fused_kernels=true", "use_fused_kernels=true"),
    ("actor_rollout_ref.model.lora_rank=8", "LoRA"),
    ("actor_rollout_ref.rollout.quantization=fp8", "rollout.quantization=fp8"),
])
def test_policy_metrics_refusals(override, message):
    """policy_metrics_every where verl's FSDP probe would not measure what the rollout serves: refused, named."""
    cfg = compose(cpu_overrides("/x", "fsdp2", 8, 1) + [POLICY, *override.split(",")])
    fc = read_faircast(cfg.actor_rollout_ref)
    with pytest.raises(ValueError, match="policy_metrics_every=10 .*" + message):
        check_supported(fc, cfg.actor_rollout_ref)


@pytest.mark.parametrize("strategy", ["fsdp", "fsdp2", "megatron"])
def test_policy_metrics_accepted_on_the_fsdp_and_megatron_engines(strategy):
    """Measured by verl/policy.py (FSDP) and verl/megatron.py (Megatron; its own refusals at attach, tests/megatron)."""
    extra = ["actor_rollout_ref.actor.strategy=megatron"] if strategy == "megatron" else []
    cfg = compose(cpu_overrides("/x", "fsdp2" if extra else strategy, 8, 1) + [POLICY, *extra])
    fc = read_faircast(cfg.actor_rollout_ref)
    assert fc.policy_metrics_every == 10
    check_supported(fc, cfg.actor_rollout_ref)


@pytest.mark.parametrize("extra", [
    ["actor_rollout_ref.model.lora_rank=8"],                                     # unmerged LoRA
    ["actor_rollout_ref.model.lora_rank=8", "actor_rollout_ref.model.lora.merge=true",   # merged LoRA (opt-in)
     "+actor_rollout_ref.faircast.allow_merged_lora=true"],
    ["actor_rollout_ref.model.lora_rank=8", "actor_rollout_ref.model.lora.merge=true",
     "+actor_rollout_ref.faircast.allow_merged_lora=true", "+actor_rollout_ref.faircast.mode=sticky"],
    ["actor_rollout_ref.rollout.checkpoint_engine.backend=delta_sharded"],
    ["+actor_rollout_ref.faircast.mode=error_feedback"],
    ["+actor_rollout_ref.faircast.ema_decay=0.5"],
    ["actor_rollout_ref.actor.strategy=fsdp", "+actor_rollout_ref.faircast.mode=error_feedback"],
    ["actor_rollout_ref.actor.strategy=megatron"],                                 # Megatron (docs/megatron.md)
    ["actor_rollout_ref.actor.strategy=megatron", "+actor_rollout_ref.faircast.mode=error_feedback"],
])
def test_supported_setups_are_accepted(extra):
    sub_options = any("faircast." in e for e in extra)
    flag = ["+actor_rollout_ref.faircast.enable=true" if sub_options else "+actor_rollout_ref.faircast=true"]
    cfg = compose(cpu_overrides("/x", "fsdp2", 8, 1) + flag + extra)
    check_supported(read_faircast(cfg.actor_rollout_ref), cfg.actor_rollout_ref)


@pytest.mark.parametrize("mode_value", [{"enable": True, "mode": "error_feedback"}, {"enable": True, "ema_decay": 0.5}])
def test_stateful_modes_with_merged_lora_are_refused(mode_value):
    """The merged weight W + s*B@A is no FSDP parameter: there is no per-shard residual or EMA for it."""
    cfg = compose(cpu_overrides("/x", "fsdp2", 8, 1) + ["actor_rollout_ref.model.lora_rank=8",
                                                          "actor_rollout_ref.model.lora.merge=true"])
    fc = read_faircast(OmegaConf.create({"faircast": mode_value}))
    with pytest.raises(ValueError, match="lora.merge=true supports mode=stochastic"):
        check_supported(fc, cfg.actor_rollout_ref)
    opted = compose(cpu_overrides("/x", "fsdp2", 8, 1) + ["actor_rollout_ref.model.lora_rank=8",
                                                            "actor_rollout_ref.model.lora.merge=true",
                                                            "+actor_rollout_ref.faircast.allow_merged_lora=true"])
    check_supported(read_faircast(opted.actor_rollout_ref), opted.actor_rollout_ref)  # control: stochastic, opted in


# -- plugin activation ----------------------------------------------------------------------------------------

_PROBE = ("import verl, verl.workers.engine_workers as w; from faircast_plugins.patching import is_patched; "
          "print('PATCHED' if is_patched(w.ActorRolloutRefWorker.init_model) else 'UNPATCHED')")


def test_entry_point_is_registered():
    from importlib.metadata import entry_points

    eps = {ep.name: ep.value for ep in entry_points(group="verl.plugins")}
    assert eps.get("faircast") == "faircast_plugins.verl.plugin"


def test_plugin_patches_verl_on_import_and_logs_loudly():
    proc = _run(["-c", _PROBE])
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "PATCHED" in proc.stdout
    assert "Fair Cast ACTIVE for verl 0.9.1: patched 14 symbol(s)" in proc.stderr  # 14: the blocking offload (finding 8)


def test_plugin_disabled_by_verl_policy_patches_nothing():
    """Control: with verl's plugin loading switched off, nothing is patched."""
    proc = _run(["-c", _PROBE], VERL_USE_EXTERNAL_PLUGINS="none")
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "UNPATCHED" in proc.stdout and "Fair Cast ACTIVE" not in proc.stderr


def test_explicit_patch_before_verls_worker_module_is_imported_patches_once():
    """``patch()`` in a fresh process, before verl's worker module is imported: importing it fires the plugin's
    post-import hook inside ``patch()``; every symbol must end up wrapped once, and ``patch()`` again is a no-op."""
    code = (
        "import faircast_plugins.verl.patches as p; p.patch(); p.patch()\n"
        "import verl.workers.engine_workers\n"
        "from faircast_plugins.patching import is_patched, resolve\n"
        "values = [resolve(t)[2] for t in p.PATCHES.targets]\n"
        "print('UNPATCHED', sum(not is_patched(v) for v in values))\n"
        "print('TWICE', sum(is_patched(getattr(v, '__wrapped__', None)) for v in values))\n"
    )
    proc = _run(["-c", code])
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "UNPATCHED 0" in proc.stdout and "TWICE 0" in proc.stdout, proc.stdout
    assert proc.stderr.count("Fair Cast ACTIVE for verl") == 1


def test_unsupported_verl_version_is_refused_loudly():
    """Outside the supported range nothing is patched, an ERROR names the installed verl, and a worker whose
    config asks for Fair Cast refuses to start."""
    code = (
        "import faircast_plugins.verl.patches as p; p.PATCHES.specifier = '>=0.10,<0.11'\n"
        "import verl, verl.workers.engine_workers as w\n"
        "from types import SimpleNamespace\nfrom omegaconf import OmegaConf\n"
        "from faircast_plugins.patching import FairCastPatchError\n"
        "try:\n"
        "    w.ActorRolloutRefWorker.init_model(SimpleNamespace(config=OmegaConf.create({'faircast': True})))\n"
        "except FairCastPatchError as e:\n"
        "    print('REFUSED:', e)\n"
    )
    proc = _run(["-c", code])
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "Fair Cast is UNAVAILABLE" in proc.stderr and "installed verl is 0.9.1" in proc.stderr
    assert "REFUSED: actor_rollout_ref.faircast is set but Fair Cast cannot run" in proc.stdout


def test_missing_symbol_names_the_installed_version():
    from faircast_plugins.patching import FairCastPatchError
    from faircast_plugins.verl.patches import build_patch_set

    patches = build_patch_set().wrap("verl.workers.engine_workers:ActorRolloutRefWorker.no_such_method", lambda f: f)
    with pytest.raises(FairCastPatchError, match=r"cannot patch verl 0\.9\.1.*no_such_method"):
        patches.apply()
    assert not patches.active


@pytest.mark.parametrize("method", ["get_per_tensor_param_shard", "_merged_lora_per_tensor_param"])
def test_export_paths_are_patched(method):
    import verl.workers.engine_workers  # noqa: F401  (importing it applies the plugin's patches)
    from verl.workers.engine.fsdp.transformer_impl import FSDPEngine

    from faircast_plugins.patching import is_patched

    assert is_patched(getattr(FSDPEngine, method))


def test_unverified_torch_is_refused_with_its_version(monkeypatch):
    """The FSDP cast sites are private torch APIs: outside the verified torch range activation fails, naming it."""
    from faircast_plugins import fsdp
    from faircast_plugins.patching import FairCastPatchError

    installed = importlib.metadata.version("torch")  # the distribution's version (a CUDA build's has no +cuXXX)
    monkeypatch.setattr(fsdp.PATCHES, "specifier", ">=1.0,<2.0")  # a range no supported torch is in
    with pytest.raises(FairCastPatchError, match=re.escape(f"installed torch is {installed}")):
        fsdp.apply_fsdp_cast_patches()
    assert not fsdp.PATCHES.active


def test_torch_under_test_is_the_one_intended_and_supported():
    """The torch-range sessions (noxfile tests-verl-torch) name the torch they install: the resolver must not have
    swapped it, and it must be inside the range the FSDP cast patches accept (TORCH_SPECIFIER)."""
    from packaging.specifiers import SpecifierSet
    from packaging.version import Version

    from faircast_plugins import fsdp

    installed = importlib.metadata.version("torch")
    expected = os.environ.get("FAIRCAST_EXPECT_TORCH")
    if expected:
        assert installed == expected, f"the session asked for torch {expected} but {installed} is installed"
    assert Version(installed) in SpecifierSet(fsdp.TORCH_SPECIFIER), (installed, fsdp.TORCH_SPECIFIER)


# -- delta weight sync defaults to the sparse mode (issue 29, item 4) -------------------------------------------

DELTA = "actor_rollout_ref.rollout.checkpoint_engine.backend=delta_sharded"


def _delta_cfg(*faircast):
    return compose(cpu_overrides("/x", "fsdp2", 8, 1) + list(faircast) + [DELTA]).actor_rollout_ref


def test_delta_sync_without_a_mode_uses_sticky_and_says_why():
    from faircast_plugins.verl.config import delta_sync_advice

    for flag in (["+actor_rollout_ref.faircast=true"], ["+actor_rollout_ref.faircast.enable=true",
                                                         "+actor_rollout_ref.faircast.audit=true"]):
        cfg = _delta_cfg(*flag)
        assert read_faircast(cfg).mode == "sticky"
        level, message = delta_sync_advice(cfg)
        assert level == "info" and "sticky" in message and "delta_sharded" in message and "4.35%" in message
    # control: without delta sync the default stays stochastic, and nothing is said
    plain = compose(cpu_overrides("/x", "fsdp2", 8, 1) + ["+actor_rollout_ref.faircast=true"]).actor_rollout_ref
    assert read_faircast(plain).mode == "stochastic" and delta_sync_advice(plain) is None


@pytest.mark.parametrize("mode, ratio", [("stochastic", "7.0x"), ("error_feedback", "10.2x")])
def test_delta_sync_with_a_dense_mode_set_explicitly_warns_with_the_payload_ratio(mode, ratio):
    from faircast_plugins.verl.config import delta_sync_advice

    cfg = _delta_cfg("+actor_rollout_ref.faircast.enable=true", f"+actor_rollout_ref.faircast.mode={mode}")
    assert read_faircast(cfg).mode == mode  # the user's choice stands
    level, message = delta_sync_advice(cfg)
    assert level == "warning" and ratio in message and "mode=sticky" in message and mode in message


def test_delta_sync_with_sticky_or_nearest_or_faircast_off_says_nothing():
    from faircast_plugins.verl.config import delta_sync_advice

    for extra in (["+actor_rollout_ref.faircast.enable=true", "+actor_rollout_ref.faircast.mode=sticky"],
                  ["+actor_rollout_ref.faircast.enable=true", "+actor_rollout_ref.faircast.mode=nearest"],
                  ["+actor_rollout_ref.faircast.enable=false", "+actor_rollout_ref.faircast.audit=true"]):
        assert delta_sync_advice(_delta_cfg(*extra)) is None, extra
    assert read_faircast(_delta_cfg("+actor_rollout_ref.faircast.enable=false",
                                    "+actor_rollout_ref.faircast.audit=true")).effective_mode == "nearest"
