#!/usr/bin/env bash
# GRPO with tim-plugins' mismatch monitor and mitigations switched on (verl 0.9.x, V1 trainer, FSDP2 + vLLM).
# Usage: MODEL_PATH=/path/to/Qwen2.5-0.5B-Instruct TRAIN_FILE=~/data/gsm8k/train.parquet \
#        VAL_FILE=~/data/gsm8k/test.parquet bash run_grpo_tim.sh [extra hydra overrides]
# Check the overrides first, without GPUs (the recipe needs MODEL_PATH and TRAIN_FILE even to print them):
#   tim-plugins audit --verl "$(TIM_PRINT_OVERRIDES=1 MODEL_PATH=... TRAIN_FILE=... bash run_grpo_tim.sh)"
# TIM_PRINT_OVERRIDES=tim prints only the tim-plugins overrides, one per line (the end-to-end test runs these).
set -euo pipefail

# tim_plugins.truncation.DEFAULT_MIN_P (tests/test_docs.py keeps them equal)
MIN_P=${MIN_P:-1e-5}

# STRATEGY=megatron: verl's Megatron actor (ppo_megatron_trainer): the monitor, split, dump, probe, safe vocabulary
# (over the tensor-parallel vocabulary shards, with or without use_fused_kernels=true) and LR decay run in
# tim-plugins' Megatron engine.
STRATEGY=${STRATEGY:-fsdp2}

TIM_OVERRIDES=(
    # tim trainer mode: forwards the +tim.* settings to the actor workers and logs tim/* metrics
    trainer.v1.trainer_mode=tim_sync
    # 1. monitor: exact per-step rollout-vs-actor mismatch, merged over data-parallel ranks
    +tim.monitor.enable=true
    # 2. safe vocabulary on the trainer side: the actor applies the rollout's truncation (this min_p, and your
    #    rollout.top_p / top_k as set), with or without fused kernels (log-probs must be processed) ...
    +tim.safe_vocab.min_p=${MIN_P}
    # ... and on the rollout side: verl passes no min_p to vLLM, so tim-plugins' logits processor applies the same
    # min_p to every request (loaded and configured through the engine args verl forwards to vLLM)
    '+actor_rollout_ref.rollout.engine_kwargs.vllm.logits_processors=[tim_plugins.integrations.vllm.min_p:TIMMinPLogitsProcessor]'
    +actor_rollout_ref.rollout.engine_kwargs.vllm.additional_config.tim_min_p=${MIN_P}
    actor_rollout_ref.rollout.logprobs_mode=processed_logprobs
    actor_rollout_ref.rollout.calculate_log_probs=true
    # 3. response-length-triggered LR decay inside the actor's optimizer
    actor_rollout_ref.actor.optim.optimizer_impl=tim_plugins.integrations.verl.optim
    actor_rollout_ref.actor.optim.optimizer=AdamW
    +tim.lr_decay.enable=true
    # 4. parity: audit at start-up (strict stops before any GPU work), live probe on the monitor
    +tim.parity.strict=true
    +tim.probe.kl_k3=1e-2
    +tim.probe.action=stop
)
if [[ "${STRATEGY}" == "megatron" ]]; then
    # Megatron: the same safe vocabulary (fused kernels as you set them); the LR decay acts on Megatron's own optimizer
    TIM_OVERRIDES=(
        trainer.v1.trainer_mode=tim_sync
        +tim.monitor.enable=true
        +tim.safe_vocab.min_p=${MIN_P}
        '+actor_rollout_ref.rollout.engine_kwargs.vllm.logits_processors=[tim_plugins.integrations.vllm.min_p:TIMMinPLogitsProcessor]'
        +actor_rollout_ref.rollout.engine_kwargs.vllm.additional_config.tim_min_p=${MIN_P}
        actor_rollout_ref.rollout.logprobs_mode=processed_logprobs
        actor_rollout_ref.rollout.calculate_log_probs=true
        +tim.lr_decay.enable=true
        +tim.parity.strict=true
        +tim.probe.kl_k3=1e-2
        +tim.probe.action=stop
    )
fi

if [[ "${TIM_PRINT_OVERRIDES:-0}" == "tim" ]]; then
    printf '%s\n' "${TIM_OVERRIDES[@]}"
    exit 0
fi

MODEL_PATH=${MODEL_PATH:?set MODEL_PATH to a local HF model directory}
TRAIN_FILE=${TRAIN_FILE:?set TRAIN_FILE to a parquet file}
VAL_FILE=${VAL_FILE:-$TRAIN_FILE}
N_GPUS=${N_GPUS:-8}
NNODES=${NNODES:-1}

BASE_OVERRIDES=(
    algorithm.adv_estimator=grpo
    data.train_files="${TRAIN_FILE}"
    data.val_files="${VAL_FILE}"
    data.train_batch_size=256
    data.max_prompt_length=512
    data.max_response_length=1024
    actor_rollout_ref.model.path="${MODEL_PATH}"
    actor_rollout_ref.model.use_remove_padding=true
    actor_rollout_ref.actor.strategy=${STRATEGY}
    actor_rollout_ref.actor.optim.lr=1e-6
    actor_rollout_ref.actor.ppo_mini_batch_size=64
    actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=8
    actor_rollout_ref.actor.use_kl_loss=true
    actor_rollout_ref.actor.kl_loss_coef=0.001
    actor_rollout_ref.rollout.name=vllm
    # numerics parity between vLLM and the FSDP actor (bf16 on both sides, no prefix-cache reuse)
    actor_rollout_ref.rollout.dtype=bfloat16
    actor_rollout_ref.rollout.enable_prefix_caching=false
    # verl's own correction, on top: token-level TIS on the recomputed old log-probs
    algorithm.rollout_correction.rollout_is=token
    algorithm.rollout_correction.rollout_is_threshold=2.0
    actor_rollout_ref.rollout.n=5
    actor_rollout_ref.rollout.tensor_model_parallel_size=1
    actor_rollout_ref.rollout.gpu_memory_utilization=0.6
    actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu=8
    actor_rollout_ref.ref.log_prob_micro_batch_size_per_gpu=8
    trainer.logger='["console","wandb"]'
    trainer.project_name=tim_plugins
    trainer.experiment_name=grpo_tim
    trainer.n_gpus_per_node=${N_GPUS}
    trainer.nnodes=${NNODES}
    trainer.save_freq=20
    trainer.test_freq=5
    trainer.total_epochs=15
)

if [[ "${TIM_PRINT_OVERRIDES:-0}" == "1" ]]; then
    printf '%s ' "${BASE_OVERRIDES[@]}" "${TIM_OVERRIDES[@]}" "$@"
    exit 0
fi

CONFIG_NAME=ppo_trainer
[[ "${STRATEGY}" == "megatron" ]] && CONFIG_NAME=ppo_megatron_trainer
python3 -m verl.trainer.main_ppo --config-name="${CONFIG_NAME}" "${BASE_OVERRIDES[@]}" "${TIM_OVERRIDES[@]}" "$@"
