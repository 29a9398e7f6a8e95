"""The training step of the Table 1 model with one memory, split into phases, with issue 59's settings off (as
before the issue), at this checkout's defaults and on, side by side in one process: where the memory's cost is,
and how much of it each setting removes.

    python3 benchmarks/step_breakdown.py [--device cuda] [--precision bf16] [--compile] [--variants off on]

The model is configs/paper/l12_d1024_m1.yaml (12 layers, d=1,024, one 512² memory at layer 9, clipping at 5 per
group), with sparse value gradients and lazy_adam unless --values dense. Each variant of VARIANTS is a list of
config overrides; each is built from the same seed, on the same tokens, and measured in turn:
  - tokens_per_s: the whole step (as training_speed.py: forward under autocast, loss, backward, norms and
    clipping, the finite check, every optimizer group's step, gradients dropped) run back to back for
    --min-time seconds, best of --rounds;
  - phases_ms (medians over --steps steps): memory_forward and memory_backward between two probes, identity
    autograd functions placed on the memory's input and output whose forward and backward mark the time (CUDA
    events; wall clock on the CPU); norms_and_clip (Optimizers.unscale_and_clip); one entry per optimizer group's
    step; rest (the step's time less those). A probe is torch.compiler.disable'd, so a compiled model breaks its
    graph at the memory's input and output in this probed run: probed_step_ms is its step time, beside
    step_ms, the unprobed step's, from tokens_per_s;
  - host_syncs: synchronising CUDA calls in one unprobed step, counted with torch.cuda.set_sync_debug_mode
    ("warn"; CUDA only), and graph_breaks: torch._dynamo's graph-break count while compiling (--compile).
The memoryless model (configs/paper/l12_d1024_m0.yaml) runs once, first: memory_step_share = 1 − tokens_per_s of
the variant / tokens_per_s without a memory (issue 59's target: <= 0.15), with MFU (dense FLOPs, the GPU's peak).
"""

from __future__ import annotations

import statistics
import sys
import time
import traceback
import warnings
from pathlib import Path

import torch

sys.path[:0] = [str(Path(__file__).resolve().parents[1]), str(Path(__file__).resolve().parent)]
from machine import machine_info, write_result  # noqa: E402
from model_setup import REPO, benchmark_parser, build_model, common_settings, corpus_and_vocab, free, random_tokens  # noqa: E402
from timing import best_of_rounds  # noqa: E402

from xlm_pkm.runtime.hardware import peak_flops  # noqa: E402
from xlm_pkm.runtime.precision import check_precision, grad_scaler  # noqa: E402
from xlm_pkm.train.build import build_optimizers  # noqa: E402
from xlm_pkm.train.step import loss_backward, optimizer_update  # noqa: E402

CONFIGS = {memories: str(REPO / "configs" / "paper" / f"l12_d1024_m{memories}.yaml") for memories in (0, 1)}
# issue 59's settings: name -> (key, its value before issue 59, its value "on"). Some are defaults now (read_op,
# read_backward=auto, half_topk=auto: docs/benchmarks.md), so "off" sets every one to its earlier value, "default"
# is this checkout's defaults, and each name alone is "off" with that one setting on
SETTINGS = {
    "fused_values": ("optim.fused_values", "false", "true"),  # the value rows' Adam in one pass, clip folded, no sync
    "fused_dense": ("optim.fused_dense", "false", "true"),  # torch's fused AdamW for the dense parameters
    "one_pass": ("model.memory.read_backward", "two_pass", "one_pass"),  # the read's backward reads each row once
    "custom_op": ("model.memory.read_op", "eager", "custom_op"),  # the read one node of the compiled graph
    "winnable": ("model.memory.pair_candidates", "all", "winnable"),  # only the pairs that can reach the top k
    "tf32": ("model.memory.score_precision", "float32", "tf32"),  # the search's score products in TF32
    "half_topk": ("model.memory.half_topk", "torch", "triton"),  # each half's knn best by a selection kernel
    "bf16_values": ("model.memory.inference_values", "table", "bfloat16"),  # evaluation's reads (not the step's)
}


def variant(on: set[str]) -> list[str]:
    """The overrides of every setting of SETTINGS, those named in `on` on, the others as before issue 59."""
    return [f"{key}={after if name in on else before}" for name, (key, before, after) in SETTINGS.items()]


VARIANTS = {"off": variant(set()), "default": [], "on": variant(set(SETTINGS)),
            **{name: variant({name}) for name in SETTINGS}}


