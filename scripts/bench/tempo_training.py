#!/usr/bin/env python3
"""Benchmark: tempo (memory-lean fine-tuning) side by side with stock PyTorch, on CPU, in one run.

Models are Hugging Face BERT built from BertConfig() (BERT-base: H=768, 12 heads, 3072 intermediate),
random init, eager attention, dropout 0.1, float32; no downloads. Every section runs in its own child
process through the shared harness (wall, CPU, peak RSS of the process tree).

layer   One BERT-base layer, B=8, S=128.
        Bytes autograd keeps for backward (tempo.measure: saved-tensor hooks, once per storage, weights
        apart) for stock (CPU: float dropout masks), stock with boolean masks as on GPU (dropout through
        torch.native_dropout, bit-identical on CPU), tempo and each technique alone. "isolated": the layer
        alone; "in a stack": what one more layer adds to a stack (2 layers minus 1), i.e. the per-layer
        cost in a deep model, where a layer's output is the next one's input (kept once).
        Where the bytes go in the isolated layer: per module, stock with boolean masks beside tempo, the
        storages tempo keeps, and how much of tempo's total is full-size float tensors (T*H elements or
        more), GELU's branch bits, and the rest.
        Forward output and the RNG state it leaves, each variant against stock (torch.equal).
        Forward + backward time: stock and the --timed variants interleaved in one process, wall and
        process CPU time of --reps steps each: best (min), median, and paired (median over reps of the
        ratio to the stock step run next to it, which saw the same load). On a busy machine CPU time and
        the paired ratios are the steady figures; the best wall time is whichever step met a quiet moment.
grads   The same layer's gradients (every parameter and the input) against float64 stock: relative L2
        error of stock float32 and of tempo float32, and their ratio. attention.self.key.bias has a zero
        gradient in exact arithmetic (softmax ignores a per-row constant), so both errors there are
        relative to rounding noise: shown, not judged.
train   300 AdamW steps (--lr, default 3e-4) fine-tuning a small BERT (H=128, 2 layers) on a synthetic
        classification task, stock and patched from the same seed: largest relative difference of the loss
        at any step; and, as a control, stock again on one thread (other summation orders: what rounding
        alone does to the same run).
model   Whole BERT-base (BertForSequenceClassification) from its config, B=8, S=128: bytes kept for
        backward, stock vs tempo; peak RSS of two training steps (AdamW) at B=8 and 16; and the largest
        batch whose two training steps fit a memory budget (--budget-gib, default 5: a memory cgroup, the
        kernel decides; root only; the search starts from the batch the two peaks predict). Each with glibc
        malloc as it comes and with MALLOC_MMAP_THRESHOLD_=65536 (--malloc): glibc's default keeps freed
        activations in its heap, so RSS follows the heap's high-water mark.

sdpa    Hugging Face's default attention: BertModel from BertConfig(num_hidden_layers=2), i.e. BERT-base
        sizes with attn_implementation="sdpa" (the default), B=8, S=128, dropout 0.1, CPU. Bytes kept for
        backward, stock vs tempo (and the same model with eager attention, for reference), and what
        tempo.patch says of the attention modules. Then training steps (forward, backward, AdamW) of
        BertForSequenceClassification with those 2 layers at each of --sdpa-batches, stock and tempo, each
        in its own child process, --rounds rounds alternating which goes first (A/B, interleaved). Per child,
        after a warm-up step that allocates AdamW's state, --sdpa-steps steps, the kernel's peak RSS reset
        before each (/proc/self/clear_refs): peak RSS of the process (weights, gradients, AdamW state
        included), the peak above the RSS the step started from, after the forward (the activations) and
        after the whole step (AdamW's temporaries included), and wall and CPU time per step; medians over
        rounds with the spread, and the median of the per-round tempo/stock ratios.

Targets (issue #15): saved bytes <= 0.62x stock-with-boolean-masks per layer; time <= 1.25x stock;
gradient error <= 3x stock's for every parameter; loss within 1e-4 relative at every step.

    python3 scripts/bench/tempo_training.py                    # everything (~15-25 min on 2 cores)
    python3 scripts/bench/tempo_training.py --quick            # fewer timing steps, no budget search
    python3 scripts/bench/tempo_training.py --only layer,grads --reps 20
    python3 scripts/bench/tempo_training.py --only layer --threads 1   # timing without OpenMP (steadier when busy)
    python3 scripts/bench/tempo_training.py --only model --threads 1 --malloc default   # one glibc setting
    python3 scripts/bench/tempo_training.py --only sdpa --malloc mmap --rounds 6    # sdpa model: bytes, A/B steps
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent.parent
# the checkout's root first so `import tempo` finds this worktree's package
sys.path.insert(0, str(ROOT))

MiB = 1 << 20
VARIANTS = ("stock", "stock-bool", "tempo", "tempo-gelu", "tempo-layernorm", "tempo-attention", "tempo-dropout")
TECHNIQUES = ("gelu", "layernorm", "attention", "dropout")


# ------------------------------------------------------------------------------------------------------
# children: each prints one JSON object on stdout
# ------------------------------------------------------------------------------------------------------
def _bert_config(**overrides):
    import transformers

    return transformers.BertConfig(attn_implementation="eager", **overrides)


def _patch(model, variant: str):
    """Apply `variant` to model in place (stock variants: nothing)."""
    import tempo

    if variant == "tempo":
        tempo.patch(model)
    elif variant.startswith("tempo-"):
        only = variant.split("-", 1)[1]
        tempo.patch(model, **{t: t == only for t in TECHNIQUES})
    return model


class _BooleanMaskDropout:
    """While active, F.dropout in training goes through torch.native_dropout: the fused op CUDA uses, which
    keeps a bool mask; on CPU its output and RNG use are bit-identical to F.dropout's (float mask)."""

    def __enter__(self):
        import torch
        import torch.nn.functional as F

        self.original = F.dropout

        def dropout(input, p=0.5, training=True, inplace=False):
            if not training or p == 0.0 or inplace:
                return self.original(input, p, training, inplace)
            return torch.native_dropout(input, p, True)[0]

        F.dropout = dropout
        return self

    def __exit__(self, *exc):
        import torch.nn.functional as F

        F.dropout = self.original


