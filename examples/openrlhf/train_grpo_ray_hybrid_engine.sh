#!/usr/bin/env bash
# GRPO with Ray + vLLM (hybrid engine, colocated), OpenRLHF 0.11.2. Identical to running
# `python3 -m openrlhf.cli.train_ppo_ray` with these arguments, except for the entry point and the
# `--faircast*` line. Drop that line (or run openrlhf.cli.train_ppo_ray) for the round-to-nearest baseline.
#
#   pip install "faircast-plugins[openrlhf]"      # on every node of the Ray cluster
#   ray start --head --num-gpus 8
#   bash examples/openrlhf/train_grpo_ray_hybrid_engine.sh
set -euo pipefail
cd "$(dirname "$0")/../.."

python3 -m faircast_plugins.openrlhf.train_ppo_ray \
   --faircast --faircast.seed 1234 --faircast.audit \
   --ref.num_nodes 1 \
   --ref.num_gpus_per_node 8 \
   --actor.num_nodes 1 \
   --actor.num_gpus_per_node 8 \
   --vllm.num_engines 8 \
   --vllm.tensor_parallel_size 1 \
   --train.colocate_all \
   --vllm.gpu_memory_utilization 0.6 \
   --vllm.enable_sleep \
   --ds.enable_sleep \
   --actor.model_name_or_path Qwen/Qwen2.5-Math-1.5B \
   --reward.remote_url examples/openrlhf/reward_func.py \
   --ckpt.path checkpoints/qwen2.5-math-1.5b-grpo-faircast/ckpt \
   --ckpt.output_dir checkpoints/qwen2.5-math-1.5b-grpo-faircast \
   --ckpt.save_steps 20 \
   --ckpt.load_enable \
   --train.micro_batch_size 8 \
   --train.batch_size 128 \
   --rollout.micro_batch_size 16 \
   --rollout.batch_size 128 \
   --rollout.n_samples_per_prompt 8 \
   --rollout.max_new_tokens 2048 \
   --rollout.temperature 1.0 \
   --data.max_len 3072 \
   --data.prompt_dataset openai/gsm8k \
   --data.prompt_split train \
   --data.input_key question \
   --data.label_key answer \
   --data.apply_chat_template \
   --train.max_epochs 1 \
   --train.num_episodes 1 \
   --ds.zero_stage 2 \
   --ds.packing_samples \
   --actor.adam.lr 1e-6 \
   --algo.advantage.estimator group_norm \
   --algo.kl.use_loss \
   --algo.kl.init_coef 1e-3 \
   --algo.kl.estimator k3 \
   --actor.gradient_checkpointing_enable \
   --vllm.enforce_eager \
   --logger.logging_steps 1