class Marks:
    """Named time points of one step: CUDA events on a GPU (read after the step), wall clock on the CPU."""

    def __init__(self, device: torch.device):
        self.cuda = device.type == "cuda"
        self.points: dict[str, object] = {}

    def mark(self, name: str) -> None:
        if self.cuda:
            self.points[name] = torch.cuda.Event(enable_timing=True)
            self.points[name].record()
        else:
            self.points[name] = time.perf_counter()

    def ms(self, start: str, end: str) -> float:
        if self.cuda:
            return self.points[start].elapsed_time(self.points[end])
        return 1e3 * (self.points[end] - self.points[start])


class _Probe(torch.autograd.Function):
    """Identity; marks `forward_mark` when it runs forward and `backward_mark` when its gradient passes."""

    @staticmethod
    def forward(ctx, x, marks: Marks, forward_mark: str, backward_mark: str):
        marks.mark(forward_mark)
        ctx.marks, ctx.backward_mark = marks, backward_mark
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        ctx.marks.mark(ctx.backward_mark)
        return grad, None, None, None


@torch.compiler.disable  # events are recorded eagerly: a compiled model breaks its graph here
def probe(x: torch.Tensor, marks: Marks, forward_mark: str, backward_mark: str) -> torch.Tensor:
    return _Probe.apply(x, marks, forward_mark, backward_mark)


def add_probes(model, marks: Marks) -> None:
    """Probes on the (one) memory's input (forward start, backward end) and output (forward end, backward start)."""
    ((_, memory),) = model.memories()
    memory.register_forward_pre_hook(lambda m, args: (probe(args[0], marks, "memory_forward_start",
                                                            "memory_backward_end"), *args[1:]))
    memory.register_forward_hook(lambda m, args, out: probe(out, marks, "memory_forward_end",
                                                            "memory_backward_start"))


def mark_optimizers(optimizers, marks: Marks) -> None:
    """Marks around unscale_and_clip and around each group's optimizer step (instance attributes: the class is
    untouched)."""
    clip = optimizers.unscale_and_clip

    def marked_clip(scaler):
        marks.mark("clip_start")
        norms = clip(scaler)
        marks.mark("clip_end")
        return norms
    optimizers.unscale_and_clip = marked_clip
    for g in optimizers.groups:
        def marked_step(*args, _step=g.optimizer.step, _name=g.name, **kwargs):
            marks.mark(f"{_name}_start")
            out = _step(*args, **kwargs)
            marks.mark(f"{_name}_end")
            return out
        g.optimizer.step = marked_step


def make_step(model, cfg, tokens, args, device):
    optimizers = build_optimizers(model, cfg)
    scaler = grad_scaler(args.precision, device)
    forward = torch.compile(model) if args.compile else model
    x, y = tokens[:, :-1], tokens[:, 1:]  # (B, T) each
    counter = iter(range(1, 10**9))

    def step():
        optimizers.set_step(next(counter))
        optimizer_update(optimizers, scaler, loss_backward(forward, x, y, args.precision, device, scaler))
    return step, optimizers


def count_syncs(step, device: torch.device) -> int | None:
    """Synchronising CUDA calls in one step (None on the CPU)."""
    if device.type != "cuda":
        return None
    torch.cuda.synchronize()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            step()
        finally:
            torch.cuda.set_sync_debug_mode("default")
    return sum("synchroniz" in str(w.message) for w in caught)


def measure(name: str, config: str, overrides: list[str], args, vocab: int, device: torch.device) -> dict:
    values = [f"optim.values_optimizer={'lazy_adam' if args.values == 'sparse' else 'adam'}"]
    torch.manual_seed(0)
    model, cfg = build_model(config, values + overrides, args, vocab)
    model.train()
    tokens = random_tokens(args, vocab)  # (B, T + 1)
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    step, _ = make_step(model, cfg, tokens, args, device)
    n_tokens = args.batch * args.seq
    tps = best_of_rounds({"step": step}, n_tokens, device, args.min_time, args.rounds, warmup=args.warmup)["step"]
    row = {"variant": name, "overrides": overrides, "memories": len(model.memories()), "tokens_per_s": round(tps),
           "step_ms": round(1e3 * n_tokens / tps, 3),
           "graph_breaks": sum(torch._dynamo.utils.counters["graph_break"].values()) if args.compile else None,
           "host_syncs": count_syncs(step, device)}
    peak = peak_flops(device, args.precision)
    row["mfu"] = round(tps * model.dense_flops_per_token(args.seq) / peak, 4) if peak else None
    cuda = device.type == "cuda"
    row["peak_memory_gib"] = round(torch.cuda.max_memory_allocated(device) / 2**30, 3) if cuda else None
    del step, model
    free(args.device)
    if row["memories"] and name in args.probe:  # the probed run: a second model of the same seed, its own compile
        row.update(phases(config, values + overrides, args, vocab, device, tokens))
    print(" ".join(f"{k}={v}" for k, v in row.items() if k != "overrides"), flush=True)
    return row


