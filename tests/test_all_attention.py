"""All-attention against independent references: a per-query loop, the softmax FFN of Eq. 9, the whole
sequence for block-by-block processing with the cache, and causality."""

import math

import pytest
import torch

from xlm_pkm.model.adaptive_span import AdaptiveSpan
from xlm_pkm.model.all_attention import AllAttention, RelativePositions

D, H = 16, 2
DH = D // H


def make(max_span=16, n_persistent=0, z=None, ramp=4, seed=0):
    torch.manual_seed(seed)
    span = None
    if z is not None:
        span = AdaptiveSpan(H, max_span, ramp, loss_coeff=0.0)
        with torch.no_grad():
            span.z.copy_(torch.tensor(z))
    return AllAttention(D, H, RelativePositions(DH, max_span), n_persistent, dropout=0.0, span=span).eval()


def reference(attn, x, cache):
    """One query, one head at a time, straight from the definitions (no trimming, no gather)."""
    B, M, _ = x.shape
    h = torch.cat([cache, x], 1)
    C, S, N = cache.shape[1], attn.max_span, attn.n_persistent
    Wq, Wk, Wv = (w.weight.view(H, DH, D) for w in (attn.query, attn.key, attn.value))
    out = torch.zeros(B, M, H, DH)
    for b in range(B):
        for i in range(M):
            for hd in range(H):
                q = Wq[hd] @ x[b, i]
                offsets = [C + i - 1 - p for p in range(C + i)]  # every earlier position
                offsets = [o for o in offsets if o < S]
                ctx = [(q @ (Wk[hd] @ h[b, C + i - 1 - o]) + q @ attn.positions.table[:, o]) / math.sqrt(DH)
                       for o in offsets]
                pers = [q @ (math.sqrt(DH) * attn.persistent_keys[hd, n]) / math.sqrt(DH) for n in range(N)]
                a = torch.softmax(torch.stack(ctx + pers), 0) if ctx + pers else torch.zeros(0)
                if attn.span is not None:
                    m = [min(max((attn.span.ramp + attn.span.z[hd] * S - o) / attn.span.ramp, 0.0), 1.0)
                         for o in offsets]
                    a = a * torch.tensor(m + [1.0] * N)
                    a = a / (a.sum() + 1e-8)
                for n_o, o in enumerate(offsets):
                    out[b, i, hd] += a[n_o] * (Wv[hd] @ h[b, C + i - 1 - o])
                for n in range(N):
                    out[b, i, hd] += a[len(offsets) + n] * math.sqrt(N) * attn.persistent_values[hd, n]
    return attn.out(out.reshape(B, M, D))


