"""A hybrid's mixers on the GPU path, run as a script in a fresh interpreter (tests/test_fake_cuda.py): stand-ins
for flash-linear-attention, causal-conv1d and mamba_ssm with those packages' signatures are installed before
transformers binds them at import, a tiny model of ``family`` runs forward and backward as rank ``rank`` of ``P``
on pretended CUDA tensors (meta), and the kernel calls (which, on what device, with what shapes and keywords)
are printed as JSON. The stand-ins check the documented contracts of the real kernels' arguments; their values
are not computed (meta tensors have none)."""

from __future__ import annotations

import importlib.machinery
import json
import sys
import types

import torch

CALLS: list[dict] = []


def _record(name: str, tensors: dict, **facts) -> None:
    CALLS.append(
        {
            "kernel": name,
            "devices": sorted({t.device.type for t in tensors.values() if isinstance(t, torch.Tensor)}),
            "shapes": {k: list(t.shape) for k, t in tensors.items() if isinstance(t, torch.Tensor)},
            "dtypes": {k: str(t.dtype) for k, t in tensors.items() if isinstance(t, torch.Tensor)},
            **facts,
        }
    )


def _delta(name):
    """FLA's ``chunk_gated_delta_rule`` / ``chunk_kda``: q, k ``[B, T, H, K]``, v ``[B, T, HV, V]``, g ``[B, T, HV]``
    (KDA: ``[B, T, HV, K]``), beta ``[B, T, HV]``, initial_state ``[N, HV, K, V]``."""

    def kernel(
        q, k, v, g, beta, scale=None, initial_state=None, output_final_state=False, use_qk_l2norm_in_kernel=False,
        use_beta_sigmoid_in_kernel=False, allow_neg_eigval=False, state_v_first=False, cu_seqlens=None,
        cu_seqlens_cpu=None, chunk_indices=None, cp_context=None, **kwargs,
    ):  # fmt: skip
        B, T, H, K = q.shape
        HV, V = v.shape[2], v.shape[3]
        assert k.shape == q.shape and v.shape[:2] == (B, T) and HV % H == 0, (q.shape, k.shape, v.shape)
        assert beta.shape == (B, T, HV) and g.shape[:3] == (B, T, HV), (g.shape, beta.shape)
        if initial_state is not None:
            assert initial_state.shape == (B, HV, K, V), (initial_state.shape, (B, HV, K, V))
        assert cu_seqlens is None or B == 1
        _record(name, dict(q=q, k=k, v=v, g=g, beta=beta, initial_state=initial_state),
                output_final_state=output_final_state, cu_seqlens=cu_seqlens is not None)  # fmt: skip
        gate = g.sum(-1) if g.dim() == 4 else g
        q, k = (x.repeat_interleave(HV // H, dim=2) for x in (q, k))  # grouped value heads
        o = v * (beta * gate.exp()).unsqueeze(-1) + (q * k).sum(-1, keepdim=True)
        if not output_final_state:
            return o, None
        start = initial_state if initial_state is not None else q.new_zeros(B, HV, K, V, dtype=torch.float32)
        return o, start + (k[:, -1, :, :, None] * v[:, -1, :, None, :]).float()

    return kernel


def mamba_chunk_scan_combined(
    x, dt, A, B, C, chunk_size, D=None, z=None, dt_bias=None, initial_states=None, seq_idx=None, cu_seqlens=None,
    dt_softplus=False, dt_limit=(0.0, float("inf")), return_final_states=False, return_varlen_states=False,
    state_dtype=None,
):  # fmt: skip
    """mamba_ssm's: x ``(b, l, h, p)``, dt ``(b, l, h)``, A ``(h,)``, B, C ``(b, l, g, n)``."""
    b, L, h, p = x.shape
    assert dt.shape == (b, L, h) and A.shape == (h,) and B.shape[:2] == (b, L) and C.shape == B.shape
    assert initial_states is None or initial_states.shape == (b, h, p, B.shape[-1])
    _record("mamba_chunk_scan_combined", dict(x=x, dt=dt, A=A, B=B, C=C, D=D, dt_bias=dt_bias,
            initial_states=initial_states), return_final_states=return_final_states, dt_softplus=dt_softplus,
            seq_idx=seq_idx is not None)  # fmt: skip
    y = x * dt.unsqueeze(-1) + C.sum((2, 3))[..., None, None]
    if not return_final_states:
        return y
    return y, (x[:, -1, :, :, None] * B[:, -1].sum(1)[:, None, None, :]).float()


def mamba_split_conv1d_scan_combined(zxbcdt, *args, **kwargs):
    """mamba_ssm's fused Mamba2 training kernel: never reached by a sharded layer (it declines there)."""
    _record("mamba_split_conv1d_scan_combined", dict(zxbcdt=zxbcdt))
    raise AssertionError("the fused Mamba2 kernel ran in a sharded forward")


def causal_conv1d_fn(
    x, weight, bias=None, seq_idx=None, initial_states=None, return_final_states=False, final_states_out=None,
    activation=None,
):  # fmt: skip
    """causal-conv1d's: x ``(batch, dim, seqlen)``, weight ``(dim, width)``, bias ``(dim,)``."""
    assert x.dim() == 3 and weight.shape[0] == x.shape[1] and weight.dim() == 2, (x.shape, weight.shape)
    assert x.stride(1) == 1 or x.stride(2) == 1, x.stride()
    _record("causal_conv1d_fn", dict(x=x, weight=weight, bias=bias), activation=activation)
    out = x * weight[:, -1:]
    return out + bias[:, None] if bias is not None else out


def _unused(name):
    def kernel(*args, **kwargs):
        _record(name, {})
        raise AssertionError(f"{name} (a one-token kernel) ran in a sharded forward")

    return kernel


def install() -> None:
    """The stand-in packages in ``sys.modules``, and transformers told they run on meta tensors (pretended CUDA)."""
    tree = {
        "fla": {},
        "fla.ops": {},
        "fla.ops.gated_delta_rule": {
            "chunk_gated_delta_rule": _delta("chunk_gated_delta_rule"),
            "fused_recurrent_gated_delta_rule": _unused("fused_recurrent_gated_delta_rule"),
        },
        "fla.ops.kda": {"chunk_kda": _delta("chunk_kda"), "fused_recurrent_kda": _unused("fused_recurrent_kda")},
        "causal_conv1d": {
            "causal_conv1d_fn": causal_conv1d_fn,
            "causal_conv1d_update": _unused("causal_conv1d_update"),
        },
        "mamba_ssm": {},
        "mamba_ssm.ops": {},
        "mamba_ssm.ops.triton": {},
        "mamba_ssm.ops.triton.ssd_combined": {
            "mamba_chunk_scan_combined": mamba_chunk_scan_combined,
            "mamba_split_conv1d_scan_combined": mamba_split_conv1d_scan_combined,
        },
        "mamba_ssm.ops.triton.selective_state_update": {"selective_state_update": _unused("selective_state_update")},
        "mamba_ssm.ops.selective_scan_interface": {},
    }
    for name, attrs in tree.items():
        module = types.ModuleType(name)
        module.__spec__ = importlib.machinery.ModuleSpec(name, None, is_package=True)
        module.__path__ = []
        module.__dict__.update(attrs)
        sys.modules[name] = module
        parent, _, leaf = name.rpartition(".")
        if parent:
            setattr(sys.modules[parent], leaf, module)
    from transformers.integrations import hub_kernels

    for package, devices in list(hub_kernels._PACKAGE_SUPPORTED_DEVICES.items()):
        hub_kernels._PACKAGE_SUPPORTED_DEVICES[package] = (*devices, "meta")


def main(family: str, rank: int, P: int, S: int, layout: str) -> None:
    """Each mixer of the family's tiny model, prepared for state passing, forward and backward over this rank's
    rows of ``S`` tokens in ``layout`` (the mixers alone: the model's own input checks read values, which meta
    tensors lack)."""
    install()
    import family_cases
    import transformers

    from tokenring import mixers
    from tokenring.testing import fake_rank, pretend_cuda

    with pretend_cuda(), fake_rank(rank, P), torch.device("meta"):
        cfg = family_cases.config(family)
        model = transformers.AutoModelForCausalLM.from_config(cfg, dtype=torch.bfloat16).train()
        hooks = mixers.prepare(model, lambda: (None, layout), P)
        ran = []
        for path, module in sorted(hooks.modules.items()):
            h = torch.empty(2, S // P, cfg.hidden_size, dtype=torch.bfloat16, requires_grad=True)
            module(h).float().sum().backward()
            ran.append({"mixer": path, "grad": list(h.grad.shape)})
    print(json.dumps({"calls": CALLS, "mixers": ran}))


if __name__ == "__main__":
    main(sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4]), sys.argv[5])
