"""TRL's side of benchmarks/bench_gpu.py: one LoRA SFT run with TRL's SFTTrainer on the model directory, tokenizer
and chats jsonl that our runs read, with the settings bench_gpu gives ours (sequence length, batch, steps, learning
rate, seed, LoRA r / alpha / dropout on all linear layers, bf16), in the configuration bench_gpu picks as TRL's best
there: padding-free packing (TRL's default "bfd") under flash_attention_2 where it imports, else unpacked under sdpa;
Liger's kernels (use_liger_kernel) where liger_kernel imports.

bench_sft.py's approach to TRL: the loss on the assistant answers only (assistant_only_loss) through TRL's
{% generation %} markers, added to the very chat template ours renders (lorakit's `human_assistant`) and checked
here to render the same text. Not a script: bench_gpu's child imports it, and measures the trainer it builds with
the probe (synchronised step clock, memory readings, token counts) it puts on every Trainer.
"""

from __future__ import annotations

from typing import Any

# The assistant branch of lorakit's human_assistant template: ours trains on the answer and the EOS after it.
ANSWER = "{% else %} {{ message['content'] }}{{ eos_token }}{% endif %}"
MARKED_ANSWER = "{% else %}{% generation %} {{ message['content'] }}{{ eos_token }}{% endgeneration %}{% endif %}"
CHECKED_RECORDS = 8


def training_template(template: str) -> str:
    """template with TRL's {% generation %} markers around the answer ours trains on."""
    if ANSWER not in template:
        raise ValueError(f"the chat template has no answer branch {ANSWER!r} to mark for TRL's assistant_only_loss")
    return template.replace(ANSWER, MARKED_ANSWER)


def check_same_text(tokenizer: Any, conversations: list, template: str, marked: str) -> None:
    """The markers change what is trained, never the text: TRL must see what ours renders."""
    for messages in conversations:
        ours = tokenizer.apply_chat_template(messages, tokenize=False, chat_template=template)
        if ours != tokenizer.apply_chat_template(messages, tokenize=False, chat_template=marked):
            raise ValueError("TRL's training template renders other text than ours")


def sft_config(options: dict, output_dir: str) -> Any:
    """SFTConfig with our run's settings; where TRL's defaults differ from TrainingArguments' (activation
    checkpointing on, bf16 on, lr 2e-5, logging every 10 steps) they are set to ours."""
    from trl import SFTConfig

    return SFTConfig(
        output_dir=output_dir, max_length=options["max_length"], per_device_train_batch_size=options["batch"],
        max_steps=options["steps"], learning_rate=options["learning_rate"], seed=options["seed"],
        packing=options["packed"], padding_free=options["packed"], assistant_only_loss=True,
        gradient_checkpointing=False, bf16=options["bf16"], fp16=False, use_cpu=options["use_cpu"],
        use_liger_kernel=options["liger"], report_to="none", save_strategy="no", logging_steps=1,
    )


def train_with_trl(options: dict, output_dir: str) -> None:
    """One TRL SFTTrainer run to its end (bench_gpu.trl_spec writes the options)."""
    import torch
    from datasets import load_dataset
    from peft import LoraConfig
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from trl import SFTTrainer

    from lorakit.records.chat_templates import named_template

    tokenizer = AutoTokenizer.from_pretrained(options["model_dir"])
    template = named_template(options["template"], tokenizer)
    marked = training_template(template)
    dataset = load_dataset("json", data_files=options["data_path"], split="train")
    check_same_text(tokenizer, dataset.select(range(min(CHECKED_RECORDS, len(dataset))))["messages"], template, marked)
    tokenizer.chat_template = marked
    model = AutoModelForCausalLM.from_pretrained(options["model_dir"],
                                                 dtype=torch.bfloat16 if options["bf16"] else torch.float32,
                                                 attn_implementation=options["attention"])
    lora = options["lora"]
    peft_config = LoraConfig(task_type="CAUSAL_LM", r=lora["r"], lora_alpha=lora["alpha"], lora_dropout=lora["dropout"],
                             target_modules=lora["targets"])
    trainer = SFTTrainer(model=model, args=sft_config(options, output_dir), train_dataset=dataset,
                         processing_class=tokenizer, peft_config=peft_config)
    trainer.train()