def _measure(model, inputs, variant: str):
    """tempo.measure's report for `variant` (stock-bool: with boolean dropout masks)."""
    import contextlib

    import tempo

    context = _BooleanMaskDropout() if variant == "stock-bool" else contextlib.nullcontext()
    with context:
        return tempo.measure(model, inputs)


def child_layer(args) -> dict:
    import copy

    import torch
    from transformers.models.bert.modeling_bert import BertLayer

    torch.manual_seed(0)
    base = BertLayer(_bert_config()).train()
    second = BertLayer(_bert_config()).train()

    class Stack(torch.nn.Module):
        def __init__(self, a, b):
            super().__init__()
            self.a, self.b = a, b

        def forward(self, x):
            return self.b(self.a(x))

    x = torch.randn(args.batch, args.seq, 768, generator=torch.Generator().manual_seed(1))
    saved, modules, storages = {}, {}, []
    for variant in VARIANTS:
        one = _patch(copy.deepcopy(base), variant)
        two = _patch(Stack(copy.deepcopy(base), copy.deepcopy(second)), variant)
        torch.manual_seed(2)
        isolated = _measure(one, (x.clone().requires_grad_(),), variant)
        torch.manual_seed(2)
        stacked = _measure(two, (x.clone().requires_grad_(),), variant).total_bytes
        saved[variant] = {"isolated": isolated.total_bytes, "stack": stacked - isolated.total_bytes}
        modules[variant] = isolated.by_path()
        if variant == "tempo":
            storages = [[s.path, str(s.dtype).removeprefix("torch."), list(s.shape), s.bytes] for s in isolated.storages]

    timed = [v for v in VARIANTS if v != "stock-bool" and (v == "stock" or v in args.timed.split(","))]
    layers = {v: _patch(copy.deepcopy(base), v) for v in timed}
    grad = torch.randn(args.batch, args.seq, 768, generator=torch.Generator().manual_seed(3))

    def forward(layer):  # training forward from a fixed seed: (output, the RNG state it left)
        torch.manual_seed(4)
        out = layer(x.clone().requires_grad_())
        return (out[0] if isinstance(out, tuple) else out).detach(), torch.get_rng_state()

    out_stock, rng_stock = forward(layers["stock"])
    identical = {}
    for v in timed:
        out, rng = forward(layers[v])
        identical[v] = bool(torch.equal(out, out_stock) and torch.equal(rng, rng_stock))
    wall = {v: [] for v in timed}
    cpu = {v: [] for v in timed}

    def step(layer):
        inp = x.clone().requires_grad_()
        out = layer(inp)
        out = out[0] if isinstance(out, tuple) else out
        out.backward(grad)

    for v in timed:  # warm-up (tables, allocator)
        step(layers[v])
        step(layers[v])
    for rep in range(args.reps):
        order = timed if rep % 2 == 0 else timed[::-1]
        for v in order:
            w0, c0 = time.perf_counter(), time.process_time()
            step(layers[v])
            wall[v].append(time.perf_counter() - w0)
            cpu[v].append(time.process_time() - c0)
    return {"saved": saved, "modules": modules, "storages": storages, "tokens_hidden": args.batch * args.seq * 768,
            "identical": identical, "threads": torch.get_num_threads(),
            "wall": {v: statistics.median(t) for v, t in wall.items()},
            "cpu": {v: statistics.median(t) for v, t in cpu.items()},
            "wall_best": {v: min(t) for v, t in wall.items()}, "cpu_best": {v: min(t) for v, t in cpu.items()},
            # each rep's steps run back to back: the ratio within a rep sees the same load on the machine
            "wall_paired": {v: statistics.median(a / b for a, b in zip(t, wall["stock"])) for v, t in wall.items()},
            "cpu_paired": {v: statistics.median(a / b for a, b in zip(t, cpu["stock"])) for v, t in cpu.items()}}


