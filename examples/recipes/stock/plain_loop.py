"""A plain PyTorch training loop on a tiny Llama over packed samples of any length; examples/recipes: stock/
holds the stock scripts, the directory above the same scripts made sequence parallel (README, "Training")."""

import torch
from transformers import DataCollatorWithFlattening, LlamaConfig, LlamaForCausalLM

cfg = LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, vocab_size=128, use_cache=False)  # fmt: skip
torch.manual_seed(0)
model = LlamaForCausalLM(cfg)  # or from_pretrained(name)
gen = torch.Generator().manual_seed(1)
data = [{"input_ids": torch.randint(0, 128, (n,), generator=gen).tolist()} for n in (37, 90, 13, 64)]
batch = DataCollatorWithFlattening(return_tensors="pt")(data)  # input_ids, labels, position_ids
opt = torch.optim.SGD(model.parameters(), lr=0.1)
losses = []
for step in range(2):
    loss = model(**batch).loss
    loss.backward()
    opt.step()
    opt.zero_grad()
    losses.append(loss.item())
print("losses", losses)
