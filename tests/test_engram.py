"""Engram (model/memory/engram.py, ngram_hash.py, token_compression.py) against the paper's formulas written
out naively here: the hashed rows (Python integers, one N-gram at a time) on real token streams, across
document starts and through incremental decoding; the module's output and gradients (float64 loops);
sparse and dense table updates; the one-line refusals of bad configurations."""

import math

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from xlm_pkm.config import load_config
from xlm_pkm.data.dictionary import Dictionary
from xlm_pkm.data.stream import TokenStream
from xlm_pkm.errors import ConfigError
from xlm_pkm.model.memory.engram import Engram, EngramConfig
from xlm_pkm.model.memory.ngram_hash import NgramHash
from xlm_pkm.model.memory.token_compression import canonical_form, compress_vocabulary
from xlm_pkm.model.transformer import TransformerLM

CFG = EngramConfig(layers=[1, 3], max_ngram=3, heads=3, table_size=60, ngram_dim=6, kernel_size=4, seed=5)


def test_compression_merges_surface_forms_and_keeps_the_specials_apart(tiny_data_dir):
    words = ["<s>", "</s>", "<pad>", "<unk>", "the@@", "the", "The", "Café", "cafe", "ﬁ", "fi@@", "@@", "x"]
    ids = compress_vocabulary(words)
    assert ids[:4] == [0, 1, 2, 3]  # the specials: an id each
    assert ids[4] == ids[5] == ids[6]  # continuation marker dropped, lower-cased
    assert ids[7] == ids[8] and canonical_form("Café") == "cafe"  # accents stripped
    assert ids[9] == ids[10]  # NFKC: the ligature is "fi"
    assert canonical_form("@@") == "@@"  # empty once normalised: kept as it is
    assert sorted(set(ids)) == list(range(max(ids) + 1))  # surjective onto 0..V'-1, first-seen order
    vocab = Dictionary.load(tiny_data_dir / "vocab").words
    assert 0 < max(compress_vocabulary(vocab)) + 1 < len(vocab)


def naive_prime(n: int) -> bool:
    return n > 1 and all(n % d for d in range(2, math.isqrt(n) + 1))


def naive_rows(tokens: list[int], canonical: list[int], cfg: EngramConfig) -> list[list[list[int]]]:
    """[position][layer][order, head] -> row, one N-gram at a time: the canonical ids of the N-gram ending at
    t, <pad> before the window or before the <s> that starts t's document; multipliers 2 r + 1 with r from
    numpy's default_rng(seed + 10007 · (layer - 1)) below ⌊⌊(2^63 - 1) / V'⌋ / 2⌋; each head's table the next
    unused prime above table_size / K - 1; rows offset by the sizes of the tables before it in its layer."""
    size, used, primes, mults = max(canonical) + 1, set(), [], []
    for layer in cfg.layers:
        r = np.random.default_rng(cfg.seed + 10007 * (layer - 1)).integers(0, (2**63 - 1) // size // 2,
                                                                           size=cfg.max_ngram, dtype=np.int64)
        mults.append([2 * int(v) + 1 for v in r])
        layer_primes = []
        for _ in range(2, cfg.max_ngram + 1):
            p = cfg.table_size // cfg.heads - 1
            for _ in range(cfg.heads):
                p += 1
                while not naive_prime(p) or p in used:
                    p += 1
                used.add(p)
                layer_primes.append(p)
        primes.append(layer_primes)
    out = []
    for t in range(len(tokens)):
        start = max([i for i in range(t + 1) if tokens[i] == 0], default=-math.inf)  # the document's <s>
        back = [canonical[tokens[t - j]] if t - j >= 0 and t - j >= start else canonical[2]
                for j in range(cfg.max_ngram)]
        per_layer = []
        for m, layer_primes in zip(mults, primes):
            rows, offset = [], 0
            for n in range(2, cfg.max_ngram + 1):
                mix = 0
                for j in range(n):
                    mix ^= back[j] * m[j]  # < 2^63: no overflow to emulate
                for k in range(cfg.heads):
                    p = layer_primes[(n - 2) * cfg.heads + k]
                    rows.append(mix % p + offset)
                    offset += p
            per_layer.append(rows)
        out.append(per_layer)
    return out


