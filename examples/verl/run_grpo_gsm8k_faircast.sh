#!/usr/bin/env bash
# verl's GSM8K GRPO example (examples/grpo_trainer/run_qwen2-7b.sh) with Fair Cast on; extra overrides pass through.
# Needs Fair Cast installed from a checkout (not on PyPI), on every node: pip install ".[verl]" (or the wheel built by
# python -m build --wheel); the verl.plugins entry point loads Fair Cast in every Ray worker.
set -euxo pipefail
here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
python3 -m verl.trainer.main_ppo --config-path "$here" --config-name grpo_gsm8k_faircast "$@"

# Equivalent without a config file, through the wrapper's top-level flag:
#   python3 -m faircast_plugins.verl.main_ppo faircast=true algorithm.adv_estimator=grpo ...   (same overrides)
# or through verl's own entry point:
#   python3 -m verl.trainer.main_ppo +actor_rollout_ref.faircast=true algorithm.adv_estimator=grpo ...
