"""Checkpoint export: safetensors + config.json + codes/vocab, loaded back with the same logits."""

import json
import shutil

import pytest
import torch
from safetensors import safe_open

from xlm_pkm.checkpoint import files as checkpoint
from xlm_pkm.checkpoint.trained import load_trained
from xlm_pkm.config import load_config, to_dict
from xlm_pkm.data.dictionary import Dictionary
from xlm_pkm.inference.export import export, main
from xlm_pkm.inference.generation import generate
from xlm_pkm.inference.sampling import Sampling
from xlm_pkm.launch.cli import evaluate_main
from xlm_pkm.model.transformer import TransformerLM

SHARED = ["model.dim=32", "model.n_layers=3", "model.n_heads=2", "model.max_len=16", "model.mem_layers=[1,3]",
          "model.memory.n_keys=8", "model.memory.k_dim=16", "model.memory.heads=2", "model.memory.knn=4",
          "model.memory.share_values=true"]
VARIANTS = {  # random models of each memory variant (docs/variants.md), PEER's tables shared by two memories
    "shared values": SHARED,
    "peer": [*SHARED, "model.memory.values=peer", "model.memory.share_keys=true"],
    "ultramem": [*SHARED[:-1], "model.memory.key_type=tucker", "model.memory.tucker.cores=2",
                 "model.memory.values=expanded", "model.memory.expanded.expansion=2", "model.memory.score=identity"],
    "engram": [*SHARED, "model.engram.layers=[2]", "model.engram.heads=2", "model.engram.table_size=50",
               "model.engram.ngram_dim=8"],
}


def random_checkpoint(tiny_data_dir, path, overrides=SHARED):
    """A checkpoint of a model of `overrides` (by default two memories reading one value table), random
    weights, BatchNorm moved."""
    dictionary = Dictionary.load(tiny_data_dir / "vocab")
    cfg = load_config(None, [f"data.path={tiny_data_dir}", f"model.vocab_size={len(dictionary)}", *overrides])
    torch.manual_seed(0)
    model = TransformerLM(cfg.model)
    model.set_token_compression(dictionary.words)  # Engram's canonical ids (nothing without Engram)
    for _, memory in model.memories():
        memory.query_norm.running_mean.normal_()
    checkpoint.save_atomic({"config": to_dict(cfg), "model": model.state_dict(), "step": 7,
                            "vocab_fingerprint": dictionary.fingerprint()}, path)
    return model


@pytest.mark.parametrize("kind", ["trained run", *VARIANTS])
def test_export_round_trips_with_the_same_logits(kind, reference_run, tiny_data_dir, tmp_path):
    if kind == "trained run":
        path = reference_run().best_path
        original = load_trained(path).model
    else:
        path = tmp_path / "random.pt"
        original = random_checkpoint(tiny_data_dir, path, VARIANTS[kind]).eval()
    out = export(path, tmp_path / "exported")
    data_files = ["codes", "config.json", "export_manifest.json", "model.safetensors", "tokenizer_config.json", "vocab"]
    assert sorted(p.name for p in out.iterdir() if p.suffix != ".py") == data_files
    for name in ("codes", "vocab"):
        assert (out / name).read_bytes() == (tiny_data_dir / name).read_bytes()
    config = json.loads((out / "config.json").read_text())
    assert {k: config[k] for k in ("model", "data", "optim", "train", "plugins")} == checkpoint.load(path)["config"]
    assert config["model_type"] == "xlm_pkm" and config["vocab_size"] == len(Dictionary.load(tiny_data_dir / "vocab"))
    exported = load_trained(out, out)  # its own vocab
    model, dictionary = exported.model, exported.dictionary
    assert dictionary.words == Dictionary.load(tiny_data_dir / "vocab").words and not model.training
    assert exported.step == checkpoint.load(path)["step"] and exported.source == out
    tokens = torch.randint(0, len(dictionary), (2, 16))
    with torch.no_grad():
        torch.testing.assert_close(model(tokens), original(tokens), rtol=0, atol=0)
    if kind == "engram":  # the canonical ids travel with the weights
        assert torch.equal(model.ngram_hash.canonical, original.ngram_hash.canonical)
        assert model.ngram_hash.canonical.max() + 1 < len(dictionary)
    if kind in ("shared values", "peer"):
        (_, first), (_, second) = model.memories()
        assert first.values is second.values  # still one store, not two copies
        with safe_open(str(out / "model.safetensors"), "pt") as f:
            tables = [k for k in f.keys() if ".values." in k]
            assert len(tables) == len(first.values.tables()) and f.metadata()["step"] == "7"


def test_generation_from_the_exported_folder_equals_the_checkpoint(reference_run, tmp_path):
    path = reference_run().best_path
    export(path, tmp_path / "exported")
    a, b = load_trained(path), load_trained(tmp_path / "exported", tmp_path / "exported")
    prompt = a.codec().encode("the function")
    assert prompt == b.codec().encode("the function")
    kw = dict(max_tokens=10, sampling=Sampling(top_k=10), seed=1)
    assert generate(a.model, prompt, **kw) == generate(b.model, prompt, **kw)