@pytest.fixture(scope="module")
def stream_tokens(tiny_data_dir):
    """Two windows of 48 tokens of the tiny corpus's train stream, each holding a document start."""
    stream = TokenStream(tiny_data_dir, "train", 1, 2000, train=False)
    tokens = next(iter(stream))[0][0]  # (2000,)
    starts = (tokens == 0).nonzero().squeeze(1)
    starts = starts[(starts > 5) & (starts < 1960)]
    assert len(starts) >= 2
    windows = torch.stack([tokens[s - 20: s + 28] for s in starts[:2]])  # (2, 48)
    return windows, Dictionary.load(tiny_data_dir / "vocab")


def test_rows_equal_the_naive_hash_on_real_streams_and_through_decoding(stream_tokens):
    windows, dictionary = stream_tokens
    canonical = compress_vocabulary(dictionary.words)
    hasher = NgramHash(CFG, len(dictionary))
    hasher.set_compression(canonical)
    rows = hasher(windows)  # (2, 48, layers, (N-1)·K)
    for b in range(2):
        assert rows[b].tolist() == naive_rows(windows[b].tolist(), canonical, CFG)
    model = TransformerLM(load_config(None, ["model.dim=8", "model.n_heads=2", "model.n_layers=3", "model.max_len=64",
                                             f"model.vocab_size={len(dictionary)}", "model.engram.layers=[1,3]",
                                             "model.engram.heads=3", "model.engram.table_size=60",
                                             "model.engram.ngram_dim=6", "model.engram.seed=5"]).model)
    model.set_token_compression(dictionary.words)
    assert torch.equal(model.ngram_hash(windows), rows)
    cache = model.new_cache()
    pieces = [model.ngram_hash(windows[:, :7], cache)] + [model.ngram_hash(windows[:, t: t + 1], cache)
                                                          for t in range(7, 48)]
    assert torch.equal(torch.cat(pieces, 1), rows)  # the cache keeps the N-1 tokens before


