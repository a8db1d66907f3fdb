"""transformers.Trainer on a tiny Llama over packed samples of any length (examples/recipes: stock/ holds the
stock scripts, the directory above the same scripts made sequence parallel; README, "Training")."""

import torch
from transformers import DataCollatorWithFlattening, LlamaConfig, LlamaForCausalLM, Trainer, TrainingArguments

cfg = LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, vocab_size=128, use_cache=False)  # fmt: skip
torch.manual_seed(0)
model = LlamaForCausalLM(cfg)  # or from_pretrained(name)
gen = torch.Generator().manual_seed(1)
data = [{"input_ids": torch.randint(0, 128, (n,), generator=gen).tolist()} for n in (37, 90, 13, 64)]
args = TrainingArguments("out", per_device_train_batch_size=4, max_steps=2, logging_steps=1, report_to=[],
                         use_cpu=True, save_strategy="no", optim="sgd", learning_rate=0.1)  # fmt: skip
collate = DataCollatorWithFlattening()
trainer = Trainer(model=model, args=args, train_dataset=data, data_collator=collate)
trainer.train()
print("losses", [h["loss"] for h in trainer.state.log_history if "loss" in h])
