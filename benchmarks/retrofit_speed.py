"""A retrofit's training step (docs/retrofit.md) against its frozen base's forward + backward, side by side: what
the memory itself costs on a pretrained model.

    python benchmarks/retrofit_speed.py [--config configs/retrofit.yaml] [--override KEY=VALUE ...] [--out FILE]

The model is the config's (model.base, model.memory; train.device, train.precision, train.compile,
train.num_threads as train.py takes them), on one batch of data.batch_size × data.bptt random token ids over the
base's embedding (seeded by train.seed), the same for every entry. Four entries, each run --warmup times, then
measured in --rounds interleaved rounds of at least --min-time seconds each (so that other jobs on a shared machine
slow every entry alike); ms per step and tokens/s are the median over the rounds:
  - base_forward: the base's forward to the loss under no_grad, in eval mode (as evaluation runs it);
  - retrofit_forward: the same with the memories;
  - base_forward_backward, the peer: the base is frozen, so its backward is the one a memory needs and no more.
    A memory at layer l trains on dL/d(out_l), the loss's gradient at that layer's output: the backward of the
    loss over the whole vocabulary, of the output layer and of every decoder layer above l, and of nothing below
    (no weight there trains, and the memory's input needs no gradient). The peer computes exactly that: the same
    RetrofitLM with each memory replaced by the constant 1 (NoMemory), so that layer l adds its gate,
    out = h + mlp(u) + gate, a zero (dim,) tensor whose gradient, dL/dout summed over the tokens, crosses those
    layers; forward + backward, the gradient then dropped (no optimizer: nothing of the base's trains);
  - retrofit_train_step: train.py's step for one micro-batch (xlm_pkm/train/step.py): forward, loss, backward, the
    memories' aux loss if any, clipping, the finite check, the optimizer step of what optim.trainable trains (the
    memories and their gates), gradients dropped.
memory_share = 1 - tokens/s of the retrofit / tokens/s of the base, for training (against the peer) and inference:
the memory's own cost (its forward and backward, its gate, its optimizer step) as a share of the retrofit's step;
by_round pairs the entries of each round. Not timed here (one line refuses them): LoRA (its adapters need a
backward through every layer, another peer), optim.accumulate > 1 and sparse memory finetuning. The JSON
(default dumped/bench/retrofit_speed_<cpu|cuda>.json) records the settings, the parameter counts and the machine
(CPU model, threads, load, torch and transformers versions).
"""

from __future__ import annotations

import argparse
import itertools
import statistics
import sys
from pathlib import Path

import torch
import transformers
from torch import nn

sys.path[:0] = [str(Path(__file__).resolve().parents[1]), str(Path(__file__).resolve().parent)]
from machine import REPO, machine_info, write_result  # noqa: E402
from timing import interleaved_rounds  # noqa: E402

from xlm_pkm.config import Config, load_config  # noqa: E402
from xlm_pkm.errors import USER_ERRORS, ConfigError, fail  # noqa: E402
from xlm_pkm.finetune.trainable import freeze  # noqa: E402
from xlm_pkm.model.retrofit import RetrofitLM  # noqa: E402
from xlm_pkm.runtime.precision import autocast, check_precision, grad_scaler, resolve_device  # noqa: E402
from xlm_pkm.train.build import build_model, build_optimizers, resolved_config  # noqa: E402
from xlm_pkm.train.step import loss_backward, optimizer_update  # noqa: E402

PROG = "benchmarks/retrofit_speed.py"
ENTRIES = {"base_forward": "base forward (inference)", "retrofit_forward": "retrofit forward (inference)",
           "base_forward_backward": "base forward + backward to the memory's layer (the peer)",
           "retrofit_train_step": "retrofit training step"}
SHARES = {"training": ("retrofit_train_step", "base_forward_backward"),
          "inference": ("retrofit_forward", "base_forward")}


class NoMemory(nn.Module):
    """The peer's stand-in for a memory: 1 whatever its input, so that gate ⊙ memory(u) is the gate itself."""

    def forward(self, u: torch.Tensor) -> torch.Tensor:
        return u.new_ones(())  # (), broadcast to the gate's (dim,)


def measured_config(config: str | Path, overrides: list[str]) -> Config:
    """The config resolved as a run resolves it (the base's sizes and digest), or a one-line ConfigError for what
    this benchmark does not time."""
    cfg = load_config(config, overrides)
    if not cfg.model.base.path:
        raise ConfigError("model.base.path: this benchmark times a retrofit: give the base's folder")
    untimed = {"optim.lora.rank": cfg.optim.lora.rank, "optim.accumulate": cfg.optim.accumulate != 1,
               "optim.memory_finetune.top_t": cfg.optim.memory_finetune.top_t}
    for key, given in untimed.items():
        if given:
            raise ConfigError(f"{key}: not timed by this benchmark (its peer is the frozen base, one micro-batch a "
                              f"step): leave it at its default")
    return resolved_config(cfg, 0, "bench")  # 0: no data's vocabulary to check, the ids are random


def build_peer(cfg: Config, device: torch.device) -> RetrofitLM:
    """The retrofit of `cfg` with each memory replaced by NoMemory: its gates, at the memories' layers, are all
    that trains."""
    peer = build_model(cfg, device)
    for beside in peer.beside.values():
        beside.memory = NoMemory()
    return peer


