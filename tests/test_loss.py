"""The tiled (chunked) cross-entropy: the same loss and gradients as the unchunked one (float32, 1e-6), and no
tensor the size of the whole (tokens, vocab) logits is ever made or kept for backward."""

import pytest
import torch
import torch.nn.functional as F

from tokenring.loss import chunked_cross_entropy


def _case(seed: int, shape=(2, 37), D: int = 16, V: int = 101, bias: bool = True):
    gen = torch.Generator().manual_seed(seed)
    hidden = torch.randn(*shape, D, generator=gen).requires_grad_()
    head = torch.nn.Linear(D, V, bias=bias)
    with torch.no_grad():
        head.weight.copy_(torch.randn(V, D, generator=gen))
        if bias:
            head.bias.copy_(torch.randn(V, generator=gen))
    labels = torch.randint(0, V, shape, generator=gen)
    labels[..., ::7] = -100
    return hidden, head, labels


@pytest.mark.parametrize("chunk", [1, 5, 37, 74, 1000])
@pytest.mark.parametrize("bias", [True, False])
def test_matches_unchunked(chunk, bias):
    hidden, head, labels = _case(chunk, bias=bias)
    want = F.cross_entropy(head(hidden).float().flatten(0, -2), labels.flatten(), ignore_index=-100)
    want.backward()
    ref = [hidden.grad.clone()] + [p.grad.clone() for p in head.parameters()]
    hidden.grad = None
    head.zero_grad(set_to_none=True)
    got = chunked_cross_entropy(hidden, head, labels, chunk=chunk)
    got.backward()
    assert abs(got.item() - want.item()) <= 1e-6 * abs(want.item())
    for g, r in zip([hidden.grad] + [p.grad for p in head.parameters()], ref):
        assert ((g - r).abs().max() / r.abs().max()).item() < 1e-6


def test_num_items_is_the_divisor():
    """With the global target count (a rank's share of the global mean) the loss is the sum over that count."""
    hidden, head, labels = _case(3)
    total = F.cross_entropy(head(hidden).flatten(0, -2), labels.flatten(), ignore_index=-100, reduction="sum")
    got = chunked_cross_entropy(hidden, head, labels, chunk=8, num_items=1000)
    assert abs(got.item() - total.item() / 1000) < 1e-6 * abs(total.item() / 1000)


def test_never_holds_whole_logits():
    """No tensor of the head's output size is made in forward or saved for backward: every head call sees at
    most ``chunk`` tokens, and what autograd keeps is at most one chunk's worth of logits."""
    hidden, head, labels = _case(5, shape=(1, 300), V=997)
    seen = []
    calls = []

    class Head(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.inner = head

        def forward(self, h):
            calls.append(h.shape[0])
            return self.inner(h)

    def pack(t):
        seen.append(t.numel())
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        loss = chunked_cross_entropy(hidden, Head(), labels, chunk=64)
    loss.backward()
    whole = 300 * 997
    assert max(calls) <= 64 and max(seen) < whole / 4, (max(calls), max(seen), whole)
    assert hidden.grad is not None and head.weight.grad is not None


def test_refuses_bad_input():
    hidden, head, labels = _case(1)
    with pytest.raises(ValueError, match="labels must have"):
        chunked_cross_entropy(hidden, head, labels[:, :-1])
    with pytest.raises(ValueError, match="chunk"):
        chunked_cross_entropy(hidden, head, labels, chunk=0)
