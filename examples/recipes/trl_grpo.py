"""trl.GRPOTrainer on a tiny Llama: prompts of different lengths, two sampled completions each, scored by a reward
function; examples/recipes: stock/ holds the stock scripts, the directory above the same scripts made sequence
parallel."""

import torch
from datasets import Dataset
from tokenizers import Tokenizer, models, pre_tokenizers
from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast
from trl import GRPOConfig

import tokenring.hf.trl

cfg = LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, vocab_size=128)  # fmt: skip
torch.manual_seed(0)
model = LlamaForCausalLM._from_config(cfg, attn_implementation="tokenring")  # or from_pretrained(name, ...)
vocab = {str(i): i for i in range(127)} | {"</s>": 127}  # or AutoTokenizer.from_pretrained(name)
tok = Tokenizer(models.WordLevel(vocab, "0"))
tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
tok = PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="0", eos_token="</s>")
gen = torch.Generator().manual_seed(1)
text = lambda n: " ".join(str(i) for i in torch.randint(1, 127, (n,), generator=gen).tolist())  # noqa: E731
data = Dataset.from_list([{"prompt": text(n)} for n in (37, 5, 90, 13)])


def even(completions, **kwargs):  # the share of even numbers in each completion
    return [sum(int(w) % 2 == 0 for w in c.split() if w.isdigit()) / (1 + len(c.split())) for c in completions]


args = GRPOConfig("out", per_device_train_batch_size=4, num_generations=2, max_completion_length=16, max_steps=2,
                  logging_steps=1, report_to=[], use_cpu=True, bf16=False, save_strategy="no", optim="sgd",
                  learning_rate=0.1, seed=0)  # fmt: skip
sp = tokenring.hf.SequenceParallel()  # every rank shares each prompt; a (dp, cp) mesh: SequenceParallel(mesh)
trainer = tokenring.hf.trl.SequenceParallelGRPOTrainer(sp, model, even, args, train_dataset=data, processing_class=tok)
trainer.train()
print("metrics", [h[k] for h in trainer.state.log_history if "loss" in h for k in ("grad_norm", "reward")])
