"""Exported folders as Hugging Face transformers models: AutoModelForCausalLM's logits and greedy generate()
(with and without its cache) against ours for PKM options, every memory variant, Engram and the all-attention
family; the folder's code free of xlm_pkm; the way back to a run checkpoint bit for bit; the errors."""

import re

import pytest
import torch
from test_export import SHARED, VARIANTS, random_checkpoint

from xlm_pkm.checkpoint import files as checkpoint
from xlm_pkm.inference.export import export, main
from xlm_pkm.inference.generation import generate
from xlm_pkm.inference.sampling import Sampling

transformers = pytest.importorskip("transformers")

KINDS = {
    **VARIANTS,
    "relu scores, gated, add": [*SHARED[:-1], "model.memory.score=relu", "model.memory.gated=true",
                                "model.mem_mode=add"],
    "all-attention": ["model.family=all_attention", "model.sublayers=[all_attention]", "model.persistent_vectors=4",
                      "model.dim=32", "model.n_layers=2", "model.n_heads=2", "model.n_memories=0",
                      "model.span.max_span=16", "model.span.ramp=4", "data.shuffle_blocks=false"],
}


def _auto_model(folder):
    return transformers.AutoModelForCausalLM.from_pretrained(folder, trust_remote_code=True)


@pytest.mark.parametrize("kind", KINDS)
def test_transformers_runs_the_export_as_our_model(kind, tiny_data_dir, tmp_path):
    original = random_checkpoint(tiny_data_dir, tmp_path / "random.pt", KINDS[kind]).eval()
    out = export(tmp_path / "random.pt", tmp_path / "exported")
    code = {p.name: p.read_text() for p in out.glob("*.py")}
    assert "modeling_xlm_pkm.py" in code and "tokenization_xlm_pkm.py" in code
    assert not [name for name, text in code.items() if re.search(r"^\s*(from|import) xlm_pkm\b", text, re.M)]
    model = _auto_model(out)
    assert type(model).__name__ == "XlmPkmForCausalLM" and not model.training
    assert "xlm_pkm" not in type(model.lm).__module__  # the folder's copy of TransformerLM, not the package's
    tokens = torch.randint(4, original.cfg.vocab_size, (2, 16))
    tokens[:, 0] = 0  # <s>
    with torch.no_grad():
        torch.testing.assert_close(model(tokens).logits, original(tokens), rtol=0, atol=1e-5)

    prompt = tokens[0, :5].tolist()
    ours = generate(original, prompt, 9, Sampling(greedy=True))[0]  # 14 positions: within max_len 16
    widths = []
    model.lm.register_forward_pre_hook(lambda module, args: widths.append(args[0].shape[1]))
    for use_cache, fed in ((True, [5] + [1] * 8), (False, list(range(5, 14)))):
        widths.clear()
        ids = model.generate(torch.tensor([prompt]), max_new_tokens=9, do_sample=False, use_cache=use_cache)
        assert ids[0, 5:].tolist() == ours and widths == fed, use_cache


def test_an_export_comes_back_as_the_same_checkpoint(reference_run, tmp_path, capsys):
    """Run checkpoint -> exported folder -> run checkpoint: config, every tensor, step and vocabulary, bit for bit."""
    best = reference_run().best_path
    export(best, tmp_path / "exported")
    assert main(["--import", str(tmp_path / "exported"), str(tmp_path / "back.pt")]) == 0
    before, after = checkpoint.load(best), checkpoint.load(tmp_path / "back.pt")
    assert after["config"] == before["config"] and after["step"] == before["step"]
    assert after["vocab_fingerprint"] == before["vocab_fingerprint"]
    assert after["model"].keys() == before["model"].keys()
    for name, tensor in before["model"].items():
        assert tensor.dtype == after["model"][name].dtype and torch.equal(tensor, after["model"][name]), name

    capsys.readouterr()
    assert main(["--import", str(tmp_path / "exported"), str(tmp_path / "back.pt")]) == 2
    assert capsys.readouterr().err.strip().endswith("back.pt exists: import writes a new checkpoint file")
    (tmp_path / "notes").mkdir()
    assert main(["--import", str(tmp_path / "notes"), str(tmp_path / "other.pt")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "not a folder written by python -m xlm_pkm.inference.export" in err[0]


def test_the_exported_tokenizer_gives_our_ids_and_text(reference_run, tiny_data_dir, tmp_path):
    """AutoTokenizer of an exported folder against TextCodec on the corpus's held-out documents."""
    from xlm_pkm.data.text_codec import TextCodec
    from xlm_pkm.experiments.harness import held_out_documents

    out = export(reference_run().best_path, tmp_path / "exported")
    tokenizer = transformers.AutoTokenizer.from_pretrained(out, trust_remote_code=True)
    codec = TextCodec(tiny_data_dir)
    documents = held_out_documents(tiny_data_dir)[:20]
    assert len(documents) >= 4 and sum(len(d.splitlines()) for d in documents) > 100
    for text in documents:
        ids = tokenizer(text)["input_ids"]
        assert ids == codec.encode(text) and tokenizer.decode(ids) == codec.decode(ids)
