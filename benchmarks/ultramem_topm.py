"""How often UltraMem's approximate search misses the exact top-knn: dumped/bench/ultramem_topm_<cpu|cuda>.json.

    .venv/bin/python benchmarks/ultramem_topm.py [--n-keys 64 256 512] [--topm 32 64] [--checkpoint best.pt]

key_type=tucker keeps the top-m rows of uᵀS_row and the top-m columns of tᵀS_col (u, t: the leading singular
vectors of the summed core, its rank-1 approximation) and scores those m² candidates exactly
(model/memory/ultramem.py). Per query and head, this measures the fraction of the exact top-knn of all
n_keys² slots (TuckerKeys.all_scores) that the search returns (recall), and the fraction of queries and heads
for which it returns all of them; for the paper's candidates (the top-m rows and columns) and with
memory.tucker.both_signs (also the bottom-m: two negatives make a high score too). For each n_keys and m,
on random N(0, 1) queries (what a BatchNorm'd query looks like at initialisation): for a layer at
initialisation (cores uniform in [0, 1), as built), for the same layer after its cores were trained on the
aux loss alone until every non-leading singular value is within the margin τ (the core pushed toward rank 1,
as the aux loss does in training; coefficient 1 here to get there in a few Adam steps), and for a core of
N(0, 1) entries (mixed signs, a stress case for the rank-1 approximation). With --checkpoint, the trained
model's tucker memories on their own queries (the model run on the start of the valid split of --data,
default the run's; random tokens if it has none), at their configured m and also at m = n_keys (which must
be exact).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path[:0] = [str(Path(__file__).resolve().parents[1]), str(Path(__file__).resolve().parent)]
from machine import machine_info, write_result

from xlm_pkm.model.memory.keys import KEY_SEARCHES
from xlm_pkm.model.memory.pkm import MemoryConfig
from xlm_pkm.model.memory.ultramem import TuckerConfig, TuckerKeys


@torch.no_grad()
def recall(keys: TuckerKeys, q: torch.Tensor, chunk: int = 64) -> dict:
    """q (N, H, k_dim): for the paper's candidates (top-m) and with both_signs (top-m and bottom-m), the mean
    recall of the exact top-knn, the fraction of (query, head) with all found, the mean recall per head."""
    hits = {False: [], True: []}
    saved = keys.both_signs
    for start in range(0, q.shape[0], chunk):
        part = q[start:start + chunk]
        exact = keys.all_scores(part).topk(keys.knn, dim=-1).indices  # (n, H, K)
        for both in hits:
            keys.both_signs = both
            _, found = keys.search(part)  # (n, H, K)
            hits[both].append((found[..., :, None] == exact[..., None, :]).any(-2).float().mean(-1))  # (n, H)
    keys.both_signs = saved
    out = {}
    for both, parts in hits.items():
        h = torch.cat(parts)  # (N, H)
        name = "both_signs" if both else "paper"
        out[name] = {"recall": round(h.mean().item(), 5), "all_found": round((h == 1).float().mean().item(), 5),
                     "recall_per_head": [round(v, 5) for v in h.mean(0).tolist()]}
    return out


def singular_values(keys: TuckerKeys) -> list[list[float]]:
    with torch.no_grad():
        return [[round(v, 4) for v in row] for row in torch.linalg.svdvals(keys.core.sum(1)).tolist()]


def push_to_rank_one(keys: TuckerKeys, steps: int = 2000) -> int:
    """Adam on the cores alone, minimising the aux loss with coefficient 1 until it is 0; returns the steps."""
    coeff, keys.aux_coeff = keys.aux_coeff, 1.0
    opt = torch.optim.Adam([keys.core], lr=1e-2)
    for step in range(1, steps + 1):  # noqa: B007 (the last step is returned, after the loop)
        loss = keys.aux_loss()
        if loss.item() == 0:
            break
        opt.zero_grad()
        loss.backward()
        opt.step()
    keys.aux_coeff = coeff
    return step


def synthetic(args) -> list[dict]:
    rows = []
    for n_keys in args.n_keys:
        for topm in args.topm:
            cfg = MemoryConfig(key_type="tucker", n_keys=n_keys, k_dim=args.k_dim, heads=args.heads, knn=args.knn,
                               tucker=TuckerConfig(rank=args.rank, cores=args.cores, topm=min(topm, n_keys)),
                               values="expanded")
            torch.manual_seed(args.seed)
            keys = KEY_SEARCHES["tucker"](cfg).to(args.device)
            q = torch.randn(args.queries, args.heads, args.k_dim, device=args.device)
            base = dict(n_keys=n_keys, topm=keys.topm, knn=args.knn, rank=args.rank, cores=args.cores)
            rows.append(base | {"core": "initial (uniform [0, 1))", "singular_values": singular_values(keys)}
                        | recall(keys, q))
            steps = push_to_rank_one(keys)
            rows.append(base | {"core": f"aux loss pushed (λ_i <= τ={keys.aux_margin}, {steps} Adam steps)",
                                "singular_values": singular_values(keys)} | recall(keys, q))
            with torch.no_grad():
                keys.core.normal_()
            rows.append(base | {"core": "N(0, 1) entries (mixed signs)", "singular_values": singular_values(keys)}
                        | recall(keys, q))
    return rows


def trained(args) -> list[dict]:
    from xlm_pkm.checkpoint.trained import load_trained

    loaded = load_trained(args.checkpoint, args.data)
    model, cfg, data_dir = loaded.model.to(args.device), loaded.cfg, loaded.data_dir
    memories = [(layer, m) for layer, m in model.memories() if isinstance(m.keys, TuckerKeys)]
    if not memories:
        raise SystemExit(f"{args.checkpoint}: no memory with key_type=tucker")
    queries = {layer: [] for layer, _ in memories}
    for layer, memory in memories:  # record each memory's queries as the model searches
        memory.search = lambda q, layer=layer, search=memory.search: (queries[layer].append(q.detach()), search(q))[1]
    seq = min(256, cfg.model.max_len)
    shards = sorted(Path(data_dir).glob("valid.*.bin"))
    if shards:  # the first queries of the valid split
        from xlm_pkm.data.shard import read_shard
        ids = torch.from_numpy(read_shard(shards[0]).tokens[: max(1, args.queries // seq) * seq].astype("int64"))
        tokens, source = ids.view(-1, seq).to(args.device), f"{shards[0].name}, first {ids.numel()} tokens"
    else:
        torch.manual_seed(args.seed)
        tokens = torch.randint(0, cfg.model.vocab_size, (max(1, args.queries // seq), seq), device=args.device)
        source = "random tokens (no valid split in the data directory)"
    with torch.no_grad():
        model(tokens)
    rows = []
    for layer, memory in memories:
        q = torch.cat(queries[layer])
        for topm in sorted({memory.keys.topm, memory.keys.n_keys}):
            keys = memory.keys
            saved, keys.topm = keys.topm, topm
            rows.append(dict(layer=layer, n_keys=keys.n_keys, topm=topm, knn=keys.knn, rank=keys.rank, cores=keys.cores,
                             core="trained", queries_from=source, singular_values=singular_values(keys))
                        | recall(keys, q))
            keys.topm = saved
    return rows


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--n-keys", type=int, nargs="+", default=[64, 256, 512])
    parser.add_argument("--topm", type=int, nargs="+", default=[32, 64], help="m (clipped to n_keys)")
    parser.add_argument("--knn", type=int, default=32)
    parser.add_argument("--k-dim", type=int, default=256)
    parser.add_argument("--heads", type=int, default=2)
    parser.add_argument("--rank", type=int, default=2, help="the paper's r = 2 (Table 5)")
    parser.add_argument("--cores", type=int, default=2, help="the paper's h = 2 cores (Table 5), summed for the search")
    parser.add_argument("--queries", type=int, default=2048)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--checkpoint", help="a run checkpoint whose tucker memories are measured instead")
    parser.add_argument("--data", help="its data directory (default: the run's)")
    parser.add_argument("--out", help="default: dumped/bench/ultramem_topm_<cpu|cuda>.json")
    args = parser.parse_args()
    rows = trained(args) if args.checkpoint else synthetic(args)
    print("recall of the exact top-knn (all found: fraction of queries x heads with every one): the paper's top-m "
          "| both_signs (top-m and bottom-m)")
    for row in rows:
        paper, both = row["paper"], row["both_signs"]
        print(f"n_keys={row['n_keys']:5d} m={row['topm']:4d} knn={row['knn']:3d}  {row['core']:<50s} "
              f"paper {paper['recall']:.4f} (all {paper['all_found']:.4f}) | both_signs {both['recall']:.4f} "
              f"(all {both['all_found']:.4f})  λ(head 0) {row['singular_values'][0]}")
    write_result({"benchmark": "ultramem_topm", "machine": machine_info(args.device),
                  "settings": {k: v for k, v in vars(args).items() if k != "out"}, "results": rows},
                 args, "ultramem_topm")


if __name__ == "__main__":
    main()
