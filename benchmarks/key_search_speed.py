"""The product-key search's top-k step, forward and backward, against its alternatives, and the search's
settings (memory.pair_candidates, memory.score_precision) side by side.

    python3 benchmarks/key_search_speed.py [--device cuda] [--tokens 8192] [--n-keys 128 512 1024] [--out FILE]
        [--pair-candidates all winnable] [--score-precision float32 tf32 bfloat16] [--half-topk torch triton]
        [--compile]

At the training benchmark's shapes (8,192 tokens, 4 heads, 512 sub-keys of 256 per half, knn 32:
q (N, G=8, d), keys (G, S, d)), median times of
  - top_scores: selected_scores.top_scores, the package's (scores without autograd; a backward that reads only
    the knn selected keys, an embedding bag and a slot-sorted sum, or on a GPU the dense one below), with the
    products that choose the keys in each --score-precision;
  - dense: autograd through einsum + topk (its backward forms the (N, G, S) gradient and two products);
  - sort: einsum + sort, the first knn (the forward only, another way to the same selection);
torch.topk alone on the (N, G, S) scores (and the Triton selection kernel, triton_topk.row_topk, with
--half-topk triton) and on the second stage's pair scores (N, heads, knn²), and on the winnable pairs only
(N, heads, P: P = 119 at knn 32); and the whole search (keys.ProductKeys, forward and backward) for each
--pair-candidates x --score-precision x --half-topk, with the share of its chosen slots that float32 does
not choose (keys.selection_differences, on these random queries and the keys' init: a trained memory's may
differ), compiled with --compile (as in training: the float32 rescoring of a lower precision's choice then
fuses with its gather). Each --n-keys in turn, in one process. Writes dumped/bench/key_search_speed_<device>.json.
"""

from __future__ import annotations

import argparse
import functools
import itertools
import sys
from pathlib import Path

import torch

sys.path[:0] = [str(Path(__file__).resolve().parents[1]), str(Path(__file__).resolve().parent)]
from machine import machine_info, write_result  # noqa: E402
from timing import median_seconds  # noqa: E402

from xlm_pkm.model.memory.keys import KEY_SEARCHES, selection_differences, winnable_pairs  # noqa: E402
from xlm_pkm.model.memory.pkm import MemoryConfig  # noqa: E402
from xlm_pkm.model.memory.selected_scores import top_scores  # noqa: E402

PAIR_CANDIDATES, SCORE_PRECISIONS = ["all", "winnable"], ["float32", "tf32", "bfloat16"]


def dense(q, keys, knn):
    return torch.einsum("ngd,gsd->ngs", q, keys).topk(knn, dim=-1)


def by_sort(q, keys, knn):
    scores, indices = torch.einsum("ngd,gsd->ngs", q, keys).sort(dim=-1, descending=True)
    return scores[..., :knn], indices[..., :knn]


