"""A bfloat16 table (model.memory.value_dtype, model.engram.table_dtype) outside its run: exported as stored (its
bytes half the float32 export's), loaded back as stored by our loader, by transformers (also with dtype=bf16/fp16:
the memory and Engram layers float32 compute, their tables as stored) and in a Python without xlm_pkm, with the
trained model's logits; evaluate.py and generate.py read it as stored."""

import json
import os
import struct
import subprocess
import sys

import pytest
import torch
from test_export import SHARED, VARIANTS, random_checkpoint

from xlm_pkm.checkpoint import files as checkpoint
from xlm_pkm.checkpoint.trained import load_trained
from xlm_pkm.inference import export as export_module
from xlm_pkm.launch import cli
from xlm_pkm.model.memory.value_stores import is_memory_value
from xlm_pkm.train import evaluation

BFLOAT16 = ["model.memory.value_dtype=bfloat16", "model.engram.table_dtype=bfloat16"]
KINDS = {"memory values": SHARED, "engram": VARIANTS["engram"]}  # a value table shared by two memories; Engram's too


def tables_of(model) -> dict[str, torch.Tensor]:
    """{name: table} of the model's tables (value tables and Engram's), a shared one under each of its names."""
    return {name: p for name, p in model.named_parameters(remove_duplicate=False) if is_memory_value(p)}


def header(path) -> dict:
    """The safetensors file's header: {name: {"dtype", "shape", "data_offsets"}} (and __metadata__)."""
    with open(path, "rb") as f:
        (size,) = struct.unpack("<Q", f.read(8))
        return json.loads(f.read(size))


def stored_bytes(path) -> dict[str, int]:
    """{tensor name: bytes it takes in the safetensors file}."""
    return {k: v["data_offsets"][1] - v["data_offsets"][0] for k, v in header(path).items() if k != "__metadata__"}


@pytest.fixture
def exports(tiny_data_dir, tmp_path):
    """kind -> (float32 model, bfloat16 model, float32 export, bfloat16 export): the same draws, the bfloat16
    model's tables those of the float32 one rounded to nearest."""
    def make(kind):
        made = []
        for name, dtype in (("float32", []), ("bfloat16", BFLOAT16)):
            model = random_checkpoint(tiny_data_dir, tmp_path / f"{name}.pt", [*KINDS[kind], *dtype]).eval()
            made.append((model, export_module.export(tmp_path / f"{name}.pt", tmp_path / f"exported_{name}")))
        (f32, f32_out), (bf16, bf16_out) = made
        return f32, bf16, f32_out, bf16_out
    return make


def tokens_for(model, n=2, length=16) -> torch.Tensor:
    tokens = torch.randint(4, model.cfg.vocab_size, (n, length), generator=torch.Generator().manual_seed(0))
    tokens[:, 0] = 0  # <s>
    return tokens


