#!/usr/bin/env bash
# Continued pretraining with LoRA (+ trainable embeddings for an extended vocabulary) on one
# node. Set the paths through the environment; anything after the script name is passed on:
#   MODEL=/models/llama-2-7b TOKENIZER=/models/chinese-llama-2-tokenizer DATA=/data/pt \
#   OUTPUT=outputs/pt bash scripts/training/run_pt.sh --max_steps 1000
set -euo pipefail
here="$(cd "$(dirname "$0")" && pwd)"
repo="$(cd "$here/../.." && pwd)"
# torchrun on the GPUs visible; NPROC NNODES NODE_RANK MASTER_ADDR MASTER_PORT DRY_RUN: see launch.sh
source "$here/launch.sh"

MODEL=${MODEL:?set MODEL to the base model directory}
TOKENIZER=${TOKENIZER:-$MODEL}
DATA=${DATA:?set DATA to a directory of .txt/.jsonl files}
OUTPUT=${OUTPUT:-outputs/pt}
# Next to OUTPUT: $OUTPUT/../data_cache would have OUTPUT created on the way (to resolve its "..").
DATA_CACHE=${DATA_CACHE:-$(dirname "$OUTPUT")/data_cache}
DS_CONFIG=${DS_CONFIG:-$repo/ds_configs/ds_zero2_no_offload.json}

lr=2e-4
lora_rank=64
lora_alpha=128
# all-linear: every linear layer of the decoder, found by type (Llama, Qwen, Mistral, Phi-3, GPT-2 alike).
lora_trainable="all-linear"
lora_dropout=0.05
# New vocabulary rows only learn if the embeddings train in full; drop this line for a base vocabulary.
modules_to_save="embed_tokens,lm_head"

launch "$here/run_clm_pt_with_peft.py" \
    --deepspeed "$DS_CONFIG" \
    --model_name_or_path "$MODEL" \
    --tokenizer_name_or_path "$TOKENIZER" \
    --dataset_dir "$DATA" \
    --data_cache_dir "$DATA_CACHE" \
    --validation_split_percentage 0.001 \
    --per_device_train_batch_size 1 \
    --do_train \
    --seed 42 \
    --bf16 \
    --num_train_epochs 1 \
    --lr_scheduler_type cosine \
    --learning_rate $lr \
    --warmup_steps 0.05 \
    --weight_decay 0.01 \
    --logging_strategy steps \
    --logging_steps 10 \
    --save_strategy steps \
    --save_total_limit 3 \
    --save_steps 200 \
    --gradient_accumulation_steps 8 \
    --preprocessing_num_workers 8 \
    --block_size 1024 \
    --output_dir "$OUTPUT" \
    --lora_rank $lora_rank \
    --lora_alpha $lora_alpha \
    --trainable "$lora_trainable" \
    --modules_to_save "$modules_to_save" \
    --lora_dropout $lora_dropout \
    --torch_dtype bfloat16 \
    --ddp_find_unused_parameters False \
    "$@"