def n_keys_rows(args, n_keys: int, device: torch.device) -> list[dict]:
    """The timed steps at n_keys sub-keys per half, one row each."""
    gen = torch.Generator(device=device).manual_seed(0)
    N, H, G, S, d, K = args.tokens, args.heads, 2 * args.heads, n_keys, args.k_dim // 2, args.knn
    q = torch.randn(N, G, d, device=device, generator=gen).requires_grad_()  # (N, G, d)
    keys = torch.randn(G, S, d, device=device, generator=gen).requires_grad_()  # (G, S, d)
    grad = torch.randn(N, G, K, device=device, generator=gen)  # (N, G, K)
    pairs = torch.randn(N, H, K * K, device=device, generator=gen)  # (N, heads, K²)
    first, second = winnable_pairs(K).to(device)
    winnable = pairs.view(N, H, K, K)[:, :, first, second]  # (N, heads, P)

    def forward_backward(search, **kw):
        def step():
            q.grad = keys.grad = None
            search(q, keys, K, **kw)[0].backward(grad)
        return step

    def forward(search, **kw):
        def step():
            with torch.no_grad():
                search(q, keys, K, **kw)
        return step

    steps = {"top_scores forward+backward": forward_backward(top_scores),
             "dense forward+backward": forward_backward(dense),
             "top_scores forward": forward(top_scores), "sort forward": forward(by_sort)}
    for precision in args.score_precision:
        if precision != "float32":
            steps[f"top_scores[{precision}] forward+backward"] = forward_backward(top_scores, precision=precision)
    with torch.no_grad():
        scores = torch.einsum("ngd,gsd->ngs", q, keys)  # (N, G, S)
    for name, x in {"scores": scores, "pair scores": pairs, "winnable pair scores": winnable}.items():
        steps[f"{name}: torch.topk"] = functools.partial(torch.topk, x, K, dim=-1)
    if "triton" in args.half_topk:
        from xlm_pkm.model.memory.triton_topk import row_topk

        steps["scores: triton row_topk"] = functools.partial(row_topk, scores, K)

    differences = {}
    query = torch.randn(N, H, args.k_dim, device=device, generator=gen).requires_grad_()  # (N, heads, k_dim)
    for candidates, precision, half_topk in itertools.product(args.pair_candidates, args.score_precision,
                                                              args.half_topk):
        cfg = MemoryConfig(n_keys=n_keys, k_dim=args.k_dim, heads=H, knn=K, pair_candidates=candidates,
                           score_precision=precision, half_topk=half_topk)
        torch.manual_seed(0)  # the same keys for every setting
        search = KEY_SEARCHES["product"](cfg).to(device)
        name = f"search[{candidates}, {precision}, {half_topk}] forward+backward"
        differences[name] = selection_differences(search, query.detach())
        run = torch.compile(search.search) if args.compile else search.search

        def step(search=search, run=run):
            query.grad = None
            search.zero_grad(set_to_none=True)
            run(query)[0].backward(grad[:, :H])
        steps[name] = step

    rows = []
    for name, step in steps.items():
        seconds = median_seconds(step, args.repeats, warmup=3, device=device)
        row = {"n_keys": n_keys, "step": name, "ms": round(seconds * 1e3, 4)}
        if name in differences:
            row["slots_not_float32s"] = round(differences[name], 6)
        rows.append(row)
        print(f"n_keys {n_keys:5d} {name:56s} {seconds * 1e3:8.3f} ms"
              + (f"  {differences[name]:.4%} slots not float32's" if name in differences else ""), flush=True)
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--tokens", type=int, default=8192)
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--n-keys", type=int, nargs="+", default=[512])
    parser.add_argument("--k-dim", type=int, default=512)
    parser.add_argument("--knn", type=int, default=32)
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--pair-candidates", nargs="+", choices=PAIR_CANDIDATES, default=PAIR_CANDIDATES,
                        help="memory.pair_candidates of the whole searches timed")
    parser.add_argument("--score-precision", nargs="+", choices=SCORE_PRECISIONS, default=SCORE_PRECISIONS,
                        help="memory.score_precision of top_scores and of the whole searches timed")
    parser.add_argument("--half-topk", nargs="+", choices=["torch", "triton"],
                        help="memory.half_topk of the whole searches timed (default: both on CUDA, torch elsewhere)")
    parser.add_argument("--compile", action="store_true", help="the whole searches under torch.compile")
    parser.add_argument("--out", help="default: dumped/bench/key_search_speed_<device>.json")
    args = parser.parse_args()
    device = torch.device(args.device)
    args.half_topk = args.half_topk or (["torch", "triton"] if device.type == "cuda" else ["torch"])
    rows = [row for n_keys in args.n_keys for row in n_keys_rows(args, n_keys, device)]
    result = {"benchmark": "key_search_speed",
              "settings": {"tokens": args.tokens, "groups": 2 * args.heads, "sub_keys": args.n_keys,
                           "half_dim": args.k_dim // 2, "knn": args.knn, "repeats": args.repeats,
                           "statistic": "median", "pair_candidates": args.pair_candidates,
                           "score_precision": args.score_precision, "half_topk": args.half_topk,
                           "compiled_searches": args.compile},
              "machine": machine_info(args.device), "results": rows}
    write_result(result, args, "key_search_speed")


if __name__ == "__main__":
    main()
