"""Exported folders as Hugging Face transformers models: AutoModelForCausalLM's logits and greedy generate()
(with and without its cache) against ours for PKM options, every memory variant, Engram and the all-attention
family; the same, and the tokenizer's ids, in a Python where xlm_pkm is not installed; the way back to a run
checkpoint bit for bit; the errors."""

import os
import re
import subprocess
import sys
from pathlib import Path

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


# Run by a Python that cannot import xlm_pkm: every folder of inputs.pt (argv[1]) through transformers, its logits and
# greedy generate(), and a text through the last folder's tokenizer, to outputs.pt (argv[2]).
WITHOUT_XLM_PKM = '''
import importlib.util
import sys
from pathlib import Path


class Blind:
    """One of sys.meta_path's finders, blind to xlm_pkm and its modules: as if xlm_pkm were not installed."""

    def __init__(self, finder):
        self.finder = finder

    def find_spec(self, name, path=None, target=None):
        return None if name.partition(".")[0] == "xlm_pkm" else self.finder.find_spec(name, path, target)

    def __getattr__(self, name):
        return getattr(self.finder, name)


sys.meta_path[:] = map(Blind, sys.meta_path)
assert importlib.util.find_spec("xlm_pkm") is None

import torch
import transformers

torch.set_num_threads(1)
inputs, outputs = torch.load(sys.argv[1]), {}
for kind, folder in inputs["folders"].items():
    model = transformers.AutoModelForCausalLM.from_pretrained(folder, trust_remote_code=True)
    with torch.no_grad():
        logits = model(inputs["tokens"]).logits
    ids = model.generate(inputs["prompt"], max_new_tokens=inputs["new_tokens"], do_sample=False)
    outputs[kind] = {"logits": logits, "ids": ids[0].tolist()}
tokenizer = transformers.AutoTokenizer.from_pretrained(folder, trust_remote_code=True)
outputs["tokenizer"] = tokenizer(inputs["text"])["input_ids"]
assert not [name for name in sys.modules if name.partition(".")[0] == "xlm_pkm"]
torch.save(outputs, sys.argv[2])
'''


@pytest.mark.slow
def test_an_export_loads_where_xlm_pkm_is_not_installed(tiny_data_dir, tmp_path):
    """Issue 46: each kind of model, exported, runs in a Python that cannot import xlm_pkm (no PYTHONPATH, another
    working directory, an import system blind to it) with our logits and greedy generation; its tokenizer too."""
    from xlm_pkm.data.dictionary import Dictionary
    from xlm_pkm.data.text_codec import TextCodec

    torch.set_num_threads(1)  # as in the subprocess: the same float reductions
    tokens = torch.randint(4, len(Dictionary.load(tiny_data_dir / "vocab")), (2, 16))
    tokens[:, 0] = 0  # <s>
    prompt, new_tokens, text = tokens[:1, :5], 9, "The function returns a list.\nIt is `None` otherwise."
    folders, ours = {}, {}
    for n, kind in enumerate(KINDS):
        original = random_checkpoint(tiny_data_dir, tmp_path / "random.pt", KINDS[kind]).eval()
        folders[kind] = str(export(tmp_path / "random.pt", tmp_path / f"exported{n}"))
        with torch.no_grad():
            ours[kind] = {"logits": original(tokens),
                          "ids": generate(original, prompt[0].tolist(), new_tokens, Sampling(greedy=True))[0]}
    torch.save({"folders": folders, "tokens": tokens, "prompt": prompt, "new_tokens": new_tokens, "text": text},
               tmp_path / "inputs.pt")
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    env.update(HF_HOME=str(tmp_path / "hf"), HF_MODULES_CACHE=str(tmp_path / "hf_modules"), HF_HUB_OFFLINE="1")
    done = subprocess.run([sys.executable, "-c", WITHOUT_XLM_PKM, "inputs.pt", "outputs.pt"], cwd=tmp_path, env=env,
                          capture_output=True, text=True)
    assert done.returncode == 0, done.stderr[-3000:]
    theirs = torch.load(tmp_path / "outputs.pt")
    for kind in KINDS:
        torch.testing.assert_close(theirs[kind]["logits"], ours[kind]["logits"], rtol=0, atol=1e-5, msg=kind)
        assert theirs[kind]["ids"][prompt.shape[1]:] == ours[kind]["ids"], kind
    assert theirs["tokenizer"] == TextCodec(tiny_data_dir).encode(text)


def test_the_folder_carries_only_code_that_transformers_loads(tiny_data_dir, tmp_path):
    """Each module declared in hf_config.py is imported by the folder's entry files, at some depth: the files that
    transformers copies from a folder (get_relative_import_files) are the folder's *.py files, no fewer, no more."""
    from transformers.dynamic_module_utils import get_relative_import_files

    random_checkpoint(tiny_data_dir, tmp_path / "random.pt")
    out = export(tmp_path / "random.pt", tmp_path / "exported")
    entries = {"modeling_xlm_pkm.py", "tokenization_xlm_pkm.py"}
    loaded = {Path(f).name for entry in entries for f in get_relative_import_files(out / entry)} | entries
    assert not sorted({p.name for p in out.glob("*.py")} - loaded), "carried but never imported: drop from hf_config.py"


def _auto_model(folder):
    return transformers.AutoModelForCausalLM.from_pretrained(folder, trust_remote_code=True)


@pytest.mark.slow
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


@pytest.mark.slow
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