@pytest.mark.slow
def test_evaluating_the_exported_folder_gives_the_checkpoints_figures(reference_run, tiny_data_dir, tmp_path):
    """evaluate.py on an exported folder: the run's data by default (or --data), the same perplexity, usage
    and KL as on the checkpoint it was exported from."""
    path = reference_run().best_path
    folder = export(path, tmp_path / "exported")
    results = {}
    for name, source, data in [("checkpoint", path, []), ("folder", folder, []),
                               ("folder --data", folder, ["--data", str(tiny_data_dir)])]:
        assert evaluate_main(["--checkpoint", str(source), "--split", "valid", "--device", "cpu", *data,
                              "--json", str(tmp_path / "result.json")]) == 0
        results[name] = json.loads((tmp_path / "result.json").read_text())
    for name, result in results.items():
        assert result["ppl"] == results["checkpoint"]["ppl"] and result["step"] == results["checkpoint"]["step"], name
        assert result["tokens"] == results["checkpoint"]["tokens"] > 0, name
        assert [{k: v for k, v in m.items() if k.startswith(("usage", "kl"))} for m in result["memories"]] == \
            [{k: v for k, v in m.items() if k.startswith(("usage", "kl"))} for m in results["checkpoint"]["memories"]]
    assert results["folder"]["memories"], "the tiny run has a memory"


def test_export_errors_are_one_line(reference_run, tiny_data_dir, tmp_path, capsys):
    path = reference_run().best_path
    shutil.copytree(tiny_data_dir, tmp_path / "data")
    (tmp_path / "data" / "codes").unlink()  # a run directory whose data lost its BPE codes
    assert main([str(path), str(tmp_path / "x"), "--data", str(tmp_path / "data")]) == 2
    assert capsys.readouterr().err == (f"python -m xlm_pkm.inference.export: error: {tmp_path / 'data' / 'codes'} not "
                                       f"found: an export carries the run's codes and vocab (from its data dir, or "
                                       f"--data DIR)\n")
    assert not (tmp_path / "x").exists()
    out = export(path, tmp_path / "exported")
    capsys.readouterr()
    missing = tmp_path / "missing.pt"
    assert main([str(missing), str(tmp_path / "x")]) == 2
    assert capsys.readouterr().err == (f"python -m xlm_pkm.inference.export: error: {missing} does not exist: give a "
                                       f"run's checkpoint.pt or best.pt, or a folder written by python -m "
                                       f"xlm_pkm.inference.export\n")
    vocab, other = (out / "vocab").read_text(), tmp_path / "other_data"
    other.mkdir()
    (other / "vocab").write_text(vocab + "extra 1\n")
    with pytest.raises(ValueError, match=r"model has a vocabulary of \d+ tokens, .*vocab has \d+"):
        load_trained(out, other)
    (other / "vocab").write_text("".join(vocab.splitlines(True)[:-1]) + "unheard_of 1\n")  # as many words, not the same
    with pytest.raises(ValueError, match="trained with another vocabulary than .*vocab"):
        load_trained(out, other)
    (out / "vocab").write_text((other / "vocab").read_text())  # the folder's own: edited since the export
    with pytest.raises(ValueError, match="vocab: edited since the export"):
        load_trained(out, out)
    (out / "config.json").unlink()
    with pytest.raises(FileNotFoundError, match="config.json not found: not a folder written by"):
        load_trained(out, out)


# ---- the output folder: new, empty or a previous export (issue 35) ---------------------------------------
@pytest.mark.parametrize("holds", ["notes.txt", "vocab only", "foreign weights", "a file"])
def test_export_into_a_folder_that_is_not_an_export_is_refused(holds, reference_run, tmp_path, capsys):
    from safetensors.torch import save_file

    out = tmp_path / "folder"
    if holds == "a file":
        out.write_text("mine\n")
    else:
        out.mkdir()
        (out / "vocab").write_text("mine 1\n")
        if holds == "notes.txt":
            (out / "notes.txt").write_text("mine\n")
        elif holds == "foreign weights":
            save_file({"w": torch.zeros(2)}, str(out / "model.safetensors"))
    before = out.read_bytes() if out.is_file() else {p.name: p.read_bytes() for p in out.iterdir()}
    assert main([str(reference_run().best_path), str(out)]) == 2
    err = capsys.readouterr().err
    prefix = "python -m xlm_pkm.inference.export: error: "
    if holds == "a file":
        assert err == f"{prefix}{out} is a file: export writes a folder (give a new or empty one)\n"
    else:
        why = {"notes.txt": "it holds notes.txt", "vocab only": "it holds vocab but no model.safetensors",
               "foreign weights": "its model.safetensors was not written by export"}[holds]
        assert err == (f"{prefix}{out} is not empty and not a previous export ({why}): export into a new or empty "
                       f"folder, or a previous export (its model.safetensors written by export), so that no "
                       f"other file is overwritten\n")
    assert (out.read_bytes() if out.is_file() else {p.name: p.read_bytes() for p in out.iterdir()}) == before


def test_export_replaces_a_previous_export_and_an_empty_folder_is_fine(reference_run, tmp_path):
    reference = reference_run()
    out = tmp_path / "exported"
    out.mkdir()
    export(reference.best_path, out)
    (out / "export.1234.0123abcd.tmp").mkdir()  # left by a killed export: not in the way
    (out / "own_module.py").write_text("")  # not written by export: kept (issue 62)
    export(reference.ckpt_path, out)
    assert sorted(p.name for p in out.iterdir() if p.suffix != ".py") == [
        "codes", "config.json", "export.1234.0123abcd.tmp", "export_manifest.json", "model.safetensors",
        "tokenizer_config.json", "vocab"]
    assert (out / "own_module.py").exists() and (out / "modeling_xlm_pkm.py").is_file()
    with safe_open(str(out / "model.safetensors"), "pt") as f:
        assert f.metadata()["source"] == str(reference.ckpt_path)
    load_trained(out, out)
