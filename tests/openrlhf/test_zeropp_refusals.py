"""ZeRO++ weight quantization is refused at activation (docs/gpu-paths.md, finding 1): the forward would run on
dequant(int8(served copy)) while the rollout engine gets the bf16 served copy. The flags are set on a built engine's
config (the quantizer itself is CUDA-only), which is exactly what the check reads."""
from __future__ import annotations

import pytest

from faircast_plugins.patching import FairCastPatchError
from test_deepspeed_refusals import _caster, _engine, deepspeed_world1  # noqa: F401  (the world-size-1 fixture)

QUANTIZED_WEIGHTS = ["zero_quantized_weights", "zero_quantized_nontrainable_weights"]


@pytest.mark.parametrize("option", QUANTIZED_WEIGHTS)
def test_zeropp_quantized_weights_are_refused(deepspeed_world1, option):  # noqa: F811
    from faircast_plugins.deepspeed import apply_deepspeed_patch

    engine = _engine(deepspeed_world1)
    setattr(engine._config.zero_config, option, True)
    with pytest.raises(FairCastPatchError, match=rf"{option}=true .*dequant\(int8\(served copy\)\).*Set "
                                                 rf"zero_optimization.{option} to false"):
        apply_deepspeed_patch(engine, _caster())
    assert "_faircast" not in engine.__dict__


def test_zeropp_options_that_keep_the_served_bits_are_accepted(deepspeed_world1):  # noqa: F811
    """Negative control: hpZ (a bf16 secondary copy of the gathered served copy) and quantized gradients (not the
    weights) leave the forward on the served copy, so Fair Cast attaches; with the quantized-weight flags false too."""
    from faircast_plugins.deepspeed import apply_deepspeed_patch, remove_deepspeed_patch

    engine = _engine(deepspeed_world1)
    zero = engine._config.zero_config
    zero.zero_hpz_partition_size, zero.zero_quantized_gradients = 2, True
    assert all(getattr(zero, option) is False for option in QUANTIZED_WEIGHTS)
    assert apply_deepspeed_patch(engine, _caster()) is not None
    remove_deepspeed_patch(engine)


def test_zeropp_refusals_read_a_deepspeed_json_section():
    from faircast_plugins.deepspeed.patch import zeropp_refusals

    assert zeropp_refusals({"stage": 3, "zero_hpz_partition_size": 8, "zero_quantized_gradients": True}) == []
    found = zeropp_refusals({"stage": 3, "zero_quantized_weights": True, "zero_quantized_nontrainable_weights": True})
    assert [r.split("=")[0] for r in found] == [f"ZeRO++ {o}" for o in QUANTIZED_WEIGHTS]
