"""The CUDA path on a CPU: meta tensors as CUDA tensors (``tokenring.testing.pretend_cuda``), one process as rank r
of P over PyTorch's fake process group (``fake_rank``). Values are not computed; what is checked is which CUDA op
runs with which arguments, the shapes, dtypes, devices and strides that come back, that every message buffer is
on the device, and that a call after the first makes no host sync."""

from __future__ import annotations

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

import tokenring
from tokenring import kernels
from tokenring import ops as tr_ops
from tokenring.comm import Trace
from tokenring.merge import acc_dtype, merge_, new_accumulator
from tokenring.testing import fake_rank, meta_like, pretend_cuda

H100, A100 = ("NVIDIA H100 80GB HBM3", (9, 0)), ("NVIDIA A100-SXM4-80GB", (8, 0))
CUDA_OPS = {
    "_scaled_dot_product_cudnn_attention": "cudnn",
    "_scaled_dot_product_flash_attention": "flash",
    "_scaled_dot_product_efficient_attention": "efficient",
}
SYNCS = ("_local_scalar_dense", "equal", "is_nonzero")  # what .item(), .tolist(), torch.equal, bool() run


class Ops(TorchDispatchMode):
    """Records every aten op: its name and arguments."""

    def __init__(self):
        super().__init__()
        self.calls: list[tuple[str, tuple, dict]] = []
        self.schemas: dict = {}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.calls.append((func.overloadpacket.__name__, args, kwargs or {}))
        self.schemas[func.overloadpacket.__name__] = func._schema
        impl = getattr(getattr(tr_ops, func.overloadpacket.__name__, None), "_init_fn", None)
        if func.namespace == "tokenring" and impl is not None:  # record inside tokenring's own ops too
            with self:
                return impl(*args, **(kwargs or {}))
        return func(*args, **(kwargs or {}))

    def named(self, name: str) -> list[dict]:
        """The calls of op ``name``, each as {argument name: value} (defaults filled in)."""
        out = []
        for n, a, k in self.calls:
            if n == name:
                schema = self.schemas[n].arguments
                out.append(
                    {x.name: a[i] if i < len(a) else k.get(x.name, x.default_value) for i, x in enumerate(schema)}
                )
        return out

    def attention_ops(self) -> list[str]:
        return [n for n, _, _ in self.calls if n.removesuffix("_backward") in CUDA_OPS]

    def host_syncs(self) -> list[str]:
        """Ops that read a device value on the host or copy between host and device."""
        out = []
        for n, a, k in self.calls:
            tensors = [x for x in a if isinstance(x, torch.Tensor)]
            if n in SYNCS and any(t.device.type != "cpu" for t in tensors):
                out.append(n)
            if (
                n in ("_to_copy", "copy_")
                and len({t.device.type for t in tensors} | {str(k.get("device", ""))} - {"", "None"}) > 1
            ):
                out.append(n)
        return out


def same(a: torch.Tensor, b: torch.Tensor) -> bool:
    """``a`` is ``b`` or a view of it (the same storage)."""
    return a.untyped_storage()._cdata == b.untyped_storage()._cdata


def block(B=2, n=96, m=160, H=8, Hkv=2, d=128, dtype=torch.bfloat16):
    q = meta_like(B, n, H, d, dtype=dtype)
    k, v = meta_like(B, m, Hkv, d, dtype=dtype), meta_like(B, m, Hkv, d, dtype=dtype)
    return q, k, v


# --- the kernel choice -------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "dtype,d,capability,expected",
    [
        (torch.bfloat16, 128, (9, 0), "cudnn"),
        (torch.float16, 64, (9, 0), "cudnn"),
        (torch.bfloat16, 72, (10, 0), "cudnn"),
        (torch.bfloat16, 128, (8, 0), "flash"),
        (torch.bfloat16, 256, (9, 0), "flash"),
        (torch.float16, 80, (8, 9), "flash"),
        (torch.float32, 128, (9, 0), "efficient"),
        (torch.bfloat16, 100, (9, 0), "efficient"),
        (torch.float64, 128, (9, 0), None),
        (torch.bfloat16, 66, (9, 0), None),
    ],
)
def test_choice_table(dtype, d, capability, expected):
    assert kernels.cuda_kernel(dtype, d, capability) == expected