def child_grads(args) -> dict:
    import copy

    import torch
    from transformers.models.bert.modeling_bert import BertLayer

    from tempo.numerics import gradient_errors

    torch.manual_seed(0)
    stock = BertLayer(_bert_config()).train()
    patched = _patch(copy.deepcopy(stock), "tempo")
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(args.batch, args.seq, 768, generator=gen)
    g = torch.randn(args.batch, args.seq, 768, generator=gen)
    return {"rows": [{"name": r.name, "ref_norm": r.reference_norm, "stock": r.stock, "tempo": r.patched}
                     for r in gradient_errors(stock, patched, x, g)]}


def child_train(args) -> dict:
    import torch
    import transformers

    import tempo

    def build():
        torch.manual_seed(0)
        config = _bert_config(hidden_size=128, num_hidden_layers=2, num_attention_heads=4, intermediate_size=512,
                              vocab_size=200, max_position_embeddings=64, num_labels=2)
        return transformers.BertForSequenceClassification(config).train()

    def batch(step):
        gen = torch.Generator().manual_seed(1000 + step)
        ids = torch.randint(5, 200, (16, 32), generator=gen)
        labels = (ids[:, :16] < 60).sum(1).gt(4).long()  # more than 4 "small" tokens in the first half?
        return ids, labels

    def train(model):
        optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr)
        torch.manual_seed(1)
        losses = []
        for step in range(args.steps):
            ids, labels = batch(step)
            loss = model(input_ids=ids, labels=labels).loss
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
            losses.append(loss.item())
        return losses

    stock = train(build())
    patched_model = build()
    tempo.patch(patched_model)
    patched = train(patched_model)
    result = {"stock": stock, "tempo": patched}
    if args.control:  # stock again on one thread: other summation orders, i.e. rounding alone
        threads = torch.get_num_threads()
        torch.set_num_threads(1)
        result["control"] = train(build())
        torch.set_num_threads(threads)
        result["threads"] = threads
    return result


def _bert_base():
    import torch
    import transformers

    torch.manual_seed(0)
    return transformers.BertForSequenceClassification(_bert_config(num_labels=2)).train()


def _bert_batch(batch: int, seq: int):
    import torch

    gen = torch.Generator().manual_seed(batch)
    return {"input_ids": torch.randint(1000, 30000, (batch, seq), generator=gen),
            "labels": torch.randint(0, 2, (batch,), generator=gen)}


def child_model_saved(args) -> dict:
    import torch

    saved = {}
    for variant in ("stock", "stock-bool", "tempo"):
        model = _patch(_bert_base(), variant)
        torch.manual_seed(2)
        saved[variant] = _measure(model, _bert_batch(args.batch, args.seq), variant).total_bytes
    return {"saved": saved}


def child_step(args) -> dict:
    """Two AdamW training steps of BERT-base at --batch (the second one with optimizer state allocated)."""
    import resource

    import torch

    model = _patch(_bert_base(), args.variant)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-5)
    batch = _bert_batch(args.batch, args.seq)
    times = []
    for _ in range(2):
        t0 = time.perf_counter()
        loss = model(**batch).loss
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        times.append(time.perf_counter() - t0)
    return {"step_seconds": times, "max_rss": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024}


def _sdpa_model(variant: str, implementation: str = "sdpa", head: bool = False):
    """BERT-base sizes, 2 layers, from BertConfig (sdpa: the default attention), dropout 0.1, training mode."""
    import torch
    import transformers

    config = transformers.BertConfig(num_hidden_layers=2, attn_implementation=implementation, num_labels=2)
    torch.manual_seed(0)
    model = (transformers.BertForSequenceClassification if head else transformers.BertModel)(config).train()
    report = None
    if variant == "tempo":
        import tempo

        report = tempo.patch(model)
    return model, report


