"""trl.SFTTrainer on a tiny Llama over padding-free batches of prompt-completion samples (completion-only loss);
examples/recipes: stock/ holds the stock scripts, the directory above the same scripts made sequence parallel."""

import torch
from datasets import Dataset
from tokenizers import Tokenizer, models
from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast
from trl import SFTConfig, SFTTrainer

cfg = LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, vocab_size=128, use_cache=False)  # fmt: skip
torch.manual_seed(0)
model = LlamaForCausalLM(cfg)  # or from_pretrained(name)
vocab = {str(i): i for i in range(128)}  # or AutoTokenizer.from_pretrained(name)
tok = PreTrainedTokenizerFast(tokenizer_object=Tokenizer(models.WordLevel(vocab, "0")), pad_token="0")
gen = torch.Generator().manual_seed(1)
ids = lambda n: torch.randint(1, 128, (n,), generator=gen).tolist()  # noqa: E731
rows = [{"input_ids": ids(p + c), "completion_mask": [0] * p + [1] * c} for p, c in ((20, 17), (3, 40), (11, 2))]
data = Dataset.from_list(rows)  # pre-tokenized prompt + completion, the loss on the completion only
args = SFTConfig("out", per_device_train_batch_size=3, max_steps=2, logging_steps=1, report_to=[], use_cpu=True,
                 bf16=False, save_strategy="no", optim="sgd", learning_rate=0.1, padding_free=True,
                 max_length=None)  # fmt: skip
trainer = SFTTrainer(model, args, train_dataset=data, processing_class=tok)
trainer.train()
print("losses", [h["loss"] for h in trainer.state.log_history if "loss" in h])
