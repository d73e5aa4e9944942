"""Fair Cast for OpenRLHF (PPO/GRPO with Ray, DeepSpeed and vLLM).

    python -m faircast_plugins.openrlhf.train_ppo_ray --faircast [--faircast.mode M] [--faircast.seed N] \
        [--faircast.audit] <every openrlhf.cli.train_ppo_ray argument>

The policy's DeepSpeed copy-back (``faircast_plugins.deepspeed``) then writes the Fair Cast bf16 copy,
which is both what the forward (loss, old log-probs) runs on and what ``broadcast_to_vllm`` sends.
"""
from .policy import OPENRLHF_SPECIFIER, attach_to_policy, config_from_args, patch_policy_actor, policy_metrics

__all__ = ["OPENRLHF_SPECIFIER", "attach_to_policy", "config_from_args", "patch_policy_actor", "policy_metrics"]
