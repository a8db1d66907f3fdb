"""model.generate on a tiny Llama: a batch of left-padded prompts of different lengths, sampled; examples/recipes:
stock/ holds the stock scripts, the directory above the same scripts made sequence parallel (README)."""

import torch
from transformers import LlamaConfig, LlamaForCausalLM

cfg = LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, vocab_size=128)  # fmt: skip
torch.manual_seed(0)
model = LlamaForCausalLM(cfg).eval()  # or from_pretrained(name)
gen = torch.Generator().manual_seed(1)
ids = torch.randint(1, 128, (3, 300), generator=gen)  # prompts of 300, 170 and 41 tokens, padded on the left
mask = (torch.arange(300) >= torch.tensor([[0], [130], [259]])).long()
ids = ids * mask  # pad id 0
torch.manual_seed(2)
out = model.generate(ids, attention_mask=mask, max_new_tokens=8, do_sample=True, top_k=20, pad_token_id=0)
print("tokens", out[:, 300:].tolist())
