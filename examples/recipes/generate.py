"""model.generate on a tiny Llama: a batch of left-padded prompts of different lengths, sampled; examples/recipes:
stock/ holds the stock scripts, the directory above the same scripts made sequence parallel (README)."""

import torch
from transformers import LlamaConfig, LlamaForCausalLM

import tokenring.hf

cfg = LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, vocab_size=128)  # fmt: skip
torch.manual_seed(0)
model = LlamaForCausalLM._from_config(cfg, attn_implementation="tokenring").eval()  # or from_pretrained(name, ...)
torch.distributed.init_process_group()  # torchrun's ranks: the prompt's K/V are sharded over them
gen = torch.Generator().manual_seed(1)
ids = torch.randint(1, 128, (3, 300), generator=gen)  # prompts of 300, 170 and 41 tokens, padded on the left
mask = (torch.arange(300) >= torch.tensor([[0], [130], [259]])).long()
ids = ids * mask  # pad id 0
cache = tokenring.hf.prefill(model, ids, attention_mask=mask)  # each rank runs and keeps 1/P of the prompt
torch.manual_seed(2)
out = model.generate(ids, attention_mask=mask, cache=cache, max_new_tokens=8, do_sample=True, top_k=20, pad_token_id=0)
print("tokens", out[:, 300:].tolist())
