#!/usr/bin/env bash
# PPO with LoRA on one node (DeepSpeed-Chat's step 3). Set the paths through the environment;
# anything after the script name is passed on:
#   ACTOR=/models/chinese-llama-2-7b SFT_ADAPTER=outputs/sft/sft_lora_model \
#   RM_ADAPTER=outputs/rm/rm_lora_model DATA=/data/prompts OUTPUT=outputs/ppo \
#   bash scripts/training/run_ppo.sh --enable_ema
# With the reward model as an adapter on the actor's base, all four roles share one frozen base
# (--shared_base). For a merged reward model set REWARD=outputs/rm/rm_merged_model and leave
# RM_ADAPTER empty: the roles are then separate models.
set -euo pipefail
here="$(cd "$(dirname "$0")" && pwd)"
repo="$(cd "$here/../.." && pwd)"
# torchrun on the GPUs visible; NPROC NNODES NODE_RANK MASTER_ADDR MASTER_PORT DRY_RUN: see launch.sh
source "$here/launch.sh"

ACTOR=${ACTOR:?set ACTOR to the actor base model directory (or a merged SFT model)}
REWARD=${REWARD:-$ACTOR}
DATA=${DATA:?set DATA to a directory of .json/.jsonl prompt files}
OUTPUT=${OUTPUT:-outputs/ppo}
DS_CONFIG=${DS_CONFIG:-$repo/ds_configs/ds_zero2_no_offload.json}
adapters=()
if [ -n "${SFT_ADAPTER:-}" ]; then adapters+=(--actor_lora_model "$SFT_ADAPTER"); fi
if [ -n "${RM_ADAPTER:-}" ]; then adapters+=(--reward_lora_model "$RM_ADAPTER"); fi

launch "$here/run_ppo.py" \
    --deepspeed "$DS_CONFIG" \
    --actor_model_name_or_path "$ACTOR" \
    --reward_model_name_or_path "$REWARD" \
    "${adapters[@]}" \
    --dataset_dir "$DATA" \
    --max_prompt_seq_len 256 \
    --max_answer_seq_len 256 \
    --per_device_generation_batch_size 4 \
    --per_device_training_batch_size 4 \
    --generation_batches 1 \
    --ppo_epochs 1 \
    --num_train_epochs 1 \
    --actor_learning_rate 2e-5 \
    --critic_learning_rate 1e-5 \
    --lr_scheduler_type cosine \
    --warmup_steps 100 \
    --weight_decay 0.1 \
    --kl_ctl 0.1 \
    --clip_reward_value 5 \
    --cliprange 0.2 \
    --cliprange_value 0.2 \
    --gamma 1.0 \
    --lam 0.95 \
    --temperature 1.0 \
    --gradient_accumulation_steps 1 \
    --max_grad_norm 1.0 \
    --seed 1234 \
    --bf16 \
    --logging_steps 10 \
    --save_strategy steps \
    --save_steps 200 \
    --save_total_limit 3 \
    --output_dir "$OUTPUT" \
    --lora_rank 64 \
    --lora_alpha 128 \
    --trainable all-linear \
    --lora_dropout 0.0 \
    --torch_dtype bfloat16 \
    --ddp_find_unused_parameters False \
    "$@"