def phases(config: str, overrides: list[str], args, vocab: int, device: torch.device, tokens) -> dict:
    torch.manual_seed(0)
    model, cfg = build_model(config, overrides, args, vocab)
    model.train()
    marks = Marks(device)
    add_probes(model, marks)
    torch._dynamo.reset()
    step, optimizers = make_step(model, cfg, tokens, args, device)
    mark_optimizers(optimizers, marks)
    groups = [g.name for g in optimizers.groups]
    samples = []
    for i in range(args.warmup + args.steps):
        if device.type == "cuda":
            torch.cuda.synchronize()
        marks.points.clear()
        marks.mark("step_start")
        step()
        marks.mark("step_end")
        if device.type == "cuda":
            torch.cuda.synchronize()
        if i >= args.warmup:
            spans = {"memory_forward": marks.ms("memory_forward_start", "memory_forward_end"),
                     "memory_backward": marks.ms("memory_backward_start", "memory_backward_end"),
                     "norms_and_clip": marks.ms("clip_start", "clip_end"),
                     **{f"optimizer_{g}": marks.ms(f"{g}_start", f"{g}_end") for g in groups if f"{g}_start" in
                        marks.points}}
            total = marks.ms("step_start", "step_end")
            samples.append({**spans, "rest": total - sum(spans.values()), "probed_step": total})
    median = {k: round(statistics.median(s[k] for s in samples), 3) for k in samples[0]}
    del step, optimizers, model
    free(args.device)
    return {"probed_step_ms": median.pop("probed_step"), "phases_ms": median}


def main() -> None:
    parser = benchmark_parser(__doc__)
    parser.add_argument("--precision", choices=["fp32", "bf16", "fp16"],
                        default="bf16" if torch.cuda.is_available() else "fp32")
    parser.add_argument("--values", choices=["sparse", "dense"], default="sparse",
                        help="sparse: lazy_adam on row-sparse value gradients; dense: AdamW on the whole table")
    parser.add_argument("--variants", nargs="+", default=["off", "on"], choices=list(VARIANTS))
    parser.add_argument("--probe", nargs="*", default=["off", "on"], choices=list(VARIANTS),
                        help="the variants whose phases are measured (a second, probed, run each)")
    parser.add_argument("--steps", type=int, default=10, help="probed steps measured for the phases")
    parser.add_argument("--warmup", type=int, default=3, help="steps before measuring (optimizer state, compile)")
    parser.add_argument("--show", choices=list(VARIANTS), help="print this variant's overrides and exit (for scripts)")
    args = parser.parse_args()
    if args.show:
        print(" ".join(VARIANTS[args.show]))
        return
    device = torch.device(args.device)
    check_precision(args.precision, device)
    corpus, vocab = corpus_and_vocab(args)
    rows = [measure("no memory", CONFIGS[0], [], args, vocab, device)]
    for name in args.variants:
        try:
            rows.append(measure(name, CONFIGS[1], VARIANTS[name], args, vocab, device))
            rows[-1]["memory_step_share"] = round(1 - rows[-1]["tokens_per_s"] / rows[0]["tokens_per_s"], 3)
        except Exception as e:  # a setting that fails on this device: said in its row, the others still measured
            traceback.print_exc()
            rows.append({"variant": name, "overrides": VARIANTS[name], "error": f"{type(e).__name__}: {e}"[:1000]})
            free(args.device)
        write_result(result(args, vocab, corpus, rows), args, "step_breakdown")  # each variant: a cut run keeps it


def result(args, vocab: int, corpus: dict, rows: list[dict]) -> dict:
    return {"benchmark": "step_breakdown",
            "settings": {**common_settings(args, vocab), "precision": args.precision, "values": args.values,
                         "configs": CONFIGS, "variants": {v: VARIANTS[v] for v in args.variants},
                         "measured_steps": args.steps, "warmup_steps": args.warmup,
                         "target": "memory_step_share <= 0.15"},
            "machine": machine_info(args.device), "corpus": corpus, "rows": rows}


if __name__ == "__main__":
    main()
