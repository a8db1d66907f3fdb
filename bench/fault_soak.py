#!/usr/bin/env python3
"""Fault soak: many calls, each with one rank killed, stalled or refusing its input, in its forward or backward.

    .venv/bin/python bench/fault_soak.py [--trials 500] [--timeout 2] [--seed 0] [--ranks 2 3 4] [--mix ...]
    .venv/bin/python bench/fault_soak.py --memory 10000     # RSS over many calls with a new mask each

Each trial: P local gloo ranks, drawn from ``--ranks`` (``RankPool``; after a death, a stall or a refusal it
starts fresh ones), a strategy (token_ring relay and direct, ring, ring direct, ring_bidir, ulysses), causal or
not, packed documents or not (in half the trials: each rank then runs its own plan of the masked schedule), a
warm-up call,
then a call with one fault on a random victim: it exits (``os._exit``) or stalls (sleeps past the timeout) at
the start of a random step of the forward or the backward, or it passes K/V of another head dim (refused).
Every surviving rank reports how its call ended: a ``RuntimeError`` or ``ValueError`` (with the seconds from the
start of that pass, and whether the message names the victim), or completion (it needed nothing more from it),
whose output and gradients are then checked against float64 attention in one process (error < 1e-4).
A surviving rank that neither raises nor completes within the pool's limit is a hang. At the end, no process
started by the soak may be left. ``--workers W`` runs W trials at once, each on its own ranks (trial ``i`` is
drawn from its own seed, whoever runs it; ``--only`` runs some of them again, ``--resume`` the ones an interrupted
soak did not reach, keeping the others and each rerun trial's earlier outcome). Ranks are started, and checked to
answer, before a trial's clock starts.

``--mix attention hf_train generate trainer`` draws each trial's workload: a ``tokenring.attention`` call as
above, or a 2-layer Llama (``attn_implementation="tokenring"``) run twice, the same way (a warm-up, then the
faulty run): a training step through ``shard_batch``; ``prefill`` + 3 greedy tokens (the fault in prefill's forward
or a decode step); two steps of ``SequenceParallelTrainer.train()``. An HF refusal is the victim passing other
samples or another prompt (the agreement checks refuse it on every rank); a survivor that completes must give
the warm-up run's result bit for bit. Writes every trial to ``bench/results/fault_soak.json`` (after every
trial, with ``finished: false`` until the end) and prints the counts.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import os
import platform
import random
import re
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))
sys.path.insert(0, os.path.join(os.path.dirname(HERE), "tests"))  # the HF workloads' small model (hf_cases)

SPECS = ["token_ring:relay", "token_ring:direct,c=2,k=1", "ring", "ring:direct,c=2,k=1", "ring_bidir", "ulysses"]


def trial(
    rank: int,
    P: int,
    spec: str,
    causal: bool,
    phase: str,
    victim: int,
    step: int,
    timeout: float,
    fault: str,
    cu: list[int] | None = None,
):
    """One call with a fault on rank ``victim``: ``kill`` (exits at ``step`` of ``phase``), ``stall`` (sleeps
    there for the timeout + 3 s, alive) or ``refuse`` (passes K/V of another head dim: a ValueError). ``cu``:
    packed documents (each rank then runs its own plan of the masked schedule)."""
    import torch

    import tokenring
    from tokenring.tools.launch import exit_at_step

    tokenring.set_timeout(timeout)
    layout = "zigzag" if causal else "contiguous"
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, 24, h, 8, generator=g).requires_grad_() for h in (12, 2, 2))
    tokenring.attention(q, k, v, causal=causal, strategy=spec, layout=layout, cu_seqlens=cu).sum().backward()
    q.grad = k.grad = v.grad = None
    if rank == victim and fault == "refuse":
        k, v = (torch.randn(1, 24, 2, 6, requires_grad=True) for _ in range(2))
    elif rank == victim:
        exit_at_step(phase, step, stall=timeout + 3 if fault == "stall" else 0.0)
    t0 = time.monotonic()
    try:
        out = tokenring.attention(q, k, v, causal=causal, strategy=spec, layout=layout, cu_seqlens=cu)
        if phase == "backward":
            t0 = time.monotonic()
        out.sum().backward()
    except (RuntimeError, ValueError) as e:
        names = names_victim(str(e), victim)
        return dict(
            outcome="refused" if isinstance(e, ValueError) else "raised",
            seconds=time.monotonic() - t0,
            names_victim=names or (rank == victim),
            message=str(e)[:400],
        )
    seconds = time.monotonic() - t0
    return dict(outcome="completed", seconds=seconds, error=completed_error(rank, P, q, k, v, out, causal, layout, cu))


def names_victim(message: str, victim: int) -> bool:
    """Whether a survivor's message names the victim: "Rank v is", "rank v (", or a list of ranks "[..]" after
    "rank(s)" / "ranks" holding it."""
    if f"Rank {victim} is" in message or f"rank {victim} (" in message:
        return True
    lists = re.findall(r"(?:rank\(s\)|ranks) \[([0-9, ]+)\]", message)
    return any(str(victim) in [x.strip() for x in found.split(",")] for found in lists)


def ready(rank: int, P: int) -> bool:
    """Nothing: run before a trial so that starting fresh ranks (imports, rendezvous) is not timed with it."""
    return True


def completed_error(rank: int, P: int, q, k, v, out, causal: bool, layout: str, cu) -> float:
    """A survivor that completed its call must hold the right answer: the largest error of its output and its
    gradients (of the sum of every rank's output) relative to float64 attention in one process. Every rank
    holds the same shard values (one seed), so the global inputs are those values at every rank's positions."""
    import torch

    from tokenring.layouts import local_positions
    from tokenring.masks import make_mask, visible

    S = q.shape[1] * P
    pos = [local_positions(S, P, r, layout) for r in range(P)]
    full = []
    for x in (q, k, v):
        y = torch.empty(1, S, *x.shape[2:], dtype=torch.float64)
        for p in pos:
            y[:, p] = x.detach().double()
        full.append(y.requires_grad_())
    Q, K, V = full
    mask = make_mask(S, cu, None, causal)
    i = torch.arange(S)
    seen = visible(mask, i, i) if mask is not None else (i[None, :] <= i[:, None]) if causal else None
    rep = Q.shape[2] // K.shape[2]
    s = torch.einsum("bqhd,bkhd->bhqk", Q, K.repeat_interleave(rep, 2)) * Q.shape[3] ** -0.5
    if seen is not None:
        s = s.masked_fill(~seen, float("-inf"))
    ref = torch.einsum("bhqk,bkhd->bqhd", s.softmax(-1), V.repeat_interleave(rep, 2))
    ref.sum().backward()
    me = pos[rank]
    pairs = [(out, ref[:, me]), (q.grad, Q.grad[:, me]), (k.grad, K.grad[:, me]), (v.grad, V.grad[:, me])]
    return max(((a.double() - b).abs().max() / b.abs().max()).item() for a, b in pairs)


WORKLOADS = ("attention", "hf_train", "generate", "trainer")


def _hf_model():
    """A 2-layer GQA Llama (float32, random weights from a config; the same on every rank)."""
    from hf_cases import build

    return build("llama", "tokenring", num_hidden_layers=2, hidden_size=96, intermediate_size=128,
                 num_attention_heads=12, num_key_value_heads=2, vocab_size=97)  # fmt: skip


def _hf_run(workload: str, model, start: dict, P: int, refuse: bool, trainer=None):
    """One run of ``workload`` from the weights ``start``; what it gives (compared bit for bit with the warm-up
    run's when a survivor completes). ``refuse``: this rank passes what tokenring.hf refuses (other samples or
    another prompt than the other ranks, caught by the agreement checks)."""
    import torch

    import tokenring.hf as thf

    model.load_state_dict(start)
    model.zero_grad(set_to_none=True)
    ids = _ids(P)
    if refuse:
        ids = ids % 96 + 1
    if workload == "hf_train":
        batch = thf.shard_batch(ids, labels=ids, verify=True)
        out = model(**batch)
        out.loss.backward()
        return [out.loss.detach()] + [p.grad for p in model.parameters()]
    if workload == "generate":
        with torch.no_grad():
            cache = thf.prefill(model, ids)
            out = model.generate(ids, attention_mask=torch.ones_like(ids), cache=cache, max_new_tokens=3,
                                 do_sample=False, pad_token_id=0, eos_token_id=None)  # fmt: skip
        return [out]
    trainer.train()
    return [p.detach().clone() for p in model.parameters()]


def _ids(P: int):
    import torch

    return torch.randint(1, 97, (1, 24 * P), generator=torch.Generator().manual_seed(3))


def _trainer(model, P: int, tmp: str):
    """SequenceParallel (dp=1, cp=P) and a SequenceParallelTrainer over it: two SGD steps over 2 samples."""
    from transformers import PrinterCallback, TrainingArguments

    import tokenring.hf as thf

    ids = _ids(P)
    data = [dict(input_ids=row, labels=row) for row in (ids[0], ids[0].flip(0))]
    sp = thf.SequenceParallel()
    args = TrainingArguments(output_dir=tmp, report_to=[], use_cpu=True, save_strategy="no", disable_tqdm=True,
                             per_device_train_batch_size=1, max_steps=2, learning_rate=0.1, optim="sgd",
                             lr_scheduler_type="constant")  # fmt: skip
    trainer = thf.SequenceParallelTrainer(sp, model=model, args=args, train_dataset=data)
    trainer.remove_callback(PrinterCallback)  # no log lines per run
    return sp, trainer


def hf_trial(rank: int, P: int, workload: str, spec: str, phase: str, victim: int, step: int, timeout: float,
             fault: str):  # fmt: skip
    """``trial`` for the HF workloads: a warm-up run (the signatures cached), then the run with one fault on
    rank ``victim``: ``kill`` / ``stall`` at ``step`` of its ``phase`` pass of any attention call (prefill's
    forward, a ``decode`` step, a training step's forward or backward), or ``refuse`` (another prompt or other
    samples on the victim: the agreement checks refuse it on every rank). The trainer is built before the
    clock starts, its ``train()`` run twice."""
    import contextlib
    import tempfile

    import torch
    from refusal_cases import _env

    import tokenring
    import tokenring.hf as thf
    from tokenring.tools.launch import exit_at_step

    tokenring.set_timeout(timeout)
    model = _hf_model()
    start = {k: v.clone() for k, v in model.state_dict().items()}
    with contextlib.ExitStack() as stack:
        tmp = stack.enter_context(tempfile.TemporaryDirectory())
        stack.enter_context(thf.settings(strategy=spec))
        trainer = None
        if workload == "trainer":
            stack.enter_context(_env(rank, P))
            sp, trainer = _trainer(model, P, tmp)
            stack.callback(sp.close)
        warm = _hf_run(workload, model, start, P, False, trainer)
        if rank == victim and fault != "refuse":
            exit_at_step(phase, step, stall=timeout + 3 if fault == "stall" else 0.0)
        t0 = time.monotonic()
        try:
            got = _hf_run(workload, model, start, P, rank == victim and fault == "refuse", trainer)
        except (RuntimeError, ValueError) as e:
            return dict(
                outcome="refused" if isinstance(e, ValueError) else "raised",
                seconds=time.monotonic() - t0,
                names_victim=names_victim(str(e), victim) or (rank == victim),
                message=str(e)[:400],
            )
    same = len(got) == len(warm) and all(torch.equal(a, b) for a, b in zip(got, warm))
    return dict(outcome="completed", seconds=time.monotonic() - t0, error=0.0 if same else float("inf"))


def memory(rank: int, P: int, calls: int, every: int) -> list[tuple[int, float]]:
    """``calls`` forward+backward calls, each with new random documents (a new mask and plan), cycling through
    the strategies; this rank's RSS (MB, from /proc) every ``every`` calls."""
    import random

    import torch

    import tokenring

    rnd, out, s = random.Random(7), [], 32
    S = s * P
    g = torch.Generator().manual_seed(rank)
    q, k, v = (torch.randn(1, s, h, 8, generator=g).requires_grad_() for h in (12, 2, 2))
    for i in range(calls):
        cu = [0] + sorted(rnd.sample(range(1, S), 7)) + [S]
        spec = SPECS[i % len(SPECS)]
        tokenring.attention(q, k, v, causal=True, strategy=spec, layout="contiguous", cu_seqlens=cu).sum().backward()
        if i % every == 0 or i == calls - 1:
            with open("/proc/self/status") as f:
                rss = next(int(x.split()[1]) for x in f if x.startswith("VmRSS")) / 1024
            out.append((i, rss))
    return out


def leftover_children() -> list[int]:
    """Processes whose parent is this one (the soak's ranks must all be gone), except multiprocessing's
    resource tracker, which lives until this interpreter exits."""
    me, out = os.getpid(), []
    for pid in os.listdir("/proc"):
        if pid.isdigit():
            try:
                with open(f"/proc/{pid}/stat") as f:
                    parent = int(f.read().rsplit(")", 1)[1].split()[1])
                with open(f"/proc/{pid}/cmdline", "rb") as f:
                    tracker = b"resource_tracker" in f.read()
                if parent == me and not tracker:
                    out.append(int(pid))
            except (OSError, IndexError, ValueError):
                pass
    return out


def draw(i: int, seed: int, ranks: list[int], mix: tuple[str, ...] = ("attention",)) -> dict:
    """Trial ``i``'s setup, drawn from its own seed (the same whichever worker runs it)."""
    from tokenring.masks import make_mask
    from tokenring.strategies import get, why_not

    rnd = random.Random(seed * 1_000_003 + i)
    P = rnd.choice(ranks)
    workload = rnd.choice(mix)
    spec = rnd.choice([s for s in SPECS if why_not(s, 12, 2, P) is None])
    causal, phase = rnd.random() < 0.5, rnd.choice(["forward", "backward"])
    if workload != "attention":  # the HF models: causal, zigzag, no documents; generate decodes, never backward
        causal = True
        phase = rnd.choice(["forward", "decode"]) if workload == "generate" else phase
    fault = rnd.choice(["kill", "stall"] if workload == "trainer" else ["kill", "stall", "refuse"])
    phase = "forward" if fault == "refuse" else phase
    layout, S, victim = "zigzag" if causal else "contiguous", 24 * P, rnd.randrange(P)
    cu = [0] + sorted(rnd.sample(range(1, S), 3)) + [S] if workload == "attention" and rnd.random() < 0.5 else None
    mask = make_mask(S, cu, None, causal) if cu else None  # the victim's steps: its own plan's
    if phase == "decode":
        steps = 1  # decode gathers every rank's partials in one step
    else:
        steps = len(get(spec).rank_schedule(P, layout, causal, phase == "backward", mask, victim).steps)
    return dict(
        trial=i,
        workload=workload,
        P=P,
        strategy=spec,
        causal=causal,
        cu_seqlens=cu,
        phase=phase,
        fault=fault,
        victim=victim,
        kill_step=rnd.randrange(steps),
        steps=steps,
    )


def summarize(rows: list[dict], timeout: float, left: list[int], wall: float) -> dict:
    surv = [r for row in rows for r in row.get("ranks", []) if r]
    raised = [r for r in surv if r["outcome"] in ("raised", "refused")]
    bound = timeout + 2.0
    return dict(
        trials=len(rows),
        surviving_rank_calls=len(surv),
        raised=len(raised),
        refused=sum(r["outcome"] == "refused" for r in surv),
        completed=sum(r["outcome"] == "completed" for r in surv),
        completed_correct=sum(r["outcome"] == "completed" and r["error"] < 1e-4 for r in surv),
        completed_worst_error=max((r["error"] for r in surv if r["outcome"] == "completed"), default=None),
        faults={f: sum(row["fault"] == f for row in rows) for f in ("kill", "stall", "refuse")},
        workloads={w: sum(row.get("workload", "attention") == w for row in rows) for w in WORKLOADS},
        masked_trials=sum(row["cu_seqlens"] is not None for row in rows),
        raised_within_bound=sum(r["seconds"] <= bound for r in raised),
        raised_naming_victim=sum(r["names_victim"] for r in raised),
        hangs=sum("hang" in row for row in rows),
        rerun_after_hang=sum("hang" in row.get("earlier", {}) for row in rows),
        victim_answered=sum(row.get("victim_answered", False) for row in rows),
        slowest_raise_s=max((r["seconds"] for r in raised), default=None),
        bound_s=bound,
        leftover_processes=sorted(set(left)),
        wall_s=wall,
    )


def main(argv=None) -> int:
    import threading
    from concurrent.futures import ThreadPoolExecutor

    from tokenring.tools.launch import RankError, RankPool

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--trials", type=int, default=500)
    ap.add_argument("--memory", type=int, default=0, help="instead: this many calls with new masks, RSS kept")
    ap.add_argument("--timeout", type=float, default=2.0)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--ranks", type=int, nargs="+", default=[2, 3, 4], help="group sizes to draw from")
    ap.add_argument("--mix", nargs="+", choices=WORKLOADS, default=["attention"], help="workloads to draw from")
    ap.add_argument("--start", choices=["spawn", "fork"], default="spawn", help="how ranks start (RankPool)")
    ap.add_argument("--workers", type=int, default=1, help="trials run at once, each on its own ranks")
    ap.add_argument("--only", type=int, nargs="+", help="run just these trials (their draws from --seed)")
    ap.add_argument("--out", default="fault_soak.json", help="file name under bench/results")
    ap.add_argument("--resume", action="store_true", help="keep the trials in --out, run the missing ones")
    a = ap.parse_args(argv)
    if a.start == "fork" and set(a.mix) - {"attention"}:  # imported once here, not by every fresh rank
        import refusal_cases  # noqa: F401
        from transformers import LlamaForCausalLM, Trainer  # noqa: F401

        import tokenring.hf  # noqa: F401
    if a.memory:
        return memory_run(a.memory)
    rows: list[dict] = []
    commands: list[str] = []
    path = os.path.join(HERE, "results", a.out)
    if a.resume and os.path.exists(path):  # an interrupted soak goes on: keep its trials, run the others
        with open(path) as f:
            earlier = json.load(f)
        commands = earlier.get("commands") or [earlier["command"]]
        again = set(a.only or ())
        rows = [r for r in earlier["trials"] if r["trial"] not in again]
        tried = {r["trial"]: r for r in earlier["trials"] if r["trial"] in again}
    else:
        tried, earlier = {}, {}
    done = {r["trial"] for r in rows}
    before_s = earlier.get("summary", {}).get("wall_s", 0.0)  # the interrupted runs' time, for the total
    lock = threading.Lock()
    t_start = time.monotonic()
    commands.append("python bench/fault_soak.py " + " ".join(argv or sys.argv[1:]))
    machine = dict(cpu=platform.processor() or platform.machine(), cores=os.cpu_count())

    def save(summary: dict) -> None:  # after every trial too, so an interrupted soak keeps what it ran
        out = dict(
            command=commands[-1],
            commands=commands,
            machine=machine,
            summary=summary,
            trials=sorted(rows, key=lambda r: r["trial"]),
        )
        with open(path, "w") as f:
            json.dump(out, f, indent=1)

    def worker(w: int) -> None:
        pools: dict[int, RankPool] = {}
        try:
            todo = sorted(set(a.only or ()) | ({i for i in range(a.trials) if i not in done} if a.resume else set()))
            for i in todo[w :: a.workers] if todo else range(w, a.trials, a.workers):
                row = draw(i, a.seed, a.ranks, tuple(a.mix))
                if i in tried:  # run again: its earlier outcome stays with it
                    row["earlier"] = {k: v for k, v in tried[i].items() if k in ("hang", "ranks")}
                P, spec, victim, fault = row["P"], row["strategy"], row["victim"], row["fault"]
                pool = pools.get(P) or pools.setdefault(P, RankPool(P, 1, 3 * a.timeout + 30, start=a.start))
                limit, pool.timeout = pool.timeout, 600.0  # fresh ranks start up untimed (a loaded host is slow)
                pool.run(ready)
                pool.timeout = limit
                if row["workload"] == "attention":
                    fn, args = trial, (spec, row["causal"], row["phase"], victim, row["kill_step"], a.timeout, fault,
                                       row["cu_seqlens"])  # fmt: skip
                else:
                    where = (row["phase"], victim, row["kill_step"], a.timeout, fault)
                    fn, args = hf_trial, (row["workload"], spec, *where)
                try:
                    res = pool.run(fn, *args, allow_exit=True)
                    row["ranks"] = [None if r == victim else res[r] for r in range(P)]
                    row["victim_answered"] = res[victim] is not None and fault == "kill"
                except RankError as e:  # a survivor that gave no answer in time: a hang
                    row["hang"] = str(e)[:600]
                if fault in ("stall", "refuse"):  # a timed-out group is not usable again: the next trial needs
                    pools.pop(P).close()  # fresh ranks (a refusal after agreeing reaches the others as a timeout)
                surv = [r for r in row.get("ranks", []) if r]
                line = (
                    f"{i:3d} {row['workload']:9s} P={P} {spec:26s} {'causal' if row['causal'] else 'full  '} "
                    f"{'docs' if row['cu_seqlens'] else '    '} {row['phase']:8s} {fault} "
                    f"r{victim}@{row['kill_step']}: "
                ) + (
                    "HANG"
                    if "hang" in row
                    else ", ".join(
                        f"{r['outcome']} {r['seconds']:.1f}s"
                        + (f" err {r['error']:.1e}" if r["outcome"] == "completed" else "")
                        + ("" if r["outcome"] != "raised" else (" named" if r["names_victim"] else " UNNAMED"))
                        for r in surv
                    )
                )
                with lock:
                    rows.append(row)
                    print(line, flush=True)
                    save(summarize(rows, a.timeout, [], before_s + time.monotonic() - t_start) | dict(finished=False))
        finally:
            for pool in pools.values():
                pool.close()

    with ThreadPoolExecutor(a.workers) as ex:
        for f in [ex.submit(worker, w) for w in range(a.workers)]:
            f.result()
    time.sleep(1.0)
    left = leftover_children() + [p.pid for p in multiprocessing.active_children()]
    summary = summarize(rows, a.timeout, left, before_s + time.monotonic() - t_start)
    save(summary)
    print(json.dumps(summary, indent=1))
    raised = summary["raised"]
    ok = (
        summary["hangs"] == 0
        and summary["completed_correct"] == summary["completed"]
        and not left
        and summary["victim_answered"] == 0
        and summary["raised_within_bound"] == raised
        and summary["raised_naming_victim"] == raised
    )
    return 0 if ok else 1


def memory_run(calls: int) -> int:
    """RSS of 4 ranks over ``calls`` calls with a new mask each: flat means no cache or plan grows with calls."""
    from tokenring.tools.launch import spawn

    t0 = time.monotonic()
    every = max(1, calls // 20)
    res = spawn(memory, 4, calls, every, timeout=calls * 2 + 600)
    # growth after the first 10% of calls (the bounded caches fill up to their sizes there)
    start = max(1, len(res[0]) // 10)
    growth = [r[-1][1] - r[start][1] for r in res]
    out = dict(
        command=f"python bench/fault_soak.py --memory {calls}",
        machine=dict(cpu=platform.processor() or platform.machine(), cores=os.cpu_count()),
        shape="P=4, s=32/rank, H=12, Hkv=2, d=8, fp32, causal, 8 random documents per call (a new mask each)",
        strategies=SPECS,
        rss_mb_per_rank=res,
        growth_after_warmup_mb=growth,
        wall_s=time.monotonic() - t0,
    )
    with open(os.path.join(HERE, "results", "fault_soak_memory.json"), "w") as f:
        json.dump(out, f, indent=1)
    print(json.dumps({k: v for k, v in out.items() if k != "rss_mb_per_rank"}, indent=1))
    return 0 if max(growth) < 20 else 1


if __name__ == "__main__":
    raise SystemExit(main())
