"""Rank-side functions for tests/test_refusals.py (run by a RankPool: ``fn(rank, P)``): every ValueError of
tokenring.hf's batch, generation and training APIs leaves nothing behind.

One small model per rank function (a 1-layer GQA Llama, float32) runs a table of refusal kinds, one line each:
a name, a callable that must raise ValueError on every rank, and a phrase its message must contain. After each
refusal: every rank raised (gathered), the settings (tokenring.hf's, the active SequenceParallel, tokenring's),
the model (weights, gradients, every module's attributes, hooks and mode, its configs) and the caches made
before the refusal are as they were, and the normal calls that follow give bit for bit what the same calls
gave before any refusal: a forward+backward through ``shard_batch`` (loss, logits, this rank's gradients), a
``prefill`` + 4 greedy tokens, an ``extend`` of the cache made before the refusal + 4 tokens, and 4 tokens over
a left-padded prefill made before it (their ids and every step's logits). Their collectives running in step is
the process group's check.
"""

from __future__ import annotations

import contextlib
import os
import tempfile
import time

import torch
import torch.distributed as dist
from generate_cases import left_padded
from hf_cases import build, packed_positions, tokens

import tokenring
import tokenring.hf as thf
from tokenring.hf import config as hf_config

GREEDY = dict(
    max_new_tokens=4,
    do_sample=False,
    output_logits=True,
    return_dict_in_generate=True,
    pad_token_id=0,
    eos_token_id=None,
)
HOOKS = ("_forward_hooks", "_forward_pre_hooks", "_backward_hooks", "_backward_pre_hooks", "_state_dict_hooks")


def differ(a, b, path: str = "") -> str | None:
    """Where ``a`` and ``b`` differ (tensors bit for bit, with dtype and shape), or ``None``."""
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        ok = isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor)
        ok = ok and a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b)
        return None if ok else path or "value"
    if isinstance(a, dict) and isinstance(b, dict):
        if a.keys() != b.keys():
            return f"{path} keys {sorted(set(a) ^ set(b), key=str)}"
        return next((w for k in a if (w := differ(a[k], b[k], f"{path}.{k}")) is not None), None)
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        if type(a) is not type(b) or len(a) != len(b):
            return f"{path} (length {len(a)} vs {len(b)})"
        return next((w for i, (x, y) in enumerate(zip(a, b)) if (w := differ(x, y, f"{path}[{i}]")) is not None), None)
    return None if a == b else f"{path} ({a!r} vs {b!r})"


def settings_state() -> dict:
    return dict(hf=dict(vars(hf_config._settings)), active=hf_config.active(), core=tokenring.options())


def model_state(model) -> dict:
    return dict(
        params={
            n: (p.detach().clone(), p.requires_grad, None if p.grad is None else p.grad.clone())
            for n, p in model.named_parameters()
        },
        buffers={n: b.clone() for n, b in model.named_buffers()},
        modules={
            n: (m.training, sorted(vars(m)), [len(getattr(m, h)) for h in HOOKS]) for n, m in model.named_modules()
        },
        config=model.config.to_dict(),
        generation=model.generation_config.to_dict(),
    )


def cache_state(cache) -> dict | None:
    if cache is None:
        return None
    clone = lambda t: None if t is None else t.clone()  # noqa: E731 (a step must not write in place either)
    layers = [
        (clone(x.keys), clone(x.values), x.positions.clone(), list(x.counts), x.total, x.skip) for x in cache.layers
    ]
    return dict(
        layers=layers,
        spans=list(cache.spans),
        pads=cache.pads,
        prefilling=cache.prefilling,
        extending=cache.extending,
        strategy=cache.strategy,
        chosen=cache._chosen,
    )


def gathered(values: list[int]) -> list[list[int]]:
    """Every rank's ``values``: a rank that skipped or repeated a collective would pair with another call here."""
    t = torch.tensor(values, dtype=torch.int64)
    parts = [torch.empty_like(t) for _ in range(dist.get_world_size())]
    dist.all_gather(parts, t)
    return [p.tolist() for p in parts]