@pytest.mark.parametrize("gpu", [H100, A100], ids=["sm90", "sm80"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32, torch.float64], ids=str)
@pytest.mark.parametrize("d", [64, 72, 80, 128, 256])
@pytest.mark.parametrize("causal,Hkv", [(False, 2), (True, 8)])
def test_block_forward_backward_ops(gpu, dtype, d, causal, Hkv):
    """Each branch calls its op with q, k, v (and dO, O, lse) in the schema's order, K/V heads as the op takes
    them, and returns out (B, n, H, d) in q's dtype, lse (B, H, n) in the accumulator dtype, grads shaped like
    their inputs."""
    n = m = 96 if causal else None
    q, k, v = block(n=n or 96, m=m or 160, Hkv=Hkv, d=d, dtype=dtype)
    B, n, H, _ = q.shape
    with pretend_cuda(*gpu):
        expected = kernels.cuda_kernel(dtype, d, gpu[1])
        with Ops() as ops:
            out, lse = kernels.block_forward(q, k, v, causal, 0.3)
        assert out.shape == q.shape and out.dtype == dtype and out.device.type == "meta"
        assert lse.shape == (B, H, n) and lse.dtype == acc_dtype(dtype) and lse.is_contiguous()
        assert ops.attention_ops() == ([f"_scaled_dot_product_{expected}_attention"] if expected else [])
        if expected:
            (a,) = ops.named(f"_scaled_dot_product_{expected}_attention")
            assert same(a["query"], q) and a["scale"] == 0.3
            assert (same(a["key"], k) and same(a["value"], v)) or (expected == "efficient" and Hkv < H)
            heads = k.shape[2] if expected in ("cudnn", "flash") else H
            assert a["key"].shape == (B, heads, k.shape[1], d) and a["query"].shape == (B, H, n, d)
            assert a["is_causal"] is causal and a["dropout_p"] == 0.0
            if expected != "flash":
                assert a["compute_log_sumexp"] is True and a["attn_bias"] is None
        dout = meta_like(*q.shape, dtype=dtype)
        delta = meta_like(B, H, n, dtype=acc_dtype(dtype))
        with Ops() as ops:
            dq, dk, dv = kernels.block_backward(dout, q, k, v, lse, delta, causal, 0.3, out=out)
        assert (dq.shape, dk.shape, dv.shape) == (q.shape, k.shape, v.shape)
        assert {t.device.type for t in (dq, dk, dv)} == {"meta"}
        if expected:
            (a,) = ops.named(f"_scaled_dot_product_{expected}_attention_backward")
            assert (
                same(a.get("grad_out", a.get("grad_out_")), dout)
                and same(a["query"], q)
                and same(a["out"], out)
                and a["scale"] == 0.3
            )
            assert (same(a["key"], k) and same(a["value"], v)) or (expected == "efficient" and Hkv < H)
            lse_in = a["logsumexp"]
            want = {"cudnn": (B, H, n, 1), "flash": (B, H, n), "efficient": (B, H, -(-n // 32) * 32)}[expected]
            assert tuple(lse_in.shape) == want  # each op reads lse in its own layout
            assert a["is_causal"] is causal and a["dropout_p"] == 0.0
            assert a["out"].stride() == a.get("grad_out", a.get("grad_out_")).stride()  # one layout for O and dO
            if expected != "efficient":
                assert (a["max_q"], a["max_k"]) == (n, k.shape[1])
        assert ops.host_syncs() == []


@pytest.mark.parametrize("gpu", [H100, A100], ids=["sm90", "sm80"])
def test_backward_gets_dout_in_the_layout_of_out(gpu):
    """A dO in another memory layout than O (or expanded, as ``.sum().backward()`` gives) reaches the op in
    O's layout with a unit inner stride (cuDNN before 9.5.1 read dO with O's strides)."""
    q, k, v = block(n=64, m=64)
    B, n, H, d = q.shape
    with pretend_cuda(*gpu):
        out, lse = kernels.block_forward(q, k, v, True, 0.1)
        delta = meta_like(B, H, n, dtype=torch.float32)
        for dout in (meta_like(B, H, n, d).transpose(1, 2), meta_like(1, 1, 1, 1).expand(B, n, H, d)):
            with Ops() as ops:
                kernels.block_backward(
                    dout, q, k, v, lse, delta, True, 0.1, out=out.transpose(1, 2).contiguous().transpose(1, 2)
                )
            name = f"_scaled_dot_product_{kernels.cuda_kernel(q.dtype, d, gpu[1])}_attention_backward"
            (a,) = ops.named(name)
            assert a["grad_out"].stride() == a["out"].stride() and a["grad_out"].stride()[-1] == 1


def test_masked_tiles_take_the_math_path():
    from tokenring.masks import Tile

    q, k, v = block(n=64, m=64, Hkv=8)
    tiles = [Tile(0, 32, 0, 64, "mask"), Tile(32, 64, 0, 32, "causal")]
    with pretend_cuda(*H100), Ops() as ops:
        o, lse = kernels.tiled_forward(
            q,
            k,
            v,
            tiles,
            lambda t: (
                torch.ones(t.q1 - t.q0, t.k1 - t.k0, dtype=torch.bool, device="meta") if t.kind == "mask" else None
            ),
            0.2,
        )
    assert o.shape == q.shape and lse.shape == (2, 8, 64)
    assert ops.attention_ops() == ["_scaled_dot_product_cudnn_attention"]  # the unmasked causal tile only


def test_merge_on_cuda_runs_the_compiled_kernels_twin(monkeypatch):
    from tokenring import merge

    def compiled(*args):
        raise AssertionError("the compiled kernel ran on meta tensors")

    monkeypatch.setattr(merge, "_compiled", compiled)
    with pretend_cuda(*H100):
        acc_o, acc_lse = new_accumulator(2, 64, 8, 128, torch.bfloat16, "meta")
        o, lse = meta_like(2, 64, 8, 128), meta_like(2, 8, 64, dtype=torch.float32)
        with Ops() as ops:
            merge_(acc_o[:, 16:48], acc_lse[:, :, 16:48], o[:, 16:48], lse[:, :, 16:48])
    assert ops.named("maximum") and ops.host_syncs() == []  # the eager twin's ops ran
    assert acc_o.dtype == torch.float32 and acc_lse.shape == (2, 8, 64)


# --- a whole call as rank r of P ---------------------------------------------------------------------------------

STRATEGIES = [
    "token_ring:relay",
    "token_ring:direct,c=2,k=1",
    "ring",
    "ring:direct,c=2,k=1",
    "ring_bidir",
    "ulysses",
    "auto",
    "token_ring",
    "usp:n=2",
    "double_ring:n=2",
    "token_ring_2d:n=2",
    "double_ring:n=2,keep",
]


def _call(strategy, causal, masks, P, trace=None, log=None, sinks=False):
    s = 64
    q = meta_like(1, s, 8, 128, requires_grad=True)
    k, v = (meta_like(1, s, 4, 128, requires_grad=True) for _ in range(2))
    kw = {}
    if masks:
        kw = dict(window=(48, 0) if causal else (40, 40), cu_seqlens=[0, 24 * P, 64 * P])
    sk = meta_like(8, dtype=torch.float32, requires_grad=True) if sinks else None
    with tokenring.instrument(trace=trace, comm_log=log):
        out = tokenring.attention(q, k, v, causal=causal, strategy=strategy, sinks=sk, **kw)
    out.sum().backward()
    return q, k, v, out, sk


@pytest.mark.parametrize("P,rank", [(2, 1), (4, 2), (8, 5)])
@pytest.mark.parametrize("strategy", STRATEGIES)
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("masks", [False, True], ids=["plain", "masks"])
def test_attention_as_rank_r_of_P(P, rank, strategy, causal, masks):
    if strategy.endswith(":n=2") or "n=2," in strategy:
        if P == 2:
            pytest.skip("two-level strategies need two nodes of two ranks")
    with pretend_cuda(*H100), fake_rank(rank, P):
        log = []
        q, k, v, out, _ = _call(strategy, causal, masks, P, log=log)
        assert out.shape == q.shape and out.dtype == q.dtype and out.device.type == "meta" and out.is_contiguous()
        for t in (q, k, v):
            assert t.grad is not None and t.grad.shape == t.shape and t.grad.dtype == t.dtype
        records = [r for _, recs in log for r in recs]
        assert {what.split()[-1] for what, _ in log} == {"forward", "backward"} and records
        assert {r["device"] for r in records} == {"meta"}  # every buffer on the GPU, none staged via the host
        assert not any(r["staged"] for r in records)
        with Ops() as ops:  # a second call: no host sync, no signature exchange
            _call(strategy, causal, masks, P)
        assert ops.host_syncs() == []
        assert not ops.named("allgather_") and not ops.named("all_gather")
        if not masks:
            assert ops.attention_ops() and set(ops.attention_ops()) <= {
                "_scaled_dot_product_cudnn_attention",
                "_scaled_dot_product_cudnn_attention_backward",
            }


def test_sinks_and_timeline_on_cuda():
    with pretend_cuda(*H100), fake_rank(0, 4):
        trace = Trace(0)
        _, _, _, out, sk = _call("token_ring:direct,c=2,k=1", True, False, 4, trace=trace, sinks=True)
        assert sk.grad.shape == (8,) and sk.grad.dtype == torch.float32
        trace.resolve()
        assert trace.cuda and trace.events
        assert all(isinstance(e["start"], float) and e["end"] >= e["start"] for e in trace.events)
        assert {e["lane"] for e in trace.events} >= {"compute", "send", "recv"}


def test_nccl_semantics_no_host_timeout():
    from tokenring.comm import Comm

    with pretend_cuda(*H100), fake_rank(1, 4):
        comm = Comm(None)
        assert not comm.bounded and not comm.early_receives and not comm.stage
        assert tokenring.comm.collective_device(None).type == "meta"


def test_decode_on_cuda():
    with pretend_cuda(*H100), fake_rank(2, 4):
        q = meta_like(1, 3, 8, 128)
        k, v = meta_like(1, 40, 2, 128), meta_like(1, 40, 2, 128)
        out = tokenring.decode_attention(q, k, v)
        assert out.shape == q.shape and out.device.type == "meta"


def test_fake_rank_refuses_an_existing_group():
    with fake_rank(0, 2):
        with pytest.raises(RuntimeError, match="exists already"):
            with fake_rank(0, 2):
                pass


# --- device-aware defaults ---------------------------------------------------------------------------------------

L40S = ("NVIDIA L40S", (8, 9), 4, "pcie")
H100_NODE = ("NVIDIA H100 80GB HBM3", (9, 0), 8, "nvlink")


def _auto_runs(gpu, shape=(1, 16384, 32, 8, 128), causal=True):
    """The strategy ``auto`` runs as rank 0 of one node of ``gpu`` s, and what ``explain`` says."""
    B, s, H, Hkv, d = shape
    with pretend_cuda(*gpu), fake_rank(0, gpu[2]):
        q = meta_like(B, s, H, d, requires_grad=True)
        k, v = (meta_like(B, s, Hkv, d, requires_grad=True) for _ in range(2))
        log = []
        with tokenring.instrument(comm_log=log):
            tokenring.attention(q, k, v, causal=causal)
        text = tokenring.explain(q, k, causal=causal, file=None)
    return log[0][0].rsplit(" ", 1)[0], text


def test_auto_detects_the_machine():
    from tokenring.device import GPU
    from tokenring.schedules import Shapes
    from tokenring.sim.auto import choose
    from tokenring.sim.topology import detected_topology

    h100, h_text = _auto_runs(H100_NODE)
    l40s, l_text = _auto_runs(L40S)
    assert "detected: NVIDIA H100 80GB HBM3 (sm90), 8 per node, nvlink" in h_text and "block kernel: cudnn" in h_text
    assert "detected: NVIDIA L40S (sm89), 4 per node, pcie" in l_text and "block kernel: flash" in l_text
    assert "kernel model: h100" in h_text and "kernel model: l40s" in l_text
    sh = lambda P: Shapes(1, 16384, 32, 8, 128, torch.bfloat16, P)  # noqa: E731
    for gpu, ran in ((H100_NODE, h100), (L40S, l40s)):  # what ran is the model's pick on the detected topology
        topo = detected_topology(GPU(*gpu), gpu[2])
        assert choose(sh(gpu[2]), True, "zigzag", True, topology=topo)[0] == ran
    assert h100 != l40s  # on this shape the model puts NVLink's and PCIe's best apart
    two_nodes = detected_topology(GPU(*H100_NODE), 16)
    assert two_nodes.node.P == 8 and "InfiniBand" in two_nodes.source


def test_unknown_gpu_falls_back_to_h100_figures():
    from tokenring.sim.topology import gpu_model

    assert gpu_model("Some Future GPU")[0] == "h100" and "unknown GPU" in gpu_model("Some Future GPU")[2]
    assert gpu_model("NVIDIA B200")[0] == "b200" and gpu_model("AMD Instinct MI300X")[0] == "mi300x"


def test_gpu_facts_by_name():
    from tokenring.device import pcie_by_name

    pcie = ["NVIDIA L40S", "NVIDIA L4", "NVIDIA A10G", "NVIDIA A10", "NVIDIA H100 PCIe", "NVIDIA RTX 6000 Ada", "A40"]
    nvlink = ["NVIDIA H100 80GB HBM3", "NVIDIA A100-SXM4-80GB", "NVIDIA H200", "NVIDIA B200", "NVIDIA A100 80GB"]
    assert all(pcie_by_name(n) for n in pcie) and not any(pcie_by_name(n) for n in nvlink)
    with pretend_cuda("AMD Instinct MI300X", (9, 4), 8, "nvlink"):  # ROCm: no cuDNN, flash instead
        q, k, v = block()
        with Ops() as ops:
            kernels.block_forward(q, k, v, False, 0.1)
        assert ops.attention_ops() == ["_scaled_dot_product_flash_attention"]


@pytest.mark.parametrize("strategy", ["pass_q", "pass_q_relay", "pass_kv", "ulysses"])
def test_extend_on_cuda(strategy):
    """Rank 2 of 4 runs each extend schedule on pretended CUDA tensors over NCCL semantics: every message buffer
    on the device, the output shaped and placed like the queries."""
    from tokenring.extend import Shards, extend_attention, split_new

    ranges = split_new([100, 100, 99, 99], 30)
    shards = Shards(tuple(c + b - a for c, (a, b) in zip([100, 100, 99, 99], ranges)), tuple(ranges))
    a, b = ranges[2]
    with pretend_cuda(*H100), fake_rank(2, 4):
        q = meta_like(1, b - a, 8, 128)
        k, v = meta_like(1, shards.rows[2], 4, 128), meta_like(1, shards.rows[2], 4, 128)
        log: list = []
        out = extend_attention(q, k, v, new=(a, b), strategy=strategy, shards=shards, state=None, log=log)
        assert out.shape == q.shape and out.device.type == "meta" and out.dtype == q.dtype
        assert log[0]["strategy"] == strategy and log[0]["devices"] == ["meta"], log


COLLECTIVES = (
    "all_gather",
    "all_reduce",
    "broadcast",
    "all_to_all_single",
    "all_gather_into_tensor",
    "all_gather_single",
)


@pytest.fixture
def collective_devices(monkeypatch):
    """Every collective and point-to-point batch the library issues, with the device types of its tensors."""
    import torch.distributed as dist

    seen: list[tuple[str, set]] = []

    def spy(name, real):
        def call(*args, **kwargs):
            found = []
            for x in list(args) + list(kwargs.values()):
                if isinstance(x, torch.Tensor):
                    found.append(x)
                elif isinstance(x, (list, tuple)):
                    found += [y for y in x if isinstance(y, torch.Tensor)]
                    found += [y.tensor for y in x if isinstance(y, dist.P2POp)]
            seen.append((name, {t.device.type for t in found}))
            return real(*args, **kwargs)

        return call

    for name in (*COLLECTIVES, "batch_isend_irecv"):
        monkeypatch.setattr(dist, name, spy(name, getattr(dist, name)))
    return seen


def test_hf_prefill_decode_extend_on_cuda(collective_devices):
    """Rank 1 of 4 runs a Llama (bf16, meta weights standing for CUDA ones) through tokenring.hf.prefill, two
    decode steps over the sharded cache and tokenring.hf.extend: every collective and message it issues (the
    prompt agreement, the layers' position checks, the attention schedules, decode's partials, extend's
    header) carries device tensors only, as NCCL requires."""
    transformers = pytest.importorskip("transformers")
    import tokenring.hf as thf

    cfg = transformers.LlamaConfig(
        vocab_size=64, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=256,
    )  # fmt: skip
    with pretend_cuda(*H100), fake_rank(1, 4):
        with torch.device("meta"):
            model = transformers.LlamaForCausalLM._from_config(
                cfg, attn_implementation="tokenring", dtype=torch.bfloat16
            )
        ids = torch.zeros(1, 64, dtype=torch.long, device="meta")
        cache = thf.prefill(model, ids)
        for t in range(2):  # decode steps as generate runs them (generate itself reads token values)
            pos = torch.full((1, 1), 63 + t, dtype=torch.long, device="meta")
            out = model(input_ids=ids[:, -1:], position_ids=pos, cache=cache, use_cache=True)
        assert out.logits.shape == (1, 1, 64) and out.logits.device.type == "meta"
        thf.extend(model, cache, torch.zeros(1, 64 + 1 + 40, dtype=torch.long, device="meta"))
    kinds = {name for name, _ in collective_devices}
    gather = "all_gather_single" if hasattr(torch.distributed, "all_gather_single") else "all_gather_into_tensor"
    assert {gather, "batch_isend_irecv"} <= kinds, kinds  # the agreements and decode's partials; the schedules
    assert all(devices == {"meta"} for _, devices in collective_devices), collective_devices


def test_decode_step_without_its_check_makes_no_host_sync():
    """A decode step's attention after a model's first layer (check=False), rank 2 of 4 on pretended CUDA tensors
    over NCCL semantics: the CUDA attention kernel, one all-gather of device tensors and no host sync, what a
    captured step (CUDA graphs, torch.compile's reduce-overhead) needs of it."""
    with pretend_cuda(*H100), fake_rank(2, 4):
        q = meta_like(1, 1, 8, 128)
        k, v = meta_like(1, 40, 2, 128), meta_like(1, 40, 2, 128)
        tokenring.decode_attention(q, k, v, check=False)
        with Ops() as ops:
            out = tokenring.decode_attention(q, k, v, check=False)
    assert out.shape == q.shape and out.device.type == "meta"
    assert ops.host_syncs() == [] and ops.attention_ops(), [n for n, _, _ in ops.calls]
    gathers = [n for n, _, _ in ops.calls if "gather" in n]
    assert len(gathers) == 1, [n for n, _, _ in ops.calls]


# (family, rank, P, S, layout): the kernels its mixers reach on the GPU path
HYBRID_KERNELS = {
    ("qwen3_5", 1, 3, 48, "zigzag"): {"causal_conv1d_fn", "chunk_gated_delta_rule"},
    ("bamba", 2, 3, 48, "contiguous"): {"causal_conv1d_fn", "mamba_chunk_scan_combined"},
    ("kimi_linear", 0, 2, 32, "zigzag"): {"causal_conv1d_fn", "chunk_kda"},
    ("lfm2", 1, 2, 32, "zigzag"): {"causal_conv1d_fn"},
}


@pytest.mark.parametrize("case", list(HYBRID_KERNELS))
def test_hybrid_mixers_reach_the_gpu_kernels(case):
    """With flash-linear-attention, causal-conv1d and mamba_ssm installed (stand-ins with their signatures,
    tests/fake_kernels_case.py, in a fresh interpreter), a sharded hybrid's mixers on pretended CUDA tensors run
    those packages' kernels, not transformers' torch fallbacks, forward and backward: every call on the device,
    with the arguments the real kernels document (delta rule: values widened by dk, an identity start
    [N, HV, K, V] in float32, the final state asked for; Mamba2: no start, the final state asked for; no packed
    arguments), over exactly this rank's rows; the fused Mamba2 training kernel is never reached."""
    import json
    import os
    import subprocess
    import sys

    pytest.importorskip("transformers")
    family, rank, P, S, layout = case
    here = os.path.dirname(os.path.abspath(__file__))
    done = subprocess.run(
        [sys.executable, os.path.join(here, "fake_kernels_case.py"), family, str(rank), str(P), str(S), layout],
        capture_output=True, text=True, timeout=300, cwd=here,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    got = json.loads(done.stdout.strip().splitlines()[-1])
    calls, mixers, s = got["calls"], got["mixers"], S // P
    assert {c["kernel"] for c in calls} == HYBRID_KERNELS[case], calls
    assert all(c["devices"] == ["meta"] for c in calls), calls
    assert mixers and all(m["grad"][:2] == [2, s] for m in mixers), mixers
    for name in HYBRID_KERNELS[case] - {"causal_conv1d_fn"}:
        mine = [c for c in calls if c["kernel"] == name]
        main = "v" if name != "mamba_chunk_scan_combined" else "x"
        assert sum(c["shapes"][main][0] * c["shapes"][main][1] for c in mine) == 2 * s * len(mixers), mine
        for c in mine:
            assert not c.get("cu_seqlens") and not c.get("seq_idx"), c
            if main == "v":
                N, T, HV, V = c["shapes"]["v"]
                K = c["shapes"]["k"][-1]
                assert c["output_final_state"] and c["shapes"]["initial_state"] == [N, HV, K, V], c
                assert c["dtypes"]["initial_state"] == "torch.float32" and V > K, c
            else:
                assert c["return_final_states"] and "initial_states" not in c["shapes"], c
    for c in (c for c in calls if c["kernel"] == "causal_conv1d_fn"):
        width = c["shapes"]["weight"][1]
        assert c["shapes"]["x"][1] == c["shapes"]["weight"][0] and s < c["shapes"]["x"][2] <= s + 2 * (width - 1), c


def test_repeats_replay_only_on_the_group_they_were_prepared_on(monkeypatch):
    """From a prepared call's third run on, its forward and backward replay their programs straight from it
    (``ops.Ready.memo``), bound to the process group object they ran on: after the default group is destroyed
    and made anew (the agreement's entries kept, as in a script that initialises again without
    ``forget_groups``), the next call takes the long way and binds its replays to the new group."""
    import torch.distributed as dist
    from torch.testing._internal.distributed.fake_pg import FakeStore

    from tokenring.agreement import forget_groups

    seen, real = [], tr_ops._replay

    def counted(memo, what, group):
        hit = real(memo, what, group)
        seen.append((what, hit is not None))
        return hit

    monkeypatch.setattr(tr_ops, "_replay", counted)
    q, k, v = (torch.randn(1, 8, h, 16, requires_grad=True) for h in (4, 2, 2))
    dist.init_process_group(backend="fake", store=FakeStore(), rank=1, world_size=4)
    try:
        for i in range(5):
            if i == 3:
                first = dist.distributed_c10d._get_default_group()  # (held: its id cannot be reused)
                dist.destroy_process_group()
                dist.init_process_group(backend="fake", store=FakeStore(), rank=1, world_size=4)
                assert dist.distributed_c10d._get_default_group() is not first
            tokenring.attention(q, k, v, causal=True, strategy="ring").sum().backward()
    finally:
        dist.destroy_process_group()
        forget_groups()
    hits = [(what, hit) for what, hit in seen]
    long, short = [("forward", False), ("backward", False)], [("forward", True), ("backward", True)]
    assert hits == long + long + short + long + short, hits
