"""``tokenring explain``: what ``auto`` would pick and why, or (``--plan``) what every rank computes and sends
at every step of a strategy's schedule.

    tokenring explain --ranks 4 --seq 16384 --heads 8 --kv-heads 2 --causal --topology mesh:100mbit
    tokenring explain --plan --strategy token_ring --ranks 4 --seq 4096 --causal --pass fwd [--rank 0]
"""

from __future__ import annotations

import argparse

from . import DTYPES


def main(argv: list[str] | None = None) -> int:
    from ..layouts import default_layout
    from ..schedules import Shapes
    from ..strategies import get

    ap = argparse.ArgumentParser(prog="tokenring explain", description=__doc__.split("\n\n")[0])
    ap.add_argument("--ranks", "-P", type=int, default=4)
    ap.add_argument("--seq", type=int, default=16384, help="global sequence length")
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--heads", type=int, default=8)
    ap.add_argument("--kv-heads", type=int, default=None)
    ap.add_argument("--head-dim", type=int, default=128)
    ap.add_argument("--dtype", default="bfloat16", choices=list(DTYPES))
    ap.add_argument("--causal", action="store_true")
    ap.add_argument("--layout", choices=["contiguous", "zigzag"], default=None)
    ap.add_argument(
        "--pass",
        dest="mode",
        choices=["fwd", "bwd", "both"],
        default="both",
        help="forward only, backward only (--plan) or forward+backward",
    )
    ap.add_argument("--topology", default=None, help="interconnect for auto (preset, mesh:RATE, JSON/YAML file)")
    ap.add_argument(
        "--device",
        choices=["cpu", "cuda"],
        default=None,
        help="whose default topology and kernel (default: cuda where a GPU is visible; on CUDA the "
        "machine's GPUs, links and node size are detected)",
    )
    ap.add_argument("--plan", action="store_true", help="print the per-rank, per-step schedule")
    ap.add_argument(
        "--strategy",
        default="auto",
        help="auto, a family (token_ring, ring, ring:auto, ulysses, "
        "ring_bidir) or a variant such as token_ring:direct,c=2,k=3",
    )
    ap.add_argument("--rank", type=int, action="append", help="only these ranks in --plan (repeatable)")
    a = ap.parse_args(argv)
    import torch

    device = a.device or ("cuda" if torch.cuda.is_available() else "cpu")
    P, Hkv = a.ranks, a.kv_heads or a.heads
    layout = a.layout or default_layout(a.causal)
    if a.seq % (2 * P if layout == "zigzag" else P):
        ap.error(f"--seq {a.seq} does not split into {'2*P' if layout == 'zigzag' else 'P'} equal chunks")
    sh = Shapes(a.batch, a.seq // P, a.heads, Hkv, a.head_dim, DTYPES[a.dtype], P)
    q, k = (a.batch, sh.s, a.heads, a.head_dim), (a.batch, sh.s, Hkv, a.head_dim)
    name = a.strategy
    if name != "auto":
        try:
            get(name)
        except ValueError as e:
            ap.error(str(e))
    if name == "auto" or get(name).mode == "auto" or not a.plan:
        from ..sim.auto import choose, explain

        text = explain(
            q,
            k,
            causal=a.causal,
            layout=layout,
            P=P,
            topology=a.topology,
            backward=a.mode != "fwd",
            dtype=sh.dtype,
            strategy=name,
            file=None,
            device_type=device,
        )
        if not a.plan:
            print(text, end="")
            return 0
        requested, name = name, choose(sh, a.causal, layout, a.mode != "fwd", device, a.topology, name)[0]
        print(f"{requested} -> {name}")
    why = get(name).check(a.heads, Hkv, P, sh.s, a.causal and layout == "zigzag")
    if why:
        ap.error(why)
    for backward in {"fwd": [False], "bwd": [True], "both": [False, True]}[a.mode]:
        print(get(name).schedule(P, layout, a.causal, backward).describe(sh, a.rank, get(name).payload))
        print()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