class Bench:
    """The model, a model of other K/V shapes, and the inputs of the normal calls."""

    def __init__(self, rank: int, P: int):
        self.rank, self.P = rank, P
        self.model = build("llama", "tokenring", num_hidden_layers=1).eval()
        self.other = build("llama", "tokenring", num_hidden_layers=1, num_key_value_heads=4).eval()
        V = self.model.config.vocab_size
        self.ids = tokens(8 * P + 3, V)  # the prompt: 8P sharded, 3 as one decode step
        self.turn = torch.cat([self.ids, tokens(4 * P + 5, V, seed=2)], 1)  # a turn extend shards (> 4 per rank)
        self.pids, self.pmask = left_padded([9, 16, 4], V)
        self.train = tokens(16 * P, V, B=2, seed=3)

    def caches(self) -> dict:
        """The caches a refusal may be given, made before it: a prompt's and a left-padded batch's."""
        return dict(
            cache=thf.prefill(self.model, self.ids),
            padded=thf.prefill(self.model, self.pids, attention_mask=self.pmask),
        )

    def normal(self, st: dict, sp=None) -> dict:
        """The normal calls (``sp``: a training step through its shard_batch only; prefill refuses under it)."""
        m = self.model
        m.zero_grad(set_to_none=True)
        batch = (sp.shard_batch if sp is not None else thf.shard_batch)(self.train, labels=self.train)
        out = m(**batch)
        out.loss.backward()
        res = dict(
            loss=out.loss.detach(),
            logits=out.logits.detach(),
            grads={n: p.grad for n, p in m.named_parameters()},
        )
        if sp is not None:
            return res

        def generate(ids, mask, cache):
            out = m.generate(ids, attention_mask=mask, cache=cache, **GREEDY)
            return out.sequences, out.logits

        ones = torch.ones_like(self.ids)
        res["prefill"] = generate(self.ids, ones, thf.prefill(m, self.ids))
        thf.extend(m, st["cache"], self.turn)
        res["extend"] = generate(self.turn, torch.ones_like(self.turn), st["cache"])
        res["padded"] = generate(self.pids, self.pmask, st["padded"])
        return res

    def run(self, table: list, fresh, normal) -> dict:
        """Each refusal of ``table`` on caches ``fresh()`` makes, then ``normal(caches)`` vs its value before."""
        reference = normal(fresh())
        msgs, problems, seconds = {}, [], {}
        for i, (name, refuse, phrase) in enumerate(table):
            t0 = time.perf_counter()
            st = fresh()
            before = dict(settings=settings_state(), model=model_state(self.model))
            before.update({k: cache_state(c) for k, c in st.items()})
            try:
                refuse(st)
                msg = None
            except ValueError as e:
                msg = str(e)
            raised = gathered([i, msg is not None])
            if any(r != [i, 1] for r in raised):  # the same on every rank: all stop here
                raise AssertionError(f"{name}: (kind, refused) on every rank: {raised} (rank {self.rank}: {msg})")
            msgs[name] = msg
            mine = []
            if phrase not in msg:
                mine.append(f"{name}: the message lacks {phrase!r}: {msg}")
            after = dict(settings=settings_state(), model=model_state(self.model))
            after.update({k: cache_state(c) for k, c in st.items()})
            if (where := differ(before, after)) is not None:
                mine.append(f"{name}: the refusal changed {where}")
            failed = False
            try:
                if (where := differ(reference, normal(st))) is not None:
                    mine.append(f"{name}: the normal calls after the refusal differ at {where}")
            except Exception as e:  # noqa: BLE001 - reported with the kind, then every rank stops
                mine.append(f"{name}: the normal calls after the refusal failed: {type(e).__name__}: {e}")
                failed = True
            problems += [f"rank {self.rank}: {p}" for p in mine]
            if any(f for _, f in gathered([i, failed])):
                raise AssertionError("\n".join(problems) or f"{name}: the normal calls failed on another rank")
            seconds[name] = time.perf_counter() - t0
        return dict(msgs=msgs, problems=problems, seconds=seconds)


def _settings_block() -> None:
    with thf.settings(strategy="ring", layout="diagonal"):
        pass