def child_sdpa_saved(args) -> dict:
    import torch

    import tempo

    ids = torch.randint(1000, 30000, (args.batch, args.seq), generator=torch.Generator().manual_seed(8))
    saved, attention, lines = {}, {}, []
    for implementation in ("sdpa", "eager"):
        for variant in ("stock", "tempo"):
            model, report = _sdpa_model(variant, implementation)
            torch.manual_seed(2)
            measured = tempo.measure(model, {"input_ids": ids})
            saved[f"{variant}-{implementation}"] = measured.total_bytes
            attention[f"{variant}-{implementation}"] = measured.by_path()["encoder.layer.0.attention.self"]
            if report is not None and implementation == "sdpa":
                lines = [f"{s.path}: {s.before} -> {s.after} ({s.note})" for s in report.swapped if s.note]
                lines += [f"{m.path}: left: {m.reason}" for m in report.left]
    return {"saved": saved, "attention": attention, "report": lines}


def _vm(field: str) -> int:
    with open("/proc/self/status") as status:
        for line in status:
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
    raise RuntimeError(f"no {field} in /proc/self/status")


def child_sdpa_step(args) -> dict:
    """One warm-up training step (AdamW state allocated), then --sdpa-steps measured ones, the kernel's peak
    RSS reset before each (writing 5 to /proc/self/clear_refs) and read after the forward and after the step."""
    import torch

    model, _ = _sdpa_model(args.variant, head=True)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-5)
    gen = torch.Generator().manual_seed(args.batch)
    batch = {"input_ids": torch.randint(1000, 30000, (args.batch, args.seq), generator=gen),
             "labels": torch.randint(0, 2, (args.batch,), generator=gen)}
    torch.manual_seed(3)
    runs = []
    for _ in range(1 + args.sdpa_steps):
        with open("/proc/self/clear_refs", "w") as clear:
            clear.write("5")
        base = _vm("VmRSS")
        w0, c0 = time.perf_counter(), time.process_time()
        loss = model(**batch).loss
        forward = _vm("VmHWM") - base
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        runs.append({"wall": time.perf_counter() - w0, "cpu": time.process_time() - c0, "forward": forward,
                     "above": _vm("VmHWM") - base, "peak": _vm("VmHWM")})
    measured = runs[1:]  # the first allocated AdamW's state
    return {key: statistics.median(r[key] for r in measured) for key in measured[0]} | {
        "peak": max(r["peak"] for r in measured)}


CHILDREN = {"sdpa-saved": child_sdpa_saved, "sdpa-step": child_sdpa_step, "layer": child_layer, "grads": child_grads, "train": child_train, "model-saved": child_model_saved,
            "step": child_step}


# ------------------------------------------------------------------------------------------------------
# parent
# ------------------------------------------------------------------------------------------------------
def run_child(name: str, cgroup=None, check: bool = True, env: dict | None = None, **options):
    """Run a child section through the harness; (its JSON result or None if it failed, the harness Measure)."""
    import tempfile

    from harness import run_measured

    cmd = [sys.executable, str(Path(__file__).resolve()), "--child", name]
    for key, value in options.items():
        cmd += [f"--{key.replace('_', '-')}", str(value)]
    with tempfile.TemporaryFile() as out:
        m = run_measured(cmd, ROOT, env={**os.environ, **(env or {})}, cgroup=cgroup, check=check, stdout=out)
        out.seek(0)
        text = out.read().decode()
    result = json.loads(text.strip().splitlines()[-1]) if m.returncode == 0 else None
    return result, m


def ratio(a: float, b: float) -> str:
    return f"{a / b:.3f}x"