def rms(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    return x / torch.sqrt((x * x).mean(-1, keepdim=True) + torch.finfo(x.dtype).eps) * weight


def naive_engram(m: Engram, h: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
    """Eq. 3-5 one position at a time: e_t the rows read, α_t = σ(signed sqrt of RMSNorm(h)·RMSNorm(W_K e)/√d),
    ṽ_t = α_t W_V e_t, y_t = ṽ_t + SiLU(Σ_i w_i · RMSNorm(ṽ)_{t - (k-1-i)·N}) (0 before the window)."""
    B, T, D = h.shape
    out = torch.zeros_like(h)
    for b in range(B):
        v = []
        for t in range(T):
            e = torch.cat([m.table[r] for r in rows[b, t].tolist()])
            s = ((rms(h[b, t], m.norm_h.weight) * rms(m.key.weight @ e + m.key.bias, m.norm_k.weight)).sum()
                 / math.sqrt(D))
            alpha = torch.sigmoid(torch.sign(s) * torch.sqrt(torch.clamp(s.abs(), min=1e-6)))
            v.append(alpha * (m.value.weight @ e + m.value.bias))
        normed = [rms(x, m.norm_v.weight) for x in v]
        for t in range(T):
            conv = sum((m.conv[:, 0, i] * normed[t - (m.kernel_size - 1 - i) * m.dilation]
                        for i in range(m.kernel_size) if t - (m.kernel_size - 1 - i) * m.dilation >= 0),
                       torch.zeros(D, dtype=h.dtype))
            out[b, t] = v[t] + F.silu(conv)
    return out


def test_module_output_and_gradients_equal_the_naive_equations():
    torch.manual_seed(0)
    m = Engram(CFG, 10, rows=80).double()
    with torch.no_grad():
        m.conv.normal_()  # zero at initialisation: made non-zero so that the convolution is tested
        for norm in (m.norm_h, m.norm_k, m.norm_v):
            norm.weight.uniform_(0.5, 1.5)
    h = torch.randn(2, 11, 10, dtype=torch.float64, requires_grad=True)
    rows = torch.randint(0, 80, (2, 11, 6))
    grad_out = torch.randn(2, 11, 10, dtype=torch.float64)
    got = m(h, rows)
    grads = torch.autograd.grad((got * grad_out).sum(), [h, *m.parameters()])
    want = naive_engram(m, h, rows)
    want_grads = torch.autograd.grad((want * grad_out).sum(), [h, *m.parameters()])
    torch.testing.assert_close(got, want, rtol=0, atol=1e-10)
    for g, w in zip(grads, want_grads):
        torch.testing.assert_close(g, w, rtol=0, atol=1e-10)


@pytest.mark.slow
def test_incremental_decoding_equals_the_whole_forward(stream_tokens):
    windows, dictionary = stream_tokens
    torch.manual_seed(0)
    model = TransformerLM(load_config(None, ["model.dim=16", "model.n_heads=2", "model.n_layers=2", "model.max_len=64",
                                             f"model.vocab_size={len(dictionary)}", "model.mem_layers=[2]",
                                             "model.memory.n_keys=8", "model.memory.k_dim=8", "model.memory.knn=4",
                                             "model.memory.query_norm=layernorm", "model.engram.layers=[1]",
                                             "model.engram.table_size=64", "model.engram.ngram_dim=8",
                                             "model.engram.heads=2"]).model).double().eval()
    model.set_token_compression(dictionary.words)
    with torch.no_grad():
        model.engrams()[0][1].conv.normal_()
        whole = model(windows)
        cache = model.new_cache()
        steps = [model(windows[:, :5], cache)] + [model(windows[:, t: t + 1], cache) for t in range(5, 48)]
    torch.testing.assert_close(torch.cat(steps, 1), whole, rtol=0, atol=1e-10)


def test_sparse_and_dense_table_updates_give_the_same_step():
    torch.manual_seed(0)
    cfg = load_config(None, ["model.dim=16", "model.n_heads=2", "model.n_layers=2", "model.max_len=32",
                             "model.vocab_size=50", "model.engram.layers=[1,2]", "model.engram.table_size=40",
                             "model.engram.ngram_dim=8", "model.engram.heads=2"])
    from xlm_pkm.optim.optimizers import Optimizers

    tokens = torch.randint(0, 50, (3, 20))
    models = {}
    for optimizer, sparse in (("adam", False), ("lazy_adam", True)):
        torch.manual_seed(1)
        model = TransformerLM(cfg.model)
        model.set_sparse_values(sparse)
        cfg.optim.values_optimizer = optimizer
        optimizers = Optimizers(model, cfg.optim)
        assert [g.name for g in optimizers.groups] == ["dense", "engram"]
        optimizers.set_step(1)
        model(tokens[:, :-1], targets=tokens[:, 1:]).mean().backward()
        tables = [e.table for _, e in model.engrams()]
        assert all(t.grad.is_sparse == sparse for t in tables)
        optimizers.step(torch.amp.GradScaler("cpu", enabled=False))
        models[optimizer] = model
    # Adam's first step moves a row by lr·g/(|g|+eps): every row read, in both; a row never read stays put
    for name, p in models["adam"].state_dict().items():
        torch.testing.assert_close(models["lazy_adam"].state_dict()[name], p, rtol=0, atol=1e-7)
    assert models["adam"].engrams()[0][1].table.grad is not None


@pytest.mark.parametrize("override, message", [
    ("model.engram.max_ngram=1", "model.engram.max_ngram: N-grams of order 2 and up are hashed"),
    ("model.engram.table_size=4", "model.engram.table_size: one order's 8 hash heads need at least one row"),
    ("model.engram.ngram_dim=12", r"model.engram.ngram_dim \(12\) must be divisible by model.engram.heads \(8\)"),
    ("model.engram.layers=[7]", r"model.engram.layers must be distinct layers in \[1, 4\]"),
    ("model.family=all_attention", "model.engram needs model.family=transformer"),
    ("model.sublayers=[engram,attention,ffn]", "model.sublayers: engram is not listed there"),
])
def test_bad_configurations_are_refused_in_one_line(override, message):
    extra = ["model.sublayers=[all_attention]", "data.shuffle_blocks=false"] if "family" in override else []
    with pytest.raises(ConfigError, match=message):
        load_config("configs/variants/engram.yaml", [override, *extra])


def test_engram_on_byte_data_is_refused(tiny_corpus, tiny_trainer, tmp_path):
    from xlm_pkm.data.bytes import preprocess_bytes

    preprocess_bytes(tiny_corpus, tmp_path / "chars", mode="fractions", held_out_fraction=0.02)
    with pytest.raises(ConfigError, match="model.engram: .* is character-level data"):
        tiny_trainer(tmp_path, f"data.path={tmp_path / 'chars'}", "model.engram.layers=[1]",
                     "model.engram.table_size=64", "model.engram.ngram_dim=8", "model.engram.heads=2")
