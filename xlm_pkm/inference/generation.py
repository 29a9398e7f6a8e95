"""Text generation from a trained model (generate.py's command line: launch/cli.py).

    trained = load_trained("dumped/default/demo/best.pt")  # or an exported folder: checkpoint/trained.py
    codec = trained.codec()
    ids = generate(trained.model, codec.encode("The module"), max_tokens=50, sampling=Sampling(top_p=0.9))
    print(codec.decode(codec.encode("The module") + ids[0]))

Decoding is incremental: the prompt is fed once, then each new token alone, attending to the keys and
values cached by the model (TransformerLM.new_cache()); `use_cache=False` runs a full forward over the
context for every token instead (same tokens, for checking and benchmarking). The model runs in eval
mode (the memories' BatchNorm on its running statistics). The context is a window of at most `window`
tokens (default: the run's bptt, the positions it was trained on): when it is full, it restarts from
its last window // 2 tokens (re-fed at once), in both decoders alike. A model whose layers carry a
stream cache (all-attention) starts new evaluation streams with each context (both decoders).
"""

from __future__ import annotations

import torch

from xlm_pkm.inference.sampling import Sampling, sample
from xlm_pkm.model.attention import KVCache


@torch.inference_mode()
def generate(model, prompt: list[int], max_tokens: int, sampling: Sampling = Sampling(), seed: int = 0,
             num_samples: int = 1, window: int = 0, use_cache: bool = True, stop: int | None = None) -> list[list[int]]:
    """`num_samples` continuations of the token ids `prompt` (decoded together, as one batch), each of
    at most `max_tokens` ids; with `stop`, each ends before its first `stop` token (the decoding ends
    when every sample has one)."""
    if not prompt:
        raise ValueError("the prompt must hold at least one token (<s> starts a document)")
    model.eval()
    device = next(model.parameters()).device
    window = min(window or model.cfg.max_len, model.cfg.max_len)
    generator = torch.Generator().manual_seed(seed)
    tokens = torch.tensor(prompt, device=device).repeat(num_samples, 1)  # (B, n)
    start = fed = 0  # the context is tokens[:, start:]; the cache holds tokens[:, start:fed]

    def new_context() -> KVCache | None:
        model.reset_stream_state(training=False)  # all-attention layers: their stream cache holds the context
        return model.new_cache() if use_cache else None

    cache = new_context()
    stopped = torch.zeros(num_samples, dtype=torch.bool, device=device)  # (B,)
    for _ in range(max_tokens):
        n = tokens.shape[1]
        if n - start > window:
            start = fed = n - max(window // 2, 1)
            cache = new_context()
        if use_cache:
            logits = model(tokens[:, fed:], cache=cache)[:, -1]  # (B, vocab): only the new tokens are fed
            fed = n
        else:
            new_context()
            logits = model(tokens[:, start:])[:, -1]  # (B, vocab)
        next_ids = sample(logits, sampling, generator)  # (B,)
        tokens = torch.cat([tokens, next_ids[:, None]], dim=1)
        if stop is not None:
            stopped |= next_ids == stop
            if bool(stopped.all()):
                break
    out = tokens[:, len(prompt):].tolist()
    return [ids[:ids.index(stop)] if stop in ids else ids for ids in out]