def random_batch(cfg: Config, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """(x, y), (data.batch_size, data.bptt) each: random ids over the base's embedding, y the next ids."""
    generator = torch.Generator(device).manual_seed(cfg.train.seed)
    tokens = torch.randint(0, cfg.model.vocab_size, (cfg.data.batch_size, cfg.data.bptt + 1), device=device,
                           generator=generator)  # (B, T + 1)
    return tokens[:, :-1], tokens[:, 1:]


def forward_step(model: nn.Module, forward, x, y, precision: str, device: torch.device):
    @torch.no_grad()
    def step():
        model.eval()
        with autocast(precision, device):
            forward(x, targets=y)
    return step


def peer_step(peer: RetrofitLM, forward, x, y, precision: str, device: torch.device):
    scaler = grad_scaler(precision, device)
    gates = [beside.gate for beside in peer.beside.values()]

    def step():
        peer.train()
        loss_backward(forward, x, y, precision, device, scaler)
        for gate in gates:
            gate.grad = None
    return step


def train_step(model: RetrofitLM, forward, cfg: Config, x, y, device: torch.device):
    optimizers = build_optimizers(model, cfg)
    scaler = grad_scaler(cfg.train.precision, device)
    aux = model.aux_loss if model.has_aux_loss() else None
    steps = itertools.count(1)

    def step():
        model.train()
        optimizers.set_step(next(steps))
        loss = loss_backward(forward, x, y, cfg.train.precision, device, scaler, aux_loss=aux)
        optimizer_update(optimizers, scaler, loss)
    return step


def measure(cfg: Config, device: torch.device, min_time: float, rounds: int, warmup: int) -> dict:
    """{"rows": one per entry of ENTRIES, "memory_share": {...}, "params": the retrofit's counts}."""
    precision = cfg.train.precision
    model, peer = build_model(cfg, device), build_peer(cfg, device)
    freeze(model, cfg.optim.trainable, cfg.optim.freeze_norm_stats)
    model_forward, peer_forward = (torch.compile(m) if cfg.train.compile else m for m in (model, peer))
    x, y = random_batch(cfg, device)
    steps = {"base_forward": forward_step(peer, peer_forward, x, y, precision, device),
             "retrofit_forward": forward_step(model, model_forward, x, y, precision, device),
             "base_forward_backward": peer_step(peer, peer_forward, x, y, precision, device),
             "retrofit_train_step": train_step(model, model_forward, cfg, x, y, device)}
    n_tokens = x.numel()
    speeds = interleaved_rounds(steps, n_tokens, device, min_time, rounds, warmup)
    median = {name: statistics.median(s) for name, s in speeds.items()}
    rows = [{"entry": name, "what": ENTRIES[name], "ms_per_step": round(1e3 * n_tokens / median[name], 3),
             "tokens_per_s": round(median[name], 1), "rounds_tokens_per_s": [round(s, 1) for s in speeds[name]]}
            for name in steps]
    share = {kind: {"share": round(1 - median[ours] / median[base], 4),
                    "by_round": [round(1 - a / b, 4) for a, b in zip(speeds[ours], speeds[base])]}
             for kind, (ours, base) in SHARES.items()}
    return {"rows": rows, "memory_share": share, "params": model.param_counts()}


def table(rows: list[dict], share: dict) -> str:
    width = max(len(r["what"]) for r in rows)
    lines = [f"{'entry':{width}s}  {'ms/step':>10s}  {'tokens/s':>10s}"]
    lines += [f"{r['what']:{width}s}  {r['ms_per_step']:10.2f}  {r['tokens_per_s']:10.1f}" for r in rows]
    lines.append("memory's share: " + ", ".join(f"{kind} {s['share']:.1%}" for kind, s in share.items()))
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--config", default=str(REPO / "configs" / "retrofit.yaml"))
    parser.add_argument("--override", nargs="*", default=[], metavar="KEY=VALUE",
                        help="config overrides, as train.py takes them (train.device=cuda, model.memory.n_keys=256)")
    parser.add_argument("--min-time", type=float, default=2.0, help="seconds measured per entry and round")
    parser.add_argument("--rounds", type=int, default=5, help="interleaved measurements per entry; median kept")
    parser.add_argument("--warmup", type=int, default=2, help="steps of each entry before measuring (Adam's state)")
    parser.add_argument("--note", default="", help="free text stored in the settings, e.g. the machine's load")
    parser.add_argument("--out", help="default: dumped/bench/retrofit_speed_<cpu|cuda>.json")
    args = parser.parse_args(argv)
    try:
        cfg = measured_config(args.config, args.override)
        device = resolve_device(cfg.train.device)
        check_precision(cfg.train.precision, device)
    except USER_ERRORS as e:
        return fail(PROG, e)
    if cfg.train.num_threads:
        torch.set_num_threads(cfg.train.num_threads)
    args.device = device.type  # write_result's file name
    measured = measure(cfg, device, args.min_time, args.rounds, args.warmup)
    base = cfg.model.base
    write_result({
        "benchmark": "retrofit_speed",
        "settings": {"config": args.config, "overrides": args.override, "base": base.path,
                     "gguf_file": base.gguf_file, "base_digest": base.digest, "layers": base.layers,
                     "memory": {k: getattr(cfg.model.memory, k) for k in ("n_keys", "k_dim", "heads", "knn")},
                     "trainable": cfg.optim.trainable, "values_optimizer": cfg.optim.values_optimizer,
                     "batch": cfg.data.batch_size, "bptt": cfg.data.bptt, "tokens_per_step": cfg.data.batch_size
                     * cfg.data.bptt, "precision": cfg.train.precision, "compile": cfg.train.compile,
                     "min_time_s": args.min_time, "rounds": args.rounds, "warmup_steps": args.warmup,
                     "statistic": "median of interleaved rounds", "params": measured["params"], "note": args.note},
        "machine": machine_info(str(device)) | {"transformers": transformers.__version__},
        "rows": measured["rows"],
        "memory_share": measured["memory_share"],
    }, args, "retrofit_speed")
    print(table(measured["rows"], measured["memory_share"]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
