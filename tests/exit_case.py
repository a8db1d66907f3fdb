"""One rank of a refused call that is caught, then a clean exit (tests/test_exit.py runs it as a subprocess)."""

import os
import sys

import torch
import torch.distributed as dist

import tokenring


def main() -> None:
    rank, P, what, store = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3], sys.argv[4]
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    backend = None if what == "last_collective" else "gloo"  # None: torch's device map, as torchrun scripts do
    dist.init_process_group(backend, init_method=f"file://{store}", rank=rank, world_size=P)
    tokenring.set_timeout(20)
    if what == "last_collective":  # a tokenring call, then plain all_reduces, then the end: no destroy
        q = torch.randn(1, 8, 2, 16)
        tokenring.attention(q, q, q, causal=True)
        for _ in range(3):
            t = torch.ones(1000)
            dist.all_reduce(t)
        print(f"done {t[0].item():.0f}", flush=True)
        return
    try:
        if what in ("padding", "lengths", "autocast"):
            import transformers

            import tokenring.hf as thf

            cfg = transformers.LlamaConfig(
                hidden_size=32,
                intermediate_size=64,
                num_hidden_layers=1,
                num_attention_heads=4,
                num_key_value_heads=2,
                vocab_size=64,
            )
            torch.manual_seed(0)
            model = transformers.LlamaForCausalLM._from_config(cfg, attn_implementation="tokenring")
            ids = torch.randint(0, 64, (1, 16 * P), generator=torch.Generator().manual_seed(0))
            batch = thf.shard_batch(ids)
            if what == "padding":
                mask = torch.ones_like(batch["input_ids"])
                mask[:, -2:] = 0
                model(**batch, attention_mask=mask)
            elif what == "lengths":  # rank 0 passes twice the tokens of the others
                n = batch["input_ids"].shape[1] * (2 if rank == 0 else 1)
                model(input_ids=ids[:, :n], position_ids=torch.arange(n)[None] + rank * n)
            else:
                with torch.autocast("cpu", dtype=torch.bfloat16):
                    mask = torch.ones_like(batch["input_ids"])
                    mask[:, :1] = 0
                    model(**batch, attention_mask=mask).logits.sum().backward()
        else:  # q/k/v that differ in shape across ranks
            s = 8 if rank == 0 else 4
            q = torch.randn(1, s, 4, 16, requires_grad=True)
            tokenring.attention(q, q, q, causal=True).sum().backward()
    except ValueError as e:
        print(f"refused: {str(e)[:200]}", flush=True)
    else:
        print("not refused", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
