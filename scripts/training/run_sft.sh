#!/usr/bin/env bash
# Supervised fine-tuning with LoRA on one node. Set the paths through the environment; anything
# after the script name is passed on:
#   MODEL=/models/chinese-llama-2-7b DATA=/data/sft VALID=/data/sft_valid.json \
#   OUTPUT=outputs/sft bash scripts/training/run_sft.sh --template llama2 --packing
set -euo pipefail
here="$(cd "$(dirname "$0")" && pwd)"
repo="$(cd "$here/../.." && pwd)"
# torchrun on the GPUs visible; NPROC NNODES NODE_RANK MASTER_ADDR MASTER_PORT DRY_RUN: see launch.sh
source "$here/launch.sh"

MODEL=${MODEL:?set MODEL to the base (or pretraining-merged) model directory}
TOKENIZER=${TOKENIZER:-$MODEL}
DATA=${DATA:?set DATA to a directory of .json/.jsonl conversation files}
OUTPUT=${OUTPUT:-outputs/sft}
# Next to OUTPUT: $OUTPUT/../data_cache would have OUTPUT created on the way (to resolve its "..").
DATA_CACHE=${DATA_CACHE:-$(dirname "$OUTPUT")/data_cache}
DS_CONFIG=${DS_CONFIG:-$repo/ds_configs/ds_zero2_no_offload.json}
validation=()
if [ -n "${VALID:-}" ]; then validation=(--validation_file "$VALID" --eval_strategy steps --eval_steps 100); fi

lr=1e-4
lora_rank=64
lora_alpha=128
# all-linear: every linear layer of the decoder, found by type (Llama, Qwen, Mistral, Phi-3, GPT-2 alike).
lora_trainable="all-linear"
lora_dropout=0.05

launch "$here/run_sft_with_peft.py" \
    --deepspeed "$DS_CONFIG" \
    --model_name_or_path "$MODEL" \
    --tokenizer_name_or_path "$TOKENIZER" \
    --dataset_dir "$DATA" \
    --data_cache_dir "$DATA_CACHE" \
    "${validation[@]}" \
    --per_device_train_batch_size 1 \
    --per_device_eval_batch_size 1 \
    --do_train \
    --seed 42 \
    --bf16 \
    --num_train_epochs 1 \
    --lr_scheduler_type cosine \
    --learning_rate $lr \
    --warmup_steps 0.03 \
    --weight_decay 0 \
    --logging_strategy steps \
    --logging_steps 10 \
    --save_strategy steps \
    --save_total_limit 3 \
    --save_steps 200 \
    --gradient_accumulation_steps 8 \
    --max_seq_length 1024 \
    --output_dir "$OUTPUT" \
    --lora_rank $lora_rank \
    --lora_alpha $lora_alpha \
    --trainable "$lora_trainable" \
    --lora_dropout $lora_dropout \
    --torch_dtype bfloat16 \
    --ddp_find_unused_parameters False \
    "$@"
