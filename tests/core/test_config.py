"""FairCastConfig: what users write in YAML/CLI, and clear errors for everything else."""
import pytest

from faircast_plugins import FairCastConfig


@pytest.mark.parametrize("value,enabled", [(True, True), (False, False), ("true", True), ("False", False),
                                           ("1", True), (0, False), (None, False)])
def test_flag_forms(value, enabled):
    assert FairCastConfig.from_value(value).enabled is enabled


def test_mapping_form_defaults_to_enabled_and_takes_sub_options():
    cfg = FairCastConfig.from_value({"mode": "error_feedback", "seed": "17", "audit": "yes"})
    assert (cfg.enabled, cfg.mode, cfg.seed, cfg.audit) == (True, "error_feedback", 17, True)
    assert FairCastConfig.from_value({"enable": False, "audit": True}).active


@pytest.mark.parametrize("mode", ["stochastic", "sticky", "nearest", "error_feedback"])
def test_every_mode_is_accepted(mode):
    assert FairCastConfig.from_value({"mode": mode}).effective_mode == mode


def test_overrides_win_and_none_overrides_are_ignored():
    cfg = FairCastConfig.from_value(True, mode="nearest", seed=None)
    assert cfg.mode == "nearest" and cfg.seed == 0


@pytest.mark.parametrize("value,match", [
    ({"mode": "stochastic_rounding"}, "unknown Fair Cast mode"),
    ({"seed": -1}, "seed must be an integer"),
    ({"seed": 2**64}, "seed must be an integer"),
    ({"seed": 1.5}, "seed must be an integer"),
    ({"ema_decay": 1.0}, "ema_decay must be in"),
    ({"ema_decay": "abc"}, "ema_decay must be a number"),
    ({"mode": "error_feedback", "ema_decay": 0.9}, "not supported"),
    ({"audit_sample": 0}, "audit_sample"),
    ({"backend": "gpu"}, "backend must be one of"),
    ({"enable": True, "enabled": True}, "not both"),
    ({"moed": "nearest"}, "unknown faircast option"),
    ("maybe", "must be true or false"),
    (2, "must be true or false"),
])
def test_bad_values_are_clear_errors(value, match):
    with pytest.raises(ValueError, match=match):
        FairCastConfig.from_value(value)


def test_effective_mode_is_nearest_when_disabled():
    assert FairCastConfig(enabled=False, mode="stochastic", audit=True).effective_mode == "nearest"
    assert FairCastConfig(enabled=True, mode="error_feedback").effective_mode == "error_feedback"
