"""Engram retrofitted beside a pretrained model's MLP (model.engram.layers with model.base: model/retrofit.py), on the
tiny random Llama and its byte-level BPE (conftest.tiny_base): the base's logits at step 0, the gated output wired
where the docstring says, N-gram windows that restart after the end-of-text token, decoding through the cache,
the tokenizer compression from decoded tokens, and a trained run evaluated and exported to transformers."""

import json
import shutil

import pytest
import torch
from test_retrofit import make_trainer, model_overrides, trained

from xlm_pkm.checkpoint.trained import load_trained
from xlm_pkm.config import load_config
from xlm_pkm.data.tokenized import load_tokenizer, surface_forms
from xlm_pkm.errors import ConfigError
from xlm_pkm.inference.export import export
from xlm_pkm.inference.generation import generate
from xlm_pkm.inference.sampling import Sampling
from xlm_pkm.launch.cli import evaluate_main
from xlm_pkm.model.memory.token_compression import compress_vocabulary
from xlm_pkm.model.retrofit import RetrofitLM, load_base, resolved

transformers = pytest.importorskip("transformers")

ENGRAM = ["model.engram.layers=[1]", "model.engram.heads=2", "model.engram.table_size=64", "model.engram.ngram_dim=8",
          "model.engram.kernel_size=2"]


def engram_retrofit(base) -> RetrofitLM:
    cfg = load_config(None, model_overrides(base, *ENGRAM)).model
    return RetrofitLM(resolved(cfg), load_base(cfg.base))


def opened(model: RetrofitLM) -> RetrofitLM:
    """The gates at 0.5 and the convolution random: every part of the Engram shows in the logits."""
    torch.manual_seed(1)
    with torch.no_grad():
        for beside in model.besides():
            beside.gate.fill_(0.5)
        model.engram_beside["1"].memory.conv.normal_()
    return model.eval()


def test_at_step_0_the_logits_are_the_base_s_and_both_gates_open_first(tiny_base):
    model = engram_retrofit(tiny_base)
    base = transformers.AutoModelForCausalLM.from_pretrained(tiny_base)
    x = torch.randint(0, model.cfg.vocab_size, (2, 12))
    assert (model(x) - base(x).logits).abs().max() <= 1e-5
    model(x, targets=x).mean().backward()
    assert {n for n, p in model.named_parameters() if p.grad is not None and bool(p.grad.any())} == \
        {"engram_beside.1.gate", "beside.2.gate"}
    assert [layer for layer, _ in model.engrams()] == [1] and model.param_counts()["gates"] == 2 * 32


def test_the_engram_s_gated_output_is_added_to_the_mlp_s_output_of_its_layer(tiny_base):
    """The base with hooks adding gate ⊙ Engram(u, rows of the tokens) to layer 1's MLP output (u its input) and
    the memory's to layer 2's computes the retrofit's logits."""
    model = opened(engram_retrofit(tiny_base))
    base = transformers.AutoModelForCausalLM.from_pretrained(tiny_base)
    x = torch.randint(0, model.cfg.vocab_size, (2, 12))
    engram, memory = model.engram_beside["1"], model.beside["2"]
    rows = model.ngram_hash(x)[:, :, 0]  # (B, T, (N-1)·K)
    base.model.layers[0].mlp.register_forward_hook(lambda m, args, out: out + 0.5 * engram.memory(args[0], rows))
    base.model.layers[1].mlp.register_forward_hook(lambda m, args, out: out + 0.5 * memory.memory(args[0]))
    with torch.no_grad():
        assert (model(x) - base(x).logits).abs().max() <= 1e-5


def test_a_document_s_n_grams_start_after_the_end_of_text_token(tiny_base):
    """The tokenizer's data ends each document with its EOS: the N-grams of the tokens after one are those of the
    same tokens at a sequence's start, and the tokens up to it keep theirs."""
    model = engram_retrofit(tiny_base)
    eos = load_tokenizer(tiny_base).eos_token_id
    first, second = torch.tensor([[40, 41, 42, 43]]), torch.tensor([[44, 45, 46, 47]])
    joined = torch.cat([first, torch.tensor([[eos]]), second], 1)  # (1, 9)
    rows = model.ngram_hash(joined)
    assert torch.equal(rows[:, 5:], model.ngram_hash(second))
    assert torch.equal(rows[:, :5], model.ngram_hash(joined[:, :5]))
    other = model.ngram_hash(torch.cat([first, torch.tensor([[7]]), second], 1))  # no EOS: the N-grams cross
    assert not torch.equal(other[:, 5:], rows[:, 5:])