@pytest.mark.parametrize("kind", KINDS)
def test_a_bfloat16_table_is_exported_and_loaded_back_as_stored(kind, exports, tmp_path):
    f32, bf16, f32_out, bf16_out = exports(kind)
    names = set(tables_of(bf16))
    assert {p.dtype for p in bf16.memory_value_parameters()} == {torch.bfloat16}
    f32_bytes, bf16_bytes = stored_bytes(f32_out / "model.safetensors"), stored_bytes(bf16_out / "model.safetensors")
    stored = names & set(bf16_bytes)  # a shared table once, under one of its names
    assert len(stored) == len(bf16.memory_value_parameters()) and f32_bytes.keys() == bf16_bytes.keys()
    assert {header(bf16_out / "model.safetensors")[k]["dtype"] for k in stored} == {"BF16"}
    for name in f32_bytes:  # the tables' bytes halved, every other tensor's as in the float32 export
        assert bf16_bytes[name] == (f32_bytes[name] // 2 if name in stored else f32_bytes[name]), name

    loaded = load_trained(bf16_out, bf16_out).model
    assert tables_of(loaded).keys() == names
    for name, table in tables_of(loaded).items():
        assert table.dtype == torch.bfloat16 and torch.equal(table, tables_of(bf16)[name]), name
        assert torch.equal(table, tables_of(f32)[name].bfloat16()), name  # drawn as float32, rounded to nearest
    tokens = tokens_for(bf16)
    with torch.no_grad():
        torch.testing.assert_close(loaded(tokens), bf16(tokens), rtol=0, atol=0)

    assert export_module.main(["--import", str(bf16_out), str(tmp_path / "back.pt")]) == 0  # the way back: as stored
    back, before = checkpoint.load(tmp_path / "back.pt")["model"], checkpoint.load(tmp_path / "bfloat16.pt")["model"]
    assert {back[name].dtype for name in names} == {torch.bfloat16}
    assert all(back[k].dtype == t.dtype and torch.equal(back[k], t) for k, t in before.items())


def auto_model(folder, **kwargs):
    transformers = pytest.importorskip("transformers")
    return transformers.AutoModelForCausalLM.from_pretrained(folder, trust_remote_code=True, **kwargs)


@pytest.mark.parametrize("kind", KINDS)
def test_transformers_reads_a_bfloat16_table_as_stored(kind, exports):
    _, bf16, _, bf16_out = exports(kind)
    model = auto_model(bf16_out)
    assert "xlm_pkm" not in type(model.lm).__module__  # the folder's code
    assert tables_of(model.lm).keys() == tables_of(bf16).keys()
    for name, table in tables_of(model.lm).items():
        assert table.dtype == torch.bfloat16 and torch.equal(table, tables_of(bf16)[name]), name
    tokens = tokens_for(bf16)
    with torch.no_grad():
        torch.testing.assert_close(model(tokens).logits, bf16(tokens), rtol=0, atol=0)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("kind", KINDS)
def test_in_half_precision_the_memory_layers_compute_in_float32_from_their_tables_as_stored(kind, dtype, exports):
    """from_pretrained(..., dtype=bf16/fp16): the memory and Engram layers stay float32 (the layer's numeric rule),
    their tables as stored, never rounded to `dtype` and back (a float32 table) nor copied to float32 (a bfloat16
    one); the rest in `dtype`. The logits are the float32-compute model's within that dtype's rounding."""
    f32, bf16, f32_out, bf16_out = exports(kind)
    for original, out, stored in ((f32, f32_out, torch.float32), (bf16, bf16_out, torch.bfloat16)):
        model = auto_model(out, dtype=dtype)
        layers = [layer for _, layer in (*model.lm.memories(), *model.lm.engrams())]
        tables = tables_of(model.lm)
        assert tables.keys() == tables_of(original).keys()
        for name, table in tables.items():
            assert table.dtype == stored and torch.equal(table, tables_of(original)[name]), (stored, name)
        table_ids = {id(t) for t in tables.values()}
        assert {p.dtype for layer in layers for p in layer.parameters() if id(p) not in table_ids} == {torch.float32}
        assert model.lm.tok_emb.weight.dtype == dtype
        tokens = tokens_for(original)
        with torch.no_grad():
            logits, reference = model(tokens).logits, original(tokens)
        assert logits.dtype == dtype
        error = ((logits.float() - reference).abs().mean() / reference.abs().mean()).item()
        assert error < (2**-5 if dtype == torch.bfloat16 else 2**-7), (stored, error)  # test_reliability_issue62's
        assert model.generate(tokens[:1, :5], max_new_tokens=4, do_sample=False).shape == (1, 9)


def test_evaluate_and_generate_read_a_bfloat16_table_as_stored(exports, tmp_path, monkeypatch, capsys):
    """evaluate.py and generate.py, on the checkpoint and on its export: the model they run holds its tables in
    bfloat16 (no float32 copy), with the same figures and text from either."""
    _, _, _, bf16_out = exports("engram")  # a value table and Engram's
    seen = []

    def spy(run):
        def wrapped(model, *args, **kwargs):
            seen.append({p.dtype for p in model.memory_value_parameters()})
            return run(model, *args, **kwargs)
        return wrapped

    monkeypatch.setattr(evaluation, "evaluate", spy(evaluation.evaluate))
    monkeypatch.setattr(cli, "generate", spy(cli.generate))
    results, texts = [], []
    for source in (tmp_path / "bfloat16.pt", bf16_out):
        assert cli.evaluate_main(["--checkpoint", str(source), "--split", "valid", "--device", "cpu", "--bptt", "16",
                                  "--max-batches", "4", "--json", str(tmp_path / "result.json")]) == 0
        results.append(json.loads((tmp_path / "result.json").read_text()))
        capsys.readouterr()
        assert cli.generate_main(["--checkpoint", str(source), "The function", "--max-tokens", "6", "--greedy",
                                  "--context", "16", "--device", "cpu"]) == 0
        texts.append(capsys.readouterr().out)
    assert seen == [{torch.bfloat16}] * 4
    checkpoint_result, folder_result = results
    assert folder_result["ppl"] == checkpoint_result["ppl"] and folder_result["tokens"] == checkpoint_result["tokens"]
    figures = [[{k: v for k, v in m.items() if k.startswith(("usage", "kl"))} for m in r["memories"] + r["engrams"]]
               for r in results]
    assert figures[0] == figures[1] and len(figures[0]) == 3  # two memories, one Engram
    assert texts[0] == texts[1] and texts[0].startswith("The function")


# Run by a Python that cannot import xlm_pkm (after test_hf_export's script up to its work: an import system blind to
# xlm_pkm, torch and transformers imported): the folder of inputs.pt (argv[1]) through transformers, loaded as trained
# and in bfloat16, its logits and tables' dtypes to outputs.pt (argv[2]).
READ_WITHOUT_XLM_PKM = '''
torch.set_num_threads(1)
inputs, outputs = torch.load(sys.argv[1]), {}
for dtype in (None, torch.bfloat16):
    model = transformers.AutoModelForCausalLM.from_pretrained(inputs["folder"], trust_remote_code=True, dtype=dtype)
    with torch.no_grad():
        logits = model(inputs["tokens"]).logits
    tables = [str(p.dtype) for p in model.lm.parameters() if getattr(p, "is_memory_value", False)]
    outputs[str(dtype)] = {"logits": logits, "tables": tables}
assert not [name for name in sys.modules if name.partition(".")[0] == "xlm_pkm"]
torch.save(outputs, sys.argv[2])
'''


@pytest.mark.slow
def test_a_bfloat16_export_loads_where_xlm_pkm_is_not_installed(exports, tmp_path):
    """The folder's own code, in a Python that cannot import xlm_pkm: the tables bfloat16 as stored, loaded as
    trained (our logits) and in bfloat16 (the memory layers float32 compute: within bfloat16's rounding)."""
    from test_hf_export import WITHOUT_XLM_PKM

    blind = WITHOUT_XLM_PKM.partition("torch.set_num_threads(1)")[0]
    torch.set_num_threads(1)  # as in the subprocess: the same float reductions
    _, bf16, _, bf16_out = exports("engram")
    tokens = tokens_for(bf16)
    with torch.no_grad():
        ours = bf16(tokens)
    torch.save({"folder": str(bf16_out), "tokens": tokens}, tmp_path / "inputs.pt")
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    env.update(HF_HOME=str(tmp_path / "hf"), HF_MODULES_CACHE=str(tmp_path / "hf_modules"), HF_HUB_OFFLINE="1")
    done = subprocess.run([sys.executable, "-c", blind + READ_WITHOUT_XLM_PKM, "inputs.pt", "outputs.pt"], cwd=tmp_path,
                          env=env, capture_output=True, text=True)
    assert done.returncode == 0, done.stderr[-3000:]
    theirs = torch.load(tmp_path / "outputs.pt")
    tables = ["torch.bfloat16"] * len(bf16.memory_value_parameters())
    assert theirs["None"]["tables"] == theirs["torch.bfloat16"]["tables"] == tables
    torch.testing.assert_close(theirs["None"]["logits"], ours, rtol=0, atol=0)
    half = theirs["torch.bfloat16"]["logits"]
    assert half.dtype == torch.bfloat16 and ((half.float() - ours).abs().mean() / ours.abs().mean()).item() < 2**-5
