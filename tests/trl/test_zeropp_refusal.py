"""ZeRO++ weight quantization in the user's DeepSpeed JSON is refused when the trainer is built (docs/gpu-paths.md,
finding 1): the loss would run on dequant(int8(served copy)) while vLLM gets the bf16 served copy. The built engine is
refused again when the DeepSpeed patch attaches (tests/openrlhf/test_zeropp_refusals.py). No engine is built here:
``args.deepspeed`` is set after the arguments are constructed, as in test_deepspeed_without_bf16_is_refused."""
from __future__ import annotations

import json

import pytest

import faircast_plugins.trl  # noqa: F401  (patches TRL)
from faircast_plugins.trl import FairCastUnsupportedError
from faircast_plugins.trl.refusals import check_args
from helpers import grpo_args, grpo_trainer

QUANTIZED_WEIGHTS = ["zero_quantized_weights", "zero_quantized_nontrainable_weights"]


@pytest.mark.parametrize("option", QUANTIZED_WEIGHTS)
def test_zeropp_quantized_weights_in_the_deepspeed_json_are_refused(option, tiny_model_dir, prompts_dataset, tmp_path):
    args = grpo_args(tmp_path, faircast=True, bf16=True)
    args.deepspeed = {"zero_optimization": {"stage": 3, option: True}}
    with pytest.raises(FairCastUnsupportedError, match=rf"GRPOTrainer is refused: ZeRO\+\+ {option}=true.*"
                                                       rf"Set zero_optimization.{option} to false"):
        grpo_trainer(tiny_model_dir, prompts_dataset, args)


def test_zeropp_refusal_reads_a_deepspeed_json_file(tmp_path):
    path = tmp_path / "ds.json"
    path.write_text(json.dumps({"bf16": {"enabled": True}, "zero_optimization": {"stage": 3, "zero_quantized_weights": True}}))
    args = grpo_args(tmp_path, faircast=True, bf16=True)
    args.deepspeed = str(path)
    with pytest.raises(FairCastUnsupportedError, match="zero_quantized_weights=true"):
        check_args("GRPOTrainer", args)


def test_zeropp_options_that_keep_the_served_bits_pass_the_argument_check(tmp_path):
    """Negative controls: hpZ and quantized gradients (and the quantized-weight flags false) are accepted; without
    Fair Cast the quantized weights are TRL's business, not refused."""
    args = grpo_args(tmp_path, faircast=True, bf16=True)
    args.deepspeed = {"zero_optimization": {"stage": 3, "zero_hpz_partition_size": 8, "zero_quantized_gradients": True,
                                            "zero_quantized_weights": False}}
    check_args("GRPOTrainer", args)
    off = grpo_args(tmp_path, bf16=True)
    off.deepspeed = {"zero_optimization": {"stage": 3, "zero_quantized_weights": True}}
    from faircast_plugins.trl.config import faircast_config

    cfg = faircast_config(off)
    assert cfg is None or not cfg.active  # the trainer's __init__ patch runs check_args only when Fair Cast is active
