"""Text generation from a trained model: python generate.py --checkpoint PATH [PROMPT] [options].

    model, codec, cfg = load_model("dumped/default/demo/best.pt")  # xlm_pkm.inference.export
    ids = generate(model, codec.encode("The module"), max_tokens=50, sampling=Sampling(top_p=0.9))
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

import argparse
import sys

import torch

from xlm_pkm.errors import USER_ERRORS, fail
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


def _read_prompt(args) -> str:
    if args.prompt is not None and args.prompt_file:
        raise ValueError("give the prompt as an argument or with --prompt-file, not both")
    if not args.prompt_file:
        return args.prompt or ""
    if args.prompt_file == "-":
        return sys.stdin.read()
    try:
        with open(args.prompt_file, encoding="utf-8") as f:
            return f.read()
    except OSError as e:
        raise FileNotFoundError(f"cannot read prompt file {args.prompt_file}: {e.strerror}") from None
    except UnicodeDecodeError as e:
        raise ValueError(f"prompt file {args.prompt_file} is not UTF-8 ({e.reason})") from None


def main(argv: list[str] | None = None) -> int:
    from xlm_pkm.inference.export import load_model
    from xlm_pkm.runtime.precision import resolve_device
    from xlm_pkm.utils.program import program_name

    prog = program_name("generate.py")
    parser = argparse.ArgumentParser(prog=prog, description="Sample text from a trained model.")
    parser.add_argument("prompt", nargs="?", help="text to continue (default: start a new document)")
    parser.add_argument("--checkpoint", required=True, help="best.pt or checkpoint.pt of a run, or an exported folder")
    parser.add_argument("--prompt-file", help="read the prompt from this file ('-': standard input)")
    parser.add_argument("--data", help="processed data dir with codes and vocab (default: the run's)")
    parser.add_argument("--max-tokens", type=int, default=100, help="BPE tokens to generate per sample")
    parser.add_argument("--num-samples", type=int, default=1)
    parser.add_argument("--temperature", type=float, default=1.0)
    parser.add_argument("--top-k", type=int, default=0, help="0: no top-k cut")
    parser.add_argument("--top-p", type=float, default=1.0, help="1: no nucleus cut")
    parser.add_argument("--greedy", action="store_true", help="the most likely token each time")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--stop-at-eol", action="store_true", help="end each sample at its first line end")
    parser.add_argument("--context", type=int, default=0, help="context window in tokens (default: the run's bptt)")
    parser.add_argument("--no-cache", action="store_true", help="a full forward per token (no key/value cache)")
    parser.add_argument("--device", default="auto")
    args = parser.parse_args(argv)
    try:
        if args.max_tokens < 1 or args.num_samples < 1 or args.context < 0:
            raise ValueError("--max-tokens and --num-samples must be >= 1, --context >= 0 (0: the run's bptt)")
        sampling = Sampling(args.temperature, args.top_k, args.top_p, args.greedy)
        prompt = _read_prompt(args)
        device = resolve_device(args.device, "--device")
        model, codec, cfg = load_model(args.checkpoint, args.data)
        ids = codec.encode(prompt)
        window = args.context or cfg.data.bptt
        samples = generate(model.to(device), ids, args.max_tokens, sampling, args.seed, args.num_samples,
                           window, not args.no_cache, codec.dictionary.eos if args.stop_at_eol else None)
    except USER_ERRORS as e:
        return fail(prog, e)
    for i, continuation in enumerate(samples):
        if args.num_samples > 1:
            print(f"# sample {i + 1}")
        print(codec.decode(ids + continuation))
    return 0


if __name__ == "__main__":
    sys.exit(main())
