"""The product-key search's top-k step, forward and backward, against its alternatives.

    python3 benchmarks/key_search_speed.py [--device cuda] [--tokens 8192] [--out FILE]

At the training benchmark's shapes (8,192 tokens, 4 heads, 512 sub-keys of 256 per half, knn 32:
q (N, G=8, d), keys (G, S, d)), median times of
  - top_scores: selected_scores.top_scores, the package's (scores without autograd; a backward that reads only
    the knn selected keys, an embedding bag and a slot-sorted sum, or on a GPU the dense one below);
  - dense: autograd through einsum + topk (its backward forms the (N, G, S) gradient and two products);
  - sort: einsum + sort, the first knn (the forward only, another way to the same selection);
and torch.topk alone on the (N, G, S) scores and on the second stage's knn² pair scores (N, heads,
knn²). Writes dumped/bench/key_search_speed_<device>.json.
"""

from __future__ import annotations

import argparse
import functools
import sys
from pathlib import Path

import torch

sys.path[:0] = [str(Path(__file__).resolve().parents[1]), str(Path(__file__).resolve().parent)]
from machine import machine_info, write_result  # noqa: E402
from timing import median_seconds  # noqa: E402

from xlm_pkm.model.memory.selected_scores import top_scores  # noqa: E402


def dense(q, keys, knn):
    return torch.einsum("ngd,gsd->ngs", q, keys).topk(knn, dim=-1)


def by_sort(q, keys, knn):
    scores, indices = torch.einsum("ngd,gsd->ngs", q, keys).sort(dim=-1, descending=True)
    return scores[..., :knn], indices[..., :knn]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--tokens", type=int, default=8192)
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--n-keys", type=int, default=512)
    parser.add_argument("--k-dim", type=int, default=512)
    parser.add_argument("--knn", type=int, default=32)
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--out", help="default: dumped/bench/key_search_speed_<device>.json")
    args = parser.parse_args()
    device = torch.device(args.device)
    gen = torch.Generator(device=device).manual_seed(0)
    N, G, S, d, K = args.tokens, 2 * args.heads, args.n_keys, args.k_dim // 2, args.knn
    q = torch.randn(N, G, d, device=device, generator=gen).requires_grad_()  # (N, G, d)
    keys = torch.randn(G, S, d, device=device, generator=gen).requires_grad_()  # (G, S, d)
    grad = torch.randn(N, G, K, device=device, generator=gen)  # (N, G, K)
    pairs = torch.randn(N, args.heads, K * K, device=device, generator=gen)  # (N, heads, K²)

    def forward_backward(search):
        def step():
            q.grad = keys.grad = None
            search(q, keys, K)[0].backward(grad)
        return step

    def forward(search):
        def step():
            with torch.no_grad():
                search(q, keys, K)
        return step

    steps = {"top_scores forward+backward": forward_backward(top_scores),
             "dense forward+backward": forward_backward(dense),
             "top_scores forward": forward(top_scores), "sort forward": forward(by_sort)}
    with torch.no_grad():
        scores = torch.einsum("ngd,gsd->ngs", q, keys)  # (N, G, S)
    for name, x in {"scores": scores, "pair scores": pairs}.items():
        steps[f"{name}: torch.topk"] = functools.partial(torch.topk, x, K, dim=-1)
    rows = []
    for name, step in steps.items():
        seconds = median_seconds(step, args.repeats, warmup=3, device=device)
        rows.append({"step": name, "ms": round(seconds * 1e3, 4)})
        print(f"{name:40s} {seconds * 1e3:8.3f} ms", flush=True)
    result = {"benchmark": "key_search_speed",
              "settings": {"tokens": N, "groups": G, "sub_keys": S, "half_dim": d, "knn": K,
                           "repeats": args.repeats, "statistic": "median"},
              "machine": machine_info(args.device), "results": rows}
    write_result(result, args, "key_search_speed")


if __name__ == "__main__":
    main()