def section_layer(args) -> dict:
    result, m = run_child("layer", batch=args.batch, seq=args.seq, reps=args.reps, threads=args.threads,
                          timed=args.timed)
    saved, wall, cpu = result["saved"], result["wall"], result["cpu"]
    print(f"\n## BERT-base layer, B={args.batch} S={args.seq} float32, dropout 0.1, CPU "
          f"({result['threads']} threads; child peak tree RSS {m.peak_tree_rss / MiB:.0f} MiB)\n")
    print("bytes kept for backward (MiB); ratios against stock with boolean masks (as on GPU) and stock on CPU")
    print(f"{'variant':<18}{'isolated':>10}{'x bool':>9}{'x cpu':>8}{'in stack':>11}{'x bool':>9}{'x cpu':>8}")
    for v in VARIANTS:
        s = saved[v]
        print(f"{v:<18}{s['isolated'] / MiB:>10.2f}{ratio(s['isolated'], saved['stock-bool']['isolated']):>9}"
              f"{ratio(s['isolated'], saved['stock']['isolated']):>8}{s['stack'] / MiB:>11.2f}"
              f"{ratio(s['stack'], saved['stock-bool']['stack']):>9}{ratio(s['stack'], saved['stock']['stack']):>8}")
    _print_where_bytes_go(result)
    wall_best, cpu_best = result["wall_best"], result["cpu_best"]
    print(f"\nforward + backward, {args.reps} interleaved steps per variant: best (min) and median; wall and "
          f"process CPU time")
    print("(paired: median over reps of the ratio to the stock step run next to it, which saw the same load)")
    print(f"{'variant':<18}{'wall best':>10}{'x stock':>9}{'median':>8}{'x stock':>9}{'paired':>8}"
          f"{'cpu best':>10}{'x stock':>9}{'median':>8}{'x stock':>9}{'paired':>8}  forward and RNG vs stock")
    for v in wall:
        print(f"{v:<18}{wall_best[v] * 1e3:>8.0f}ms{ratio(wall_best[v], wall_best['stock']):>9}"
              f"{wall[v] * 1e3:>6.0f}ms{ratio(wall[v], wall['stock']):>9}{result['wall_paired'][v]:>7.3f}x"
              f"{cpu_best[v] * 1e3:>8.0f}ms{ratio(cpu_best[v], cpu_best['stock']):>9}"
              f"{cpu[v] * 1e3:>6.0f}ms{ratio(cpu[v], cpu['stock']):>9}{result['cpu_paired'][v]:>7.3f}x"
              f"  {'bit-identical' if result['identical'][v] else 'DIFFERENT'}")
    return {"saved_stack_ratio": saved["tempo"]["stack"] / saved["stock-bool"]["stack"],
            "saved_isolated_ratio": saved["tempo"]["isolated"] / saved["stock-bool"]["isolated"],
            "wall_ratio": wall_best["tempo"] / wall_best["stock"], "cpu_ratio": cpu_best["tempo"] / cpu_best["stock"],
            "wall_paired": result["wall_paired"]["tempo"], "cpu_paired": result["cpu_paired"]["tempo"],
            "forward_differs": float(not all(result["identical"].values()))}


def _print_where_bytes_go(result: dict) -> None:
    """Per module, the isolated layer: stock with boolean masks and tempo; tempo's storages; and how tempo's
    total splits into full-size float tensors, GELU's branch bits (which nothing can rebuild) and the rest."""
    stock, ours = result["modules"]["stock-bool"], result["modules"]["tempo"]
    stock_total = result["saved"]["stock-bool"]["isolated"]
    print("\nwhere the bytes go, isolated layer (MiB; tempo.measure: each storage once, charged to the innermost "
          "module that kept it first)")
    print(f"{'module':<36}{'stock-bool':>11}{'tempo':>9}   tempo keeps")
    for path in dict.fromkeys([*stock, *ours]):
        kept = [f"{dtype} {'x'.join(map(str, shape))}" for where, dtype, shape, _ in result["storages"] if where == path]
        print(f"{path:<36}{stock.get(path, 0) / MiB:>11.3f}{ours.get(path, 0) / MiB:>9.3f}   {', '.join(kept)}")
    # float tensors of T*H elements or more: the activations tempo keeps in full (the layer input, Q, K, V,
    # softmax's output P, the LayerNorms' and GELU's outputs); everything else is bits, stash, rstd
    full = 4 * result["tokens_hidden"]
    floats = sum(b for _, dtype, _, b in result["storages"] if dtype == "float32" and b >= full)
    gelu_bits = sum(b for where, dtype, _, b in result["storages"] if dtype == "uint8" and where.endswith("act_fn"))
    other = sum(b for *_, b in result["storages"]) - floats - gelu_bits
    print(f"tempo: full-size float tensors {floats / MiB:.3f} MiB ({ratio(floats, stock_total)} stock-bool), "
          f"+ GELU branch bits {gelu_bits / MiB:.3f} ({ratio(floats + gelu_bits, stock_total)}), "
          f"+ dropout bits, GELU stash, rstd {other / MiB:.3f} ({ratio(floats + gelu_bits + other, stock_total)})")


def section_grads(args) -> dict:
    result, _ = run_child("grads", batch=args.batch, seq=args.seq)
    rows = result["rows"]
    print(f"\n## gradient error against float64 stock (BERT-base layer, B={args.batch} S={args.seq})\n")
    print(f"{'parameter':<36}{'|grad|':>10}{'stock f32':>11}{'tempo f32':>11}{'ratio':>8}")
    worst = 0.0
    top = max(r["ref_norm"] for r in rows)
    for r in rows:
        degenerate = r["ref_norm"] < 1e-9 * top
        mark = "  (zero in exact arithmetic: noise)" if degenerate else ""
        print(f"{r['name']:<36}{r['ref_norm']:>10.2e}{r['stock']:>11.2e}{r['tempo']:>11.2e}{r['tempo'] / r['stock']:>8.2f}{mark}")
        if not degenerate:
            worst = max(worst, r["tempo"] / r["stock"])
    print(f"largest ratio (tempo error / stock error): {worst:.2f}")
    return {"grad_ratio": worst}


