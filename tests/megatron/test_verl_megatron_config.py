"""verl's Megatron options Fair Cast cannot serve exactly are refused before the model is built (the config check)
and, for overlap_param_gather, again when Fair Cast attaches to the built engine (megatron-review.md findings 4 and
11). Without verl: its config is an OmegaConf tree of the keys verl 0.9.1's megatron.yaml / optim megatron.yaml use."""
from __future__ import annotations

from types import SimpleNamespace

import pytest

omegaconf = pytest.importorskip("omegaconf")

from faircast_plugins import FairCastConfig  # noqa: E402
from faircast_plugins.verl import megatron as verl_megatron  # noqa: E402
from faircast_plugins.verl.config import check_supported  # noqa: E402


def _worker_config(**actor):
    tree = {"actor": {"strategy": "megatron", "megatron": {"dtype": "bfloat16"}, "optim": {"optimizer": "adam"}},
            "model": {}, "rollout": {"dtype": "bfloat16"}, "faircast": {"enable": True}}
    for path, value in actor.items():
        node = tree["actor"]
        *parents, leaf = path.split("__")
        for p in parents:
            node = node.setdefault(p, {})
        node[leaf] = value
    return omegaconf.OmegaConf.create(tree)


def test_the_default_megatron_config_is_accepted():
    check_supported(FairCastConfig(enabled=True), _worker_config())


@pytest.mark.parametrize("option,words", [
    ("megatron__override_ddp_config__overlap_param_gather", "overlap_param_gather"),
    ("optim__use_precision_aware_optimizer", "use_precision_aware_optimizer"),
    ("optim__override_optimizer_config__use_precision_aware_optimizer", "use_precision_aware_optimizer"),
    ("optim__override_optimizer_config__optimizer_cpu_offload", "optimizer_cpu_offload"),
    ("optim__use_layer_wise_distributed_optimizer", "layer-wise"),
    ("megatron__override_transformer_config__fp8", "override_transformer_config.fp8"),
    ("megatron__override_transformer_config__quant_recipe", "quant_recipe"),
    ("megatron__override_transformer_config__moe_single_grouped_weight", "moe_single_grouped_weight"),
    ("megatron__override_transformer_config__moe_single_grouped_bias", "moe_single_grouped_bias"),
])
def test_options_it_cannot_serve_are_refused_before_the_model_is_built(option, words):
    value = "e4m3" if option.endswith("fp8") else ("recipe.yaml" if option.endswith("quant_recipe") else True)
    with pytest.raises(ValueError, match=words):
        check_supported(FairCastConfig(enabled=True), _worker_config(**{option: value}))


def test_overlap_param_gather_is_refused_when_fair_cast_attaches_to_the_engine():
    """verl exports right after the step; with the gather overlapped with the next forward, other DP ranks' params
    would be a version old (finding 4): refused on the built engine too (its DDP config or the optimizer's)."""
    for module, opt_config in (([SimpleNamespace(ddp_config=SimpleNamespace(overlap_param_gather=True))], None),
                               ([], SimpleNamespace(overlap_param_gather=True))):
        engine = SimpleNamespace(module=module, optimizer=SimpleNamespace(config=opt_config), _qat_enabled=False,
                                 vanilla_bridge=False)
        with pytest.raises(ValueError, match="overlap_param_gather"):
            verl_megatron.activate(engine, FairCastConfig(enabled=True))


@pytest.mark.parametrize("option,value", [("quant_recipe", "recipe.yaml"), ("use_kitchen", True)])
def test_per_layer_quantization_is_refused_at_attach(option, value):
    """megatron-core 0.18.2's quant_recipe / use_kitchen quantize the weights the forward reads (finding 11)."""
    from faircast_plugins.megatron.patch import refused_model_options

    refusals = list(refused_model_options([SimpleNamespace(config=SimpleNamespace(**{option: value}))]))
    assert len(refusals) == 1 and option in refusals[0], refusals


def test_policy_metrics_are_refused_by_the_megatron_patch():
    """Without a caller that measures faircast/policy_* (apply_megatron_patch(measure_policy=True): verl's Megatron
    engine, tests/megatron/test_policy.py), asking for them must raise at attach, not log nothing."""
    from faircast_plugins.caster import FairCaster
    from faircast_plugins.config import FairCastConfig
    from faircast_plugins.megatron import apply_megatron_patch
    from faircast_plugins.patching import FairCastPatchError

    for config in (FairCastConfig(enabled=True, policy_metrics_every=10), FairCastConfig(policy_metrics_every=10)):
        with pytest.raises(FairCastPatchError, match="policy_metrics_every=10 is not measured by Megatron-core"):
            apply_megatron_patch(object(), FairCaster(config), model_chunks=[object()])


def test_verl_accepts_policy_metrics_on_the_megatron_strategy():
    """verl's Megatron engine measures faircast/policy_* (faircast_plugins/verl/megatron.py), so the config check
    before the model build accepts it there (as on the FSDP strategies, tests/verl)."""
    from faircast_plugins.verl.config import check_supported, read_faircast

    config = _worker_config()
    config.faircast = {"enable": True, "policy_metrics_every": 5}
    faircast = read_faircast(config)
    assert faircast.policy_metrics_every == 5
    check_supported(faircast, config)  # no refusal on actor.strategy=megatron