def plain_table(b: Bench) -> list:
    """Refusals of shard_batch, the settings, prefill, extend and generate, with no SequenceParallel active."""
    rank, P, m, V = b.rank, b.P, b.model, b.model.config.vocab_size
    t = b.train
    holed = torch.ones_like(t)
    holed[:, 5:8] = 0  # pads between real tokens
    left = torch.ones_like(t)
    left[:, :3] = 0  # left padding with labels on every real token: the last pad would predict the first one
    packed = torch.cat([packed_positions([8 * P, 8 * P]), packed_positions([4 * P, 12 * P])])
    theirs = tokens(16 * P, V, B=2, seed=10 + rank)  # each rank its own samples (a per-rank sampler)
    right, hole = b.pmask.flip(1), b.pmask.clone()
    hole[0, 10] = 0
    shifted = b.pmask.clone()
    shifted[2, -5] = 1  # row 2 with one pad fewer than the prefill had
    one_pad = torch.ones_like(b.ids)
    one_pad[:, :2] = 0
    n = b.ids.shape[1]
    other_turn = torch.cat([b.ids, tokens(4 * P + 5, V, seed=20 + rank)], 1)
    edited = torch.cat([tokens(n, V, seed=5), b.turn[:, n:]], 1)
    ones = torch.ones_like(b.ids)
    table = [
        ("shard_batch_samples", lambda st: thf.shard_batch(theirs, labels=theirs, verify=True), "different samples"),
        ("shard_batch_hole", lambda st: thf.shard_batch(t, labels=t, attention_mask=holed), "a hole"),
        ("shard_batch_pad_target", lambda st: thf.shard_batch(t, labels=t, attention_mask=left), "has a target"),
        ("shard_batch_packing", lambda st: thf.shard_batch(t, position_ids=packed), "share one packing"),
        ("shard_batch_mask_shape", lambda st: thf.shard_batch(t, attention_mask=holed[:, 1:]), "differ in shape"),
        ("configure", lambda st: thf.configure(strategy="ring", layout="diagonal"), "is not supported"),
        ("settings_block", lambda st: _settings_block(), "is not supported"),
        ("core_configure", lambda st: tokenring.configure(timeout=7, cpu_backward="fast"), "cpu_backward must be"),
        ("sequence_parallel_layout", lambda st: thf.SequenceParallel(layout="diagonal"), "is not supported"),
        ("prefill_prompts", lambda st: thf.prefill(m, b.ids if rank else b.ids.flip(1)), "different prompt"),
        ("prefill_right_padding", lambda st: thf.prefill(m, b.pids, attention_mask=right), "on the left only"),
        ("prefill_hole", lambda st: thf.prefill(m, b.pids, attention_mask=hole), "after a real token"),
        ("extend_ranks", lambda st: thf.extend(m, st["cache"], other_turn), "different conversation"),
        ("extend_other_model", lambda st: thf.extend(b.other, st["cache"], b.turn), "another model"),
        ("extend_edited", lambda st: thf.extend(m, st["cache"], edited), "differ from the ones"),
        ("extend_padded", lambda st: thf.extend(m, st["padded"], b.pids.repeat(1, 2)), "left-padded prompts"),
        (
            "generate_beam",
            lambda st: m.generate(b.ids, attention_mask=ones, cache=st["cache"], **{**GREEDY, "num_beams": 2}),
            "beam search",
        ),
        (
            "generate_other_model",
            lambda st: b.other.generate(b.ids, attention_mask=ones, cache=st["cache"], **GREEDY),
            "another model",
        ),
        (
            "generate_mask",
            lambda st: m.generate(b.pids, attention_mask=shifted, cache=st["padded"], **GREEDY),
            "does not pad the rows",
        ),
        (
            "generate_unpadded_mask",
            lambda st: m.generate(b.pids, attention_mask=torch.ones_like(b.pids), cache=st["padded"], **GREEDY),
            "attention_mask given to tokenring.hf.prefill",
        ),
        (
            "generate_padded_mask",
            lambda st: m.generate(b.ids, attention_mask=one_pad, cache=st["cache"], **GREEDY),
            "prefilled without one",
        ),
    ]
    if P % 2:  # 2 K/V heads do not split over 3 ranks: refused inside the step, after the layer stored its rows
        table.append(("extend_ulysses", lambda st: thf.extend(m, st["cache"], b.turn, strategy="ulysses"), f"by P={P}"))
    return table


