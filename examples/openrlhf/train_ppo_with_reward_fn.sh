# Fair Cast on OpenRLHF's PPO Ray example (a critic, a reward function, vLLM engines; submitted as a Ray job).
#
# Upstream: https://github.com/OpenRLHF/OpenRLHF, examples/scripts/train_ppo_with_reward_fn.sh
#   at commit 3c3be6234e0cb353e76bb8019947db9dfe99fca7 (2026-08-13), git blob 142cbf62f8300b316b61e7bfbcd0ce3777bf6ca6.
# The script below is that file with only these changes (tests/openrlhf/test_cli.py checks it):
# the entry point faircast_plugins.openrlhf.train_ppo_ray instead of openrlhf.cli.train_ppo_ray and the
# --faircast line.
# Paths, models and datasets are upstream's (/openrlhf is an OpenRLHF checkout, as in its Docker image). Every
# argument parses with openrlhf 0.11.2, the version Fair Cast supports.
#
#   pip install ".[openrlhf]"      # in a checkout of faircast-plugins (not on PyPI; or its wheel), on every node
#
# Other Fair Cast options: --faircast.seed N, --faircast.mode stochastic|sticky|error_feedback|nearest,
# --faircast.ema_decay B, --faircast.audit (logs the faircast/* lag metrics). Without --faircast (or with
# openrlhf.cli.train_ppo_ray) the run is OpenRLHF's round-to-nearest baseline.
# ---- end of the Fair Cast notes: below is OpenRLHF's script ----
# /openrlhf/examples/scripts/reward_func.py
# import torch

# def reward_func(queries, prompts, labels):
#     # queries is prompts + responses
#     # labels is answers
#     print(queries)
#     return torch.randn(len(queries))

set -x 

ray job submit --address="http://127.0.0.1:8265" \
   --runtime-env-json='{"working_dir": "/openrlhf"}' \
   -- python3 -m faircast_plugins.openrlhf.train_ppo_ray \
   --faircast \
   --ref.num_nodes 1 \
   --ref.num_gpus_per_node 2 \
   --critic.num_nodes 1 \
   --critic.num_gpus_per_node 2 \
   --actor.num_nodes 1 \
   --actor.num_gpus_per_node 2 \
   --vllm.num_engines 2 \
   --vllm.tensor_parallel_size 2 \
   --train.colocate_actor_ref \
   --actor.model_name_or_path OpenRLHF/Llama-3-8b-sft-mixture \
   --reward.remote_url /openrlhf/examples/python/reward_func.py \
   --ckpt.output_dir /openrlhf/examples/checkpoint/llama3-8b-rlhf \
   --train.micro_batch_size 8 \
   --train.batch_size 128 \
   --rollout.micro_batch_size 16 \
   --rollout.batch_size 1024 \
   --data.max_samples 100000 \
   --train.max_epochs 1 \
   --data.max_len 2048 \
   --ds.zero_stage 3 \
   --ds.param_dtype bf16 \
   --actor.adam.lr 5e-7 \
   --critic.adam.lr 9e-6 \
   --algo.kl.init_coef 0.01 \
   --data.prompt_dataset OpenRLHF/prompt-collection-v0.1 \
   --data.input_key context_messages \
   --data.apply_chat_template \
   --reward.normalize_enable \
   --ds.packing_samples \
   --ds.adam_offload \
   --ds.attn_implementation flash_attention_2 \
   --actor.gradient_checkpointing_enable \
   --logger.wandb.key {wandb_token}