@pytest.mark.parametrize("n_persistent, z, cache_len", [
    (0, None, 0), (0, None, 5), (6, None, 20), (6, [0.1, 0.6], 3), (0, [0.0, 0.3], 12),
])
def test_matches_per_query_reference(n_persistent, z, cache_len):
    attn = make(max_span=16 if z is None else 64, n_persistent=n_persistent, z=z)
    x, cache = torch.randn(2, 7, D), torch.randn(2, cache_len, D)
    with torch.no_grad():
        torch.testing.assert_close(attn(x, cache), reference(attn, x, cache), rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("z", [None, [0.0, 0.0]])
def test_persistent_only_equals_softmax_ffn(z):
    """No context (first token of a stream, empty cache): Eq. 9, per head softmax(q·U^T)·V with the
    reparameterised vectors U = √d_h·u (logits / √d_h) and V = √N·u', then the output projection."""
    attn = make(max_span=64, n_persistent=32, z=z)
    x = torch.randn(5, 1, D)
    q = attn.query(x).view(5, H, DH)  # (B, H, d_h)
    keys = math.sqrt(DH) * attn.persistent_keys  # (H, N, d_h)
    values = math.sqrt(32) * attn.persistent_values
    ffn = torch.einsum("bhn,hnd->bhd", torch.softmax(torch.einsum("bhd,hnd->bhn", q, keys) / math.sqrt(DH), -1), values)
    with torch.no_grad():
        torch.testing.assert_close(attn(x, torch.zeros(5, 0, D)), attn.out(ffn.reshape(5, 1, D)), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("max_span, z, block", [(16, None, 5), (128, [0.2, 0.05], 16)])
def test_blocks_with_cache_equal_whole_sequence(max_span, z, block):
    attn = make(max_span=max_span, n_persistent=4, z=z, ramp=8)
    x = torch.randn(2, 48, D)
    with torch.no_grad():
        cache = torch.zeros(2, max_span, D)  # a stream starts with a zero cache, as the authors'
        whole = attn(x, cache)
        parts = []
        for start in range(0, 48, block):
            xb = x[:, start:start + block]
            parts.append(attn(xb, cache))
            cache = attn.next_cache(cache, xb)
            assert cache.shape[1] == attn.cache_length()
    torch.testing.assert_close(torch.cat(parts, 1), whole, rtol=1e-5, atol=1e-6)


def test_trimmed_keys_change_nothing():
    """Keys beyond the span in use have mask 0: trimming them equals keeping them all."""
    attn = make(max_span=128, n_persistent=4, z=[0.1, 0.2])
    assert attn.window() == 64
    x, cache = torch.randn(1, 4, D), torch.randn(1, 128, D)
    with torch.no_grad():
        torch.testing.assert_close(attn(x, cache), reference(attn, x, cache), rtol=1e-4, atol=1e-5)


def test_causal():
    attn = make(max_span=16, n_persistent=4)
    x = torch.randn(1, 12, D)
    y = x.clone()
    y[0, 6] += 1.0
    with torch.no_grad():
        a, b = attn(x, torch.zeros(1, 0, D)), attn(y, torch.zeros(1, 0, D))
    torch.testing.assert_close(a[0, :6], b[0, :6], rtol=0, atol=0)  # earlier positions never see token 6
    assert all(not torch.allclose(a[0, t], b[0, t]) for t in range(6, 12))


def test_span_gradient_and_persistent_gradients_flow():
    attn = make(max_span=64, n_persistent=4, z=[0.0, 0.1])
    attn.train()
    attn(torch.randn(2, 8, D), torch.randn(2, 8, D)).sum().backward()
    assert attn.span.z.grad.abs().sum() > 0
    assert attn.persistent_keys.grad.abs().sum() > 0 and attn.positions.table.grad.abs().sum() > 0


def test_stream_attention_stack_in_blocks_equals_whole():
    """Two post-norm all-attention layers (x <- LN(x + attn(x))): the second layer's cache holds the
    first layer's outputs, so block-by-block equals one pass over the whole sequence."""
    from xlm_pkm.model.stream_attention import StreamAttention

    torch.manual_seed(0)
    positions = RelativePositions(DH, 32)
    layers = [StreamAttention(AllAttention(D, H, positions, 4, span=AdaptiveSpan(H, 32, 4, 0.0))) for _ in range(2)]
    norms = [torch.nn.LayerNorm(D) for _ in layers]
    with torch.no_grad():
        for layer in layers:
            layer.attention.span.z.fill_(1.0)

    def run(x):
        for layer, norm in zip(layers, norms):
            x = norm(x + layer(x))
        return x

    x = torch.randn(3, 48, D)
    with torch.no_grad():
        whole = run(x)
        for layer in layers:
            layer.past = None
        blocks = torch.cat([run(x[:, s:s + 12]) for s in range(0, 48, 12)], 1)
    torch.testing.assert_close(blocks, whole, rtol=1e-5, atol=1e-5)
    with pytest.raises(ValueError, match="the attention cache holds 3 streams, this batch has 2"):
        run(x[:2, :16])


def _persistent_ffn(attn, x, heads):
    """Eq. 9 for the given heads, straight from the stored vectors: (B, M, len(heads), d_h)."""
    q = attn.query(x).view(*x.shape[:2], H, DH)[:, :, heads]  # (B, M, h, d_h)
    keys, values = math.sqrt(DH) * attn.persistent_keys, math.sqrt(attn.n_persistent) * attn.persistent_values
    a = torch.softmax(torch.einsum("bmhd,hnd->bmhn", q, keys) / math.sqrt(DH), -1)
    return torch.einsum("bmhn,hnd->bmhd", a, values)


def _context_only(attn, x, cache):
    """The same weights without persistent vectors and with an identity output: per-head context reads."""
    ctx = AllAttention(D, H, attn.positions, 0, span=attn.span)
    ctx.load_state_dict({k: v for k, v in attn.state_dict().items() if not k.startswith("persistent")}, strict=False)
    with torch.no_grad():
        ctx.out.weight.copy_(torch.eye(D))
    return ctx.eval()(x, cache).view(*x.shape[:2], H, DH)


@pytest.mark.parametrize("z", [None, [0.1, 0.4]])
def test_split_mixing_is_context_attention_plus_softmax_ffn(z):
    torch.manual_seed(1)
    span = None if z is None else AdaptiveSpan(H, 64, 4, 0.0)
    if span is not None:
        with torch.no_grad():
            span.z.copy_(torch.tensor(z))
    attn = AllAttention(D, H, RelativePositions(DH, 64), 6, span=span, mixing="split").eval()
    x, cache = torch.randn(2, 5, D), torch.randn(2, 9, D)
    with torch.no_grad():
        expected = attn.out((_context_only(attn, x, cache) + _persistent_ffn(attn, x, [0, 1])).reshape(2, 5, D))
        torch.testing.assert_close(attn(x, cache), expected, rtol=1e-5, atol=1e-6)


def test_head_split_mixing_halves_the_heads():
    torch.manual_seed(2)
    attn = AllAttention(D, H, RelativePositions(DH, 16), 6, mixing="head_split").eval()
    assert attn.persistent_keys.shape == (1, 6, DH)  # only the persistent head holds vectors
    x, cache = torch.randn(2, 5, D), torch.randn(2, 9, D)
    with torch.no_grad():
        heads = torch.cat([_context_only(attn, x, cache)[:, :, :1], _persistent_ffn(attn, x, [1])], 2)
        torch.testing.assert_close(attn(x, cache), attn.out(heads.reshape(2, 5, D)), rtol=1e-5, atol=1e-6)
    with pytest.raises(ValueError, match="persistent mixing 'head_split' needs"):
        AllAttention(D, H, RelativePositions(DH, 16), 0, mixing="head_split")