@contextlib.contextmanager
def _env(rank: int, P: int):
    """What torchrun would set, for accelerate (the process group itself is already up); put back after
    (LOCAL_WORLD_SIZE is tokenring's node_size setting)."""
    env = dict(RANK=rank, WORLD_SIZE=P, LOCAL_RANK=rank, LOCAL_WORLD_SIZE=P, MASTER_ADDR="127.0.0.1")
    env = {k: str(v) for k, v in env.items()} | dict(MASTER_PORT="29555")
    old = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    try:
        yield
    finally:
        for k, v in old.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def trainer_table(b: Bench, sp, trainer, tmp: str) -> list:
    """Refusals of SequenceParallel.shard_batch and SequenceParallelTrainer, with ``sp`` active."""
    from transformers import TrainingArguments

    P, m, V = b.P, b.model, b.model.config.vocab_size
    t = b.train
    holed = torch.ones_like(t)
    holed[:, 5:8] = 0
    left = torch.ones_like(t)
    left[:, :3] = 0
    packed = torch.cat([packed_positions([8 * P, 8 * P]), packed_positions([4 * P, 12 * P])])
    theirs = tokens(16 * P, V, B=2, seed=10 + b.rank)
    args = dict(output_dir=tmp, report_to=[], use_cpu=True, save_strategy="no", disable_tqdm=True)

    def build_trainer(**kw):
        more = kw.pop("args", {})
        thf.SequenceParallelTrainer(sp, model=m, args=TrainingArguments(**args, **more), **kw)

    def loss_fn(outputs, labels, num_items_in_batch=None):
        return outputs.loss

    return [
        ("sp_samples", lambda st: sp.shard_batch(theirs, labels=theirs), "different samples"),
        ("sp_hole", lambda st: sp.shard_batch(t, labels=t, attention_mask=holed), "a hole"),
        ("sp_pad_target", lambda st: sp.shard_batch(t, labels=t, attention_mask=left), "has a target"),
        ("sp_packing", lambda st: sp.shard_batch(t, position_ids=packed), "share one packing"),
        ("plain_shard_batch_under_sp", lambda st: thf.shard_batch(t, labels=t), "SequenceParallel is active"),
        ("trainer_compute_loss_func", lambda st: build_trainer(compute_loss_func=loss_fn), "compute_loss_func"),
        (
            "trainer_token_average",
            lambda st: build_trainer(args=dict(average_tokens_across_devices=False)),
            "average_tokens_across_devices=True",
        ),
        (
            "trainer_bare_step",
            lambda st: trainer.training_step(trainer.model, dict(input_ids=t, labels=t)),
            "trains as a bare",
        ),
    ]


def refusals_leave_nothing(rank: int, P: int) -> dict:
    """The plain table, then (a SequenceParallel active, a SequenceParallelTrainer built over the model) the
    trainer table, then once more the plain normal calls, after the SequenceParallel closed: the same as before
    any refusal. Returns the messages, the problems found and each kind's seconds."""
    from transformers import TrainingArguments

    b = Bench(rank, P)
    plain = lambda st: b.normal(st)  # noqa: E731
    with thf.settings():  # the SequenceParallel below configures the group: put the settings back after
        start = settings_state()
        res = b.run(plain_table(b), b.caches, plain)
        reference = plain(b.caches())
        sp = thf.SequenceParallel()
        try:
            with _env(rank, P), tempfile.TemporaryDirectory() as tmp:
                args = TrainingArguments(output_dir=tmp, report_to=[], use_cpu=True, disable_tqdm=True)
                trainer = thf.SequenceParallelTrainer(sp, model=b.model, args=args)
                more = b.run(trainer_table(b, sp, trainer, tmp), dict, lambda st: b.normal(st, sp))
        finally:
            sp.close()
    res = {k: res[k] + more[k] if k == "problems" else res[k] | more[k] for k in res}
    if (where := differ(start, settings_state())) is not None:
        res["problems"].append(f"rank {rank}: the settings after the trainer table differ at {where}")
    if (where := differ(reference, plain(b.caches()))) is not None:
        res["problems"].append(f"rank {rank}: the normal calls after the trainer table differ at {where}")
    return res