def section_train(args) -> dict:
    result, m = run_child("train", steps=args.steps, lr=args.lr, control=int(not args.quick))
    stock, ours, control = result["stock"], result["tempo"], result.get("control")
    rel = [abs(a - b) / abs(a) for a, b in zip(stock, ours)]
    worst = max(range(len(rel)), key=rel.__getitem__)

    def mean(xs):
        return sum(xs) / len(xs)

    print(f"\n## training equivalence: {args.steps} AdamW steps (lr {args.lr:g}), small BERT (H=128, 2 layers), same seed\n")
    print(f"mean loss of the first / last 20 steps: stock {mean(stock[:20]):.4f} / {mean(stock[-20:]):.4f}, "
          f"tempo {mean(ours[:20]):.4f} / {mean(ours[-20:]):.4f}")
    print(f"largest relative difference of the loss, tempo vs stock: {rel[worst]:.2e} at step {worst} "
          f"(child {m.seconds:.0f} s)")
    if control:
        rel_control = [abs(a - b) / abs(a) for a, b in zip(stock, control)]
        print(f"control, stock on 1 thread vs stock on {result.get('threads', 'all')} (rounding alone): "
              f"{max(rel_control):.2e}")
    for step in range(0, args.steps, max(1, args.steps // 6)):
        print(f"  step {step:>4}: stock {stock[step]:.6f}  tempo {ours[step]:.6f}  rel {rel[step]:.1e}")
    return {"train_rel": rel[worst]}


# glibc's malloc raises its mmap threshold to the size of the largest block freed so far (up to 32 MiB), so
# after the first step activations come from the heap, whose holes it rarely returns: RSS then tracks the
# heap's high-water mark more than what is alive. A fixed threshold keeps every block >= 64 KiB mmapped and
# returned on free. Both are measured; the second is what is alive.
MALLOC_SETTINGS = (("default", "glibc malloc, default", {}),
                   ("mmap", "MALLOC_MMAP_THRESHOLD_=65536", {"MALLOC_MMAP_THRESHOLD_": "65536"}))


def _fits(variant: str, batch: int, args, cgroup, env: dict) -> bool:
    _, m = run_child("step", cgroup=cgroup, check=False, env=env, variant=variant, batch=batch, seq=args.seq,
                     threads=args.threads)
    print(f"    {variant:<5} B={batch:<3} in the cgroup: {'fits' if m.returncode == 0 else 'does not fit'}", flush=True)
    return m.returncode == 0


def _largest_batch(variant: str, args, cgroup, env: dict, guess: int) -> int:
    """The largest batch whose two steps run in the cgroup: gallop from `guess` (predicted from the peak
    RSS at two batches, so usually 1-3 runs away) to a bracket, then bisect."""
    guess = min(max(guess, 1), 512)
    if _fits(variant, guess, args, cgroup, env):
        lo, step = guess, 1
        while lo + step <= 512 and _fits(variant, lo + step, args, cgroup, env):
            lo, step = lo + step, step * 2
        hi = lo + step
    else:
        hi, step = guess, 1
        while hi - step > 0 and not _fits(variant, hi - step, args, cgroup, env):
            hi, step = hi - step, step * 2
        lo = max(hi - step, 0)
    while hi - lo > 1:  # lo fits (or is 0), hi does not
        mid = (lo + hi) // 2
        if _fits(variant, mid, args, cgroup, env):
            lo = mid
        else:
            hi = mid
    return lo


def section_model(args) -> dict:
    from harness import MemCgroup

    result, _ = run_child("model-saved", batch=args.batch, seq=args.seq, threads=args.threads)
    saved = result["saved"]
    print(f"\n## whole BERT-base from BertConfig() (BertForSequenceClassification), B={args.batch} S={args.seq}\n")
    print(f"bytes kept for backward: stock {saved['stock'] / MiB:.1f} MiB, stock with boolean masks "
          f"{saved['stock-bool'] / MiB:.1f} MiB, tempo {saved['tempo'] / MiB:.1f} MiB: "
          f"{ratio(saved['tempo'], saved['stock-bool'])} (boolean masks), {ratio(saved['tempo'], saved['stock'])} (CPU stock)")
    out = {"model_ratio": saved["tempo"] / saved["stock-bool"]}
    budget = int(args.budget_gib * (1 << 30))
    why_not = "--quick" if args.quick else MemCgroup.available()
    for key, label, env in MALLOC_SETTINGS:
        if key not in args.malloc.split(","):
            continue
        print(f"\n{label}: two AdamW steps (peak RSS: the kernel's ru_maxrss; tree: the harness's sampling)")
        peaks = {}
        predicted = {}
        for variant in ("stock", "tempo"):
            for batch in (args.batch, 2 * args.batch):
                step, m = run_child("step", env=env, variant=variant, batch=batch, seq=args.seq, threads=args.threads)
                peaks[(variant, batch)] = step["max_rss"]
                print(f"  {variant:<5} B={batch:<3}: peak RSS {step['max_rss'] / MiB:>6.0f} MiB (tree "
                      f"{m.peak_tree_rss / MiB:.0f}), second step {step['step_seconds'][1]:.1f} s")
        for variant in ("stock", "tempo"):
            a, b = peaks[(variant, args.batch)], peaks[(variant, 2 * args.batch)]
            per_sample = (b - a) / args.batch
            predicted[variant] = int(args.batch + (budget - a) / per_sample)
            print(f"  {variant:<5}: {per_sample / MiB:.1f} MiB more peak RSS per sample; largest batch in "
                  f"{args.budget_gib:g} GiB predicted from it: {predicted[variant]}")
        if why_not:
            print(f"  budget search skipped: {why_not}")
            continue
        with MemCgroup(budget, name="tempo") as cgroup:
            fits = {variant: _largest_batch(variant, args, cgroup, env, predicted[variant]) for variant in ("stock", "tempo")}
        print(f"  largest batch whose two training steps run in a {args.budget_gib:g} GiB memory cgroup: "
              f"stock {fits['stock']}, tempo {fits['tempo']} ({fits['tempo'] / max(fits['stock'], 1):.2f}x)")
        out[f"fits_{key}"] = fits
    return out


def _spread(values: list[float], scale: float, unit: str) -> str:
    return (f"{statistics.median(values) / scale:.0f} {unit} "
            f"({min(values) / scale:.0f}-{max(values) / scale:.0f})")


def _sdpa_steps(args, label: str, env: dict, batch: int, out: dict, key: str) -> None:
    print(f"\n{label}: training step of BertForSequenceClassification (those 2 layers), B={batch} S={args.seq}, "
          f"AdamW; {args.rounds} rounds, each a child per variant, the order alternating; {args.sdpa_steps} "
          f"measured steps per child (medians); the machine is shared: load average {os.getloadavg()[0]:.1f} now")
    rows = {"stock": [], "tempo": []}
    for rnd in range(args.rounds):
        for variant in ("stock", "tempo") if rnd % 2 == 0 else ("tempo", "stock"):
            step, _ = run_child("sdpa-step", env=env, variant=variant, batch=batch, seq=args.seq,
                                threads=args.threads, sdpa_steps=args.sdpa_steps)
            rows[variant].append(step)
    columns = (("peak", "peak RSS", MiB, "MiB"), ("forward", "forward: peak above start", MiB, "MiB"),
               ("above", "step: peak above start", MiB, "MiB"), ("wall", "step wall", 1e-3, "ms"),
               ("cpu", "step CPU", 1e-3, "ms"))
    print("  " + " " * 7 + "".join(f"{title:>28}" for _, title, _, _ in columns))
    for variant, runs in rows.items():
        print(f"  {variant:<7}" + "".join(f"{_spread([r[k] for r in runs], scale, unit):>28}"
                                         for k, _, scale, unit in columns))
    paired = {k: statistics.median(t[k] / s[k] for s, t in zip(rows["stock"], rows["tempo"])) for k, *_ in columns}
    print("  tempo / stock, median of per-round ratios: " + ", ".join(f"{title} {paired[k]:.3f}x"
                                                                      for k, title, _, _ in columns)
          + f" (load average {os.getloadavg()[0]:.1f} at the end)")
    out[f"sdpa_cpu_paired_{key}_{batch}"] = paired["cpu"]


def section_sdpa(args) -> dict:
    result, _ = run_child("sdpa-saved", batch=args.batch, seq=args.seq, threads=args.threads)
    saved, attention = result["saved"], result["attention"]
    print(f"\n## BertModel from BertConfig(num_hidden_layers=2): BERT-base sizes, 2 layers, B={args.batch} "
          f"S={args.seq}, dropout 0.1, CPU float32\n")
    print("bytes kept for backward (tempo.measure), whole model, and one layer's attention.self")
    print(f"{'attention':<10}{'stock':>12}{'tempo':>12}{'x stock':>9}{'attention.self stock / tempo':>34}")
    for implementation in ("sdpa", "eager"):
        stock, ours = saved[f"stock-{implementation}"], saved[f"tempo-{implementation}"]
        print(f"{implementation:<10}{stock / MiB:>8.2f} MiB{ours / MiB:>8.2f} MiB{ratio(ours, stock):>9}"
              f"{attention[f'stock-{implementation}'] / MiB:>20.2f} / {attention[f'tempo-{implementation}'] / MiB:.2f} MiB")
    print("tempo.patch on the sdpa model, attention modules:")
    for line in result["report"]:
        print(f"  {line}")
    out = {"sdpa_vs_eager": saved["tempo-sdpa"] / saved["tempo-eager"]}
    for key, label, env in MALLOC_SETTINGS:
        if key not in args.malloc.split(","):
            continue
        for batch in map(int, args.sdpa_batches.split(",")):
            _sdpa_steps(args, label, env, batch, out, key)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--only", default="layer,grads,train,model,sdpa", help="sections, comma-separated")
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--seq", type=int, default=128)
    ap.add_argument("--reps", type=int, default=10, help="timed steps per variant")
    ap.add_argument("--steps", type=int, default=300, help="training-equivalence steps")
    ap.add_argument("--lr", type=float, default=3e-4, help="training-equivalence learning rate")
    ap.add_argument("--budget-gib", type=float, default=5.0, help="memory budget of the batch search (model)")
    ap.add_argument("--malloc", default="default,mmap",
                    help="model section: glibc settings to run, comma-separated (default: as it comes; mmap: "
                         "MALLOC_MMAP_THRESHOLD_=65536)")
    ap.add_argument("--rounds", type=int, default=6, help="sdpa section: A/B rounds of training-step children")
    ap.add_argument("--sdpa-steps", type=int, default=2, help="sdpa section: measured steps per child")
    ap.add_argument("--sdpa-batches", default="8,32", help="sdpa section: batch sizes of the training steps")
    ap.add_argument("--quick", action="store_true", help="--reps 3, no budget search")
    ap.add_argument("--child", choices=sorted(CHILDREN), help=argparse.SUPPRESS)
    ap.add_argument("--variant", default="stock", help=argparse.SUPPRESS)
    ap.add_argument("--control", type=int, default=0, help=argparse.SUPPRESS)
    ap.add_argument("--threads", type=int, default=0, help="torch threads in the children (0: torch's default)")
    ap.add_argument("--timed", default=",".join(v for v in VARIANTS if v.startswith("tempo")),
                    help="layer section: variants timed beside stock, comma-separated (fewer: more reps in the time)")
    args = ap.parse_args()
    if args.child:
        import warnings

        import torch

        warnings.filterwarnings("ignore")
        if args.threads:
            torch.set_num_threads(args.threads)
        print(json.dumps(CHILDREN[args.child](args)))
        return
    if args.quick:
        args.reps = min(args.reps, 3)
    sys.path.insert(1, str(HERE))  # the shared harness
    sections = {"layer": section_layer, "grads": section_grads, "train": section_train, "model": section_model,
                "sdpa": section_sdpa}
    print(f"# tempo benchmark  (load average {os.getloadavg()[0]:.1f} at start, {os.cpu_count()} CPUs)")
    results = {}
    for name in args.only.split(","):
        results.update(sections[name](args))
    print(f"\n## targets  (load average {os.getloadavg()[0]:.1f} at end)\n")
    checks = [
        ("saved_stack_ratio", "bytes kept per layer (in a stack) vs stock with boolean masks", 0.62),
        ("saved_isolated_ratio", "bytes kept, isolated layer, vs stock with boolean masks", 0.62),
        ("model_ratio", "bytes kept, whole BERT-base, vs stock with boolean masks", 0.62),
        ("sdpa_vs_eager", "bytes kept by tempo, sdpa model vs the same model with eager attention", 1.0),
        ("wall_ratio", "forward + backward wall time vs stock (best of --reps)", 1.25),
        ("cpu_ratio", "forward + backward CPU time vs stock (best of --reps)", 1.25),
        ("wall_paired", "forward + backward wall time vs stock (median of paired ratios)", 1.25),
        ("cpu_paired", "forward + backward CPU time vs stock (median of paired ratios)", 1.25),
        ("forward_differs", "forward output or RNG state differs from stock (any variant)", 0.0),
        ("grad_ratio", "gradient error vs stock's, worst parameter", 3.0),
        ("train_rel", "training loss, largest relative difference", 1e-4),
    ]
    for key, label, target in checks:
        if key in results:
            verdict = "meets" if results[key] <= target else "MISSES"
            print(f"{label:<66} {results[key]:.3g}  (target <= {target:g}: {verdict})")


if __name__ == "__main__":
    main()
