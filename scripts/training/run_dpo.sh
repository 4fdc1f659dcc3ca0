#!/usr/bin/env bash
# DPO with LoRA on one node. Set the paths through the environment; anything after the script
# name is passed on (e.g. --loss_type ipo --beta 0.5):
#   MODEL=outputs/base SFT_ADAPTER=outputs/sft/sft_lora_model DATA=/data/pairs \
#   VALID=/data/pairs_valid.jsonl OUTPUT=outputs/dpo bash scripts/training/run_dpo.sh
# MODEL may also be a merged SFT model, without SFT_ADAPTER.
set -euo pipefail
here="$(cd "$(dirname "$0")" && pwd)"
repo="$(cd "$here/../.." && pwd)"
# torchrun on the GPUs visible; NPROC NNODES NODE_RANK MASTER_ADDR MASTER_PORT DRY_RUN: see launch.sh
source "$here/launch.sh"

MODEL=${MODEL:?set MODEL to the base (with SFT_ADAPTER) or merged SFT model directory}
DATA=${DATA:?set DATA to a directory of .json/.jsonl preference-pair files}
OUTPUT=${OUTPUT:-outputs/dpo}
# Next to OUTPUT: $OUTPUT/../data_cache would have OUTPUT created on the way (to resolve its "..").
DATA_CACHE=${DATA_CACHE:-$(dirname "$OUTPUT")/data_cache}
DS_CONFIG=${DS_CONFIG:-$repo/ds_configs/ds_zero2_no_offload.json}
adapter=()
if [ -n "${SFT_ADAPTER:-}" ]; then adapter=(--peft_path "$SFT_ADAPTER"); fi
validation=()
if [ -n "${VALID:-}" ]; then validation=(--validation_file "$VALID" --eval_strategy steps --eval_steps 100); fi

launch "$here/run_dpo.py" \
    --deepspeed "$DS_CONFIG" \
    --model_name_or_path "$MODEL" \
    "${adapter[@]}" \
    --dataset_dir "$DATA" \
    --data_cache_dir "$DATA_CACHE" \
    "${validation[@]}" \
    --loss_type sigmoid \
    --beta 0.1 \
    --per_device_train_batch_size 4 \
    --per_device_eval_batch_size 4 \
    --do_train \
    --seed 42 \
    --bf16 \
    --num_train_epochs 1 \
    --lr_scheduler_type cosine \
    --learning_rate 5e-6 \
    --warmup_steps 0.1 \
    --logging_steps 10 \
    --save_strategy steps \
    --save_total_limit 3 \
    --save_steps 200 \
    --gradient_accumulation_steps 4 \
    --max_seq_length 1024 \
    --output_dir "$OUTPUT" \
    --lora_rank 64 \
    --lora_alpha 128 \
    --trainable all-linear \
    --lora_dropout 0.05 \
    --torch_dtype bfloat16 \
    --ddp_find_unused_parameters False \
    "$@"