def test_decoding_with_the_cache_gives_the_full_forward_s_logits(tiny_base):
    model = opened(engram_retrofit(tiny_base))
    x = torch.randint(0, model.cfg.vocab_size, (2, 10))
    with torch.no_grad():
        full = model(x)
        cache = model.new_cache()
        steps = [model(x[:, :4], cache)] + [model(x[:, t:t + 1], cache) for t in range(4, 10)]
    assert (torch.cat(steps, 1) - full).abs().max() <= 1e-5
    from transformers import DynamicCache

    with pytest.raises(ValueError, match=r"its own cache \(new_cache\(\)\)"):
        model(x[:, :2], DynamicCache(config=model.base.config))


def test_the_compression_merges_tokens_whose_decoded_text_differs_only_in_case_and_spaces(tiny_base):
    tokenizer = load_tokenizer(tiny_base)
    size = len(tokenizer) + 20  # the tiny base's embedding has 20 rows more
    forms = surface_forms(tokenizer, size)
    canonical = compress_vocabulary(forms)
    texts = [tokenizer.decode([i]) for i in range(len(tokenizer))]
    fragments = [i for i, t in enumerate(texts) if "\ufffd" in t]  # a byte of a character, not text
    assert fragments and all(forms[i] == f"<id:{i}>" for i in fragments)
    assert forms[len(tokenizer):] == [f"<id:{i}>" for i in range(len(tokenizer), size)]
    own = {canonical[i] for i in [*fragments, *range(len(tokenizer), size)]}
    assert len(own) == len(fragments) + 20  # each its own id
    words = [i for i, t in enumerate(texts) if t.strip().isalpha() and t.isascii()]
    pairs = [(i, j) for i in words for j in words if i < j and texts[i].strip().lower() == texts[j].strip().lower()]
    assert pairs and all(canonical[i] == canonical[j] for i, j in pairs)  # " the" and "the": one id
    distinct = [(i, j) for i in words for j in words if texts[i].strip().lower() != texts[j].strip().lower()]
    assert all(canonical[i] != canonical[j] for i, j in distinct)


def test_a_retrofit_with_engram_trains_evaluates_and_exports_to_transformers(tiny_base, tiny_base_data, tmp_path):
    run = trained(make_trainer(tiny_base, tiny_base_data, tmp_path, "engram", *ENGRAM, "train.max_steps=2"))
    best = run.run_dir / "best.pt"
    model = load_trained(best)
    hash_ = model.model.ngram_hash
    assert int(hash_.canonical.max()) + 1 < model.model.cfg.vocab_size  # the compression, saved with the model
    assert model.model.engram_beside["1"].gate.abs().sum() > 0
    assert evaluate_main(["--checkpoint", str(best), "--split", "valid", "--json", str(tmp_path / "r.json")]) == 0
    engrams = json.loads((tmp_path / "r.json").read_text())["engrams"]
    assert [e["layer"] for e in engrams] == [1] and 0 < engrams[0]["usage"] <= 100
    x = torch.tensor([model.codec().encode("The module said")])
    hf = transformers.AutoModelForCausalLM.from_pretrained(export(best, tmp_path / "exported"), trust_remote_code=True)
    with torch.no_grad():
        assert torch.equal(hf(x).logits, model.model(x))
    new = hf.generate(x, max_new_tokens=4, do_sample=False)[0, x.shape[1]:].tolist()
    eos = model.dictionary.eos
    ours = generate(model.model, x[0].tolist(), 4, Sampling(greedy=True), stop=eos)[0]
    assert new in (ours, [*ours, eos])


def test_a_base_whose_end_of_text_is_not_the_data_s_is_refused(tiny_base, tiny_base_data, tmp_path):
    """Engram's documents end where the base's config says; data whose tokenizer ends them with another id would
    have its N-grams cross documents: a one-line error names both ids."""
    base = tmp_path / "base"
    shutil.copytree(tiny_base, base)
    config = json.loads((base / "config.json").read_text())
    eos = config["eos_token_id"]
    (base / "config.json").write_text(json.dumps({**config, "eos_token_id": eos + 1}))
    with pytest.raises(ConfigError, match=rf"^model.engram.layers: .*\(id {eos + 1}, .* with id {eos} "):
        make_trainer(base, tiny_base_data, tmp_path, "eos", *ENGRAM)
