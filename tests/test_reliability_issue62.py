"""Accidents of issues 62 and 63 that lost a user's file, overwrote an input, reused a stale run or said
nothing of a wrong figure, each reproduced (docs/reliability.md)."""

import json
from pathlib import Path

import pytest
import torch
from test_export import VARIANTS, random_checkpoint

from xlm_pkm.inference.export import export

ROOT = Path(__file__).resolve().parent.parent


def one_line(capsys) -> str:
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1, err
    return err[0]


# ---- 62.12: an export loaded in bf16 or fp16 runs ------------------------------------------------------
@pytest.mark.slow
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("kind", VARIANTS)
def test_an_export_loaded_in_half_precision_runs_its_memory_in_float32(kind, dtype, tiny_data_dir, tmp_path):
    """from_pretrained(..., dtype=bf16/fp16): the first forward failed ("mixed dtype (CPU)": the BatchNorm's
    parameters cast to bf16 against the float32 query). The memory layers stay float32 (the layer's numeric rule),
    the rest in `dtype`: the logits are the float32 model's within that dtype's rounding."""
    transformers = pytest.importorskip("transformers")
    original = random_checkpoint(tiny_data_dir, tmp_path / "random.pt", VARIANTS[kind]).eval()  # BatchNorm queries
    out = export(tmp_path / "random.pt", tmp_path / "exported")
    model = transformers.AutoModelForCausalLM.from_pretrained(out, trust_remote_code=True, dtype=dtype)
    assert {p.dtype for _, m in model.lm.memories() for p in m.parameters()} == {torch.float32}
    assert model.lm.tok_emb.weight.dtype == dtype
    tokens = torch.randint(4, original.cfg.vocab_size, (2, 16))
    tokens[:, 0] = 0
    with torch.no_grad():
        logits = model(tokens).logits
        reference = original(tokens)
    assert logits.dtype == dtype
    error = ((logits.float() - reference).abs().mean() / reference.abs().mean()).item()
    # the mean error relative to the logits' scale: a few roundings of the dtype (2^-8 for bf16, 2^-11 for fp16)
    # per layer, and the slots whose top-k place a rounding flips (measured: 0.007-0.009 in bf16, 0.0008-0.0025 in fp16)
    assert error < (2**-5 if dtype == torch.bfloat16 else 2**-7)
    ids = model.generate(tokens[:1, :5], max_new_tokens=4, do_sample=False)
    assert ids.shape == (1, 9)


# ---- 62.1: a re-export replaces only the files the previous export wrote -------------------------------
@pytest.mark.slow
def test_a_reexport_keeps_the_users_own_files_and_removes_only_its_own(reference_run, tmp_path, capsys):
    """`export best.pt E; echo 'print(1)' > E/analyze.py; export checkpoint.pt E` removed analyze.py (every *.py was
    taken for the previous export's code). The export lists what it wrote in export_manifest.json: only those files
    are replaced or removed; a file of one's own is kept, and refused where the export would overwrite it."""
    from xlm_pkm.inference.export import main

    run, manifest = reference_run(), "export_manifest.json"
    out = tmp_path / "E"
    assert main([str(run.best_path), str(out)]) == 0
    (out / "analyze.py").write_text("print(1)\n")
    assert main([str(run.ckpt_path), str(out)]) == 0
    assert (out / "analyze.py").read_text() == "print(1)\n"
    listed = json.loads((out / manifest).read_text())["files"]
    assert sorted(listed) == sorted(p.name for p in out.iterdir() if p.name not in (manifest, "analyze.py"))
    (out / "notes.txt").write_text("mine\n")
    (out / "old_module.py").write_text("")  # code the previous export wrote, which this one does not
    (tmp_path / "outside").write_text("mine\n")  # a manifest names files in the folder only
    (out / manifest).write_text(json.dumps({"files": [*listed, "old_module.py", "../outside"]}))
    assert main([str(run.ckpt_path), str(out)]) == 0
    assert (out / "analyze.py").read_text() == "print(1)\n" and (out / "notes.txt").read_text() == "mine\n"
    assert not (out / "old_module.py").exists() and (tmp_path / "outside").exists()
    assert sorted(json.loads((out / manifest).read_text())["files"]) == sorted(listed)

    (out / manifest).write_text(json.dumps({"files": [n for n in listed if n != "codes"]}))  # codes: the user's
    before = {p.name: p.read_bytes() for p in out.iterdir()}
    capsys.readouterr()
    assert main([str(run.best_path), str(out)]) == 2
    assert one_line(capsys).endswith(f"{out / 'codes'} was not written by the previous export (it is not in its "
                                     f"{manifest}), and this export writes a file of that name: move it away, or "
                                     f"export into another folder")
    assert {p.name: p.read_bytes() for p in out.iterdir()} == before


# ---- 62.11: an edited export config.json is refused by our loader and by the folder's own code -----------
@pytest.mark.slow
def test_an_edited_export_config_is_refused_by_both_loaders(reference_run, tmp_path, capsys):
    """n_heads 2 -> 4 in an exported config.json keeps every shape: it loaded and evaluated. The export records a
    hash of config.json's model section with the weights (and ours of every file); both loaders compare, and an
    export without those hashes (an earlier version's) is still checked against the weights' shapes."""
    from safetensors import safe_open
    from safetensors.torch import load_file, save_file

    from xlm_pkm.launch.cli import evaluate_main

    transformers = pytest.importorskip("transformers")
    out = export(reference_run().best_path, tmp_path / "E")
    config = json.loads((out / "config.json").read_text())
    assert config["model"]["n_heads"] == 2
    config["model"]["n_heads"] = 4
    (out / "config.json").write_text(json.dumps(config))
    capsys.readouterr()
    assert evaluate_main(["--checkpoint", str(out), "--max-batches", "1"]) == 2
    assert f"{out / 'config.json'}: edited since the export" in one_line(capsys)  # every file's hash (issue 83)
    with pytest.raises(ValueError, match="config.json: its model section is not the one .* was exported with"):
        transformers.AutoModelForCausalLM.from_pretrained(out, trust_remote_code=True)

    with safe_open(str(out / "model.safetensors"), "pt") as f:  # an export without the hash: shapes still checked
        metadata = {k: v for k, v in f.metadata().items() if k not in ("model_config_digest", "files_digest")}
    save_file(load_file(out / "model.safetensors"), out / "model.safetensors", metadata=metadata)
    config["model"]["n_heads"], config["model"]["memory"]["k_dim"] = 2, 32
    (out / "config.json").write_text(json.dumps(config))
    assert evaluate_main(["--checkpoint", str(out), "--max-batches", "1"]) == 2
    assert "weights of another architecture than" in one_line(capsys)
    with pytest.raises(ValueError, match="weights of another architecture than config.json"):
        transformers.AutoModelForCausalLM.from_pretrained(out, trust_remote_code=True)


# ---- 62.2 and 62.5: the facts command checks everything before writing anything ----------------------------
def files_of(folder: Path) -> dict[str, bytes]:
    return {str(p.relative_to(folder)): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}


def test_the_facts_command_never_writes_over_its_input_nor_over_other_facts(tiny_data_dir, tmp_path, capsys):
    """`--from my_facts/facts.jsonl --out my_facts` replaced the input with the derived format; a re-run with other
    facts into an existing output replaced facts.jsonl and documents.jsonl, then was refused by preprocessing
    (exit 2), leaving new facts beside the old data. Now: refused before anything is written; the same facts again
    (a re-run) are fine."""
    from xlm_pkm.experiments.facts import main

    vocab = ["--codes", str(tiny_data_dir / "codes"), "--vocab", str(tiny_data_dir / "vocab")]
    example = ROOT / "data/facts/example.jsonl"
    mine = tmp_path / "my_facts"
    mine.mkdir()
    (mine / "facts.jsonl").write_bytes(example.read_bytes())
    capsys.readouterr()
    assert main(["--from", str(mine / "facts.jsonl"), "--out", str(mine), *vocab]) == 2
    assert f"--from {mine / 'facts.jsonl'} is inside --out {mine}, which this command writes into" in one_line(capsys)
    assert files_of(mine) == {"facts.jsonl": example.read_bytes()}

    out = tmp_path / "out"
    assert main(["--from", str(example), "--out", str(out), *vocab]) == 0
    assert main(["--from", str(example), "--out", str(out), *vocab]) == 0  # the same facts: a re-run
    before = files_of(out)
    other = tmp_path / "other.jsonl"
    other.write_text("".join(example.read_text().splitlines(keepends=True)[:3]))
    capsys.readouterr()
    assert main(["--from", str(other), "--out", str(out), *vocab]) == 2
    assert one_line(capsys).endswith(f"--out {out} is not empty and not these facts' output (its facts.jsonl is not "
                                     f"these facts' (another --from, --seed or --copies)): give a new or empty "
                                     f"folder, or delete that one; nothing was written")
    assert files_of(out) == before
    (tmp_path / "notes").mkdir()
    (tmp_path / "notes" / "todo.txt").write_text("mine\n")
    assert main(["--from", str(example), "--out", str(tmp_path / "notes"), *vocab]) == 2
    assert "(it holds todo.txt)" in one_line(capsys)
    assert files_of(tmp_path / "notes") == {"todo.txt": b"mine\n"}


def test_facts_whose_answer_reads_as_unk_are_refused_naming_them(tiny_data_dir, tmp_path, capsys):
    """東京 and 大阪 encode to [<unk>, <unk>]: the forced choice between them tied and exact match credited a model
    that says <unk>. Refused before anything is written, naming those facts."""
    from xlm_pkm.experiments.facts import main

    rows = [{"statements": ["The capital of Japan is 東京."], "answer": "東京", "subject": "Japan"},
            {"statements": ["The leader is Smith."], "answer": "Smith"},
            {"statements": ["The port of Kansai is 大阪."], "answer": "大阪", "subject": "Kansai"}]
    own = tmp_path / "mine.jsonl"
    own.write_text("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in rows), encoding="utf-8")
    capsys.readouterr()
    assert main(["--from", str(own), "--out", str(tmp_path / "out"), "--codes", str(tiny_data_dir / "codes"),
                 "--vocab", str(tiny_data_dir / "vocab")]) == 2
    assert (f"2 fact(s) have an answer with a word outside {tiny_data_dir / 'vocab'} (it reads as <unk>): 'Japan' "
            f"('東京'), 'Kansai' ('大阪'); give answers") in one_line(capsys)
    assert not (tmp_path / "out").exists()


# ---- 62.7 and 62.18: overrides and YAML files read as written --------------------------------------------
@pytest.mark.parametrize("given", ["0123", "12:30", "0x1F", "2024-01-05", "010", "8"])
def test_a_run_id_is_the_text_given(given):
    """train.exp_id was parsed as YAML: 0123 -> run 83, 12:30 -> 750, 0x1F -> 31 (010 and 8 one run), 2024-01-05 a
    type error. A string setting takes the override's text; the other keys keep their YAML typing."""
    from xlm_pkm.config import load_config

    assert load_config(None, [f"train.exp_id={given}", f"train.exp_name={given}"]).train.exp_id == given
    cfg = load_config(None, ["train.max_steps=0x1F", "optim.lr=1e-4", "model.mem_layers=[1, 2]",
                             "train.exp_id='0123'", "train.compile=true"])
    assert (cfg.train.max_steps, cfg.optim.lr, cfg.model.mem_layers, cfg.train.exp_id, cfg.train.compile) == (
        31, 1e-4, [1, 2], "0123", True)


def test_a_yaml_merge_key_is_read_and_a_file_not_utf8_is_named(tmp_path, capsys):
    """`<<:` was refused as "not valid YAML" by the duplicate-key loader; a file that is not UTF-8 gave a decode
    error naming no file."""
    from xlm_pkm.config import ConfigError, load_config
    from xlm_pkm.launch.cli import train_main

    path = tmp_path / "merge.yaml"
    path.write_text("model: &small\n  dim: 64\n  n_heads: 2\noptim:\n  <<: {lr: 0.002, warmup_steps: 7}\n  lr: 0.003\n")
    cfg = load_config(path)
    assert (cfg.model.dim, cfg.optim.lr, cfg.optim.warmup_steps) == (64, 0.003, 7)  # a key given here wins
    path.write_text("optim:\n  <<: {lr: 0.002}\n  lr: 0.003\n  lr: 0.004\n")
    with pytest.raises(ConfigError, match="key 'lr' given twice"):
        load_config(path)
    path.write_bytes("model:\n  dim: 64  # caf\u00e9\n".encode("latin-1"))
    with pytest.raises(ConfigError, match=f"{path}: not UTF-8 text"):
        load_config(path)
    assert train_main(["--config", str(path), "--keys", "model"]) == 2
    assert one_line(capsys) == (f"train.py: error: {path}: not UTF-8 text (byte b'\\xe9' at offset 23): save it "
                                f"as UTF-8")


# ---- 62.15, 62.4, 63.6: what a resume reads from the run directory -------------------------------------
def resume_argv(dump, *extra):
    """What a user types to resume the latest tiny run: its id (last) and the new budget, nothing else."""
    return [f"train.dump_path={dump}", "train.exp_name=tiny", "train.exp_id=last", *extra]


@pytest.mark.parametrize("text, why", [("model: [dim: 3\n", "not valid YAML"),
                                       ("- a\n- b\n", "expected a mapping at the top level")])
@pytest.mark.slow
def test_a_damaged_config_yaml_on_resume_is_one_line(text, why, tiny_overrides, tmp_path, capsys):
    from xlm_pkm.launch.cli import train_main

    assert train_main(["--no-test", *tiny_overrides(tmp_path, "train.exp_id=r", "train.max_steps=4")]) == 0
    (tmp_path / "tiny" / "r" / "config.yaml").write_text(text)
    capsys.readouterr()
    assert train_main(resume_argv(tmp_path, "train.max_steps=8")) == 2
    line = one_line(capsys)
    assert line.startswith(f"train.py: error: {tmp_path / 'tiny' / 'r' / 'config.yaml'}: {why}")
    assert line.endswith("the run resumes from this file: fix it, or move it away to resume with the command "
                         "line's config (checked against the checkpoint's)")


@pytest.mark.slow
def test_a_hand_edited_config_yaml_is_logged_on_resume_and_no_test_is_kept(tiny_overrides, tmp_path):
    """config.yaml edited by hand (optim.lr 0.003 -> 0.5) applied on `exp_id=last` without a word: the 'resumed with
    another config' line compared the resumed config with config.yaml, the file it starts from, so it listed only
    the command line's train.max_steps. It compares with the checkpoint's config. And a run started with --no-test
    resumed by `exp_id=last` ran the test evaluation; run again once finished, it said only 'resumed at step 8'."""
    import yaml

    from xlm_pkm.launch.cli import train_main

    assert train_main(["--no-test", *tiny_overrides(tmp_path, "train.exp_id=r", "train.max_steps=4")]) == 0
    run = tmp_path / "tiny" / "r"
    config = yaml.safe_load((run / "config.yaml").read_text())
    config["optim"]["lr"] = 0.5
    (run / "config.yaml").write_text(yaml.safe_dump(config))
    assert train_main(resume_argv(tmp_path, "train.max_steps=8")) == 0
    log = (run / "train.log").read_text()
    changed = next(line for line in log.splitlines() if "resumed with another config than the run's" in line)
    assert changed.endswith("config.until-step4.yaml): optim.lr: 0.003 -> 0.5; train.max_steps: 4 -> 8")
    events = [json.loads(line)["event"] for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert "test" not in events  # --no-test kept
    again = [f"train.dump_path={tmp_path}", "train.exp_name=tiny", "train.exp_id=r", "train.max_steps=8"]
    assert train_main(again) == 0  # the same run again, once finished (make demo twice): it says so, does nothing
    assert "the run is already finished (step 8 of train.max_steps=8): nothing to train; to train it further, give a " \
           "larger train.max_steps" in (run / "train.log").read_text()
    assert [json.loads(line)["event"] for line in (run / "metrics.jsonl").read_text().splitlines()] == events


# ---- 62.8: a checkpoint is good when its validation is finite -------------------------------------------
def test_a_diverged_run_saves_no_checkpoint_of_its_nan_validation(tiny_overrides, tmp_path, capsys):
    """With lr 1e9 the valid perplexity was NaN at the evaluation, yet checkpoint.pt was written there and named the
    last good one (its weights finite, about 1e9). A non-finite validation stops the run before that save."""
    import torch as torch_

    from xlm_pkm.launch.cli import train_main

    argv = ["--no-test", *tiny_overrides(tmp_path, "train.exp_id=r", "train.eval_every=4", "optim.lr=1e9",
                                          "optim.values_lr=1e9", "optim.warmup_steps=1")]
    assert train_main(argv) == 2
    line = one_line(capsys)
    run = tmp_path / "tiny" / "r"
    valid = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines() if '"valid"' in x]
    assert valid and not torch_.isfinite(torch_.tensor(valid[-1]["ppl"]))
    assert f"valid perplexity is nan at step {valid[-1]['step']}: the run diverged" in line
    assert not (run / "checkpoint.pt").exists() and line.endswith("No checkpoint was written by this run")


def test_evaluate_on_weights_whose_perplexity_is_nan_says_so_and_fails(reference_run, tmp_path, capsys):
    """evaluate.py printed `valid ppl nan` and exited 0 on a diverged run's checkpoint (finite weights of about
    1e9-1e38): the figure is printed, then one line and status 2; --json is not written."""
    from xlm_pkm.checkpoint import files as checkpoint
    from xlm_pkm.launch.cli import evaluate_main

    state = checkpoint.load(reference_run().best_path)
    state["model"]["tok_emb.weight"] = state["model"]["tok_emb.weight"] * 1e37  # finite; logits overflow
    diverged = tmp_path / "diverged.pt"
    checkpoint.save_atomic(state, diverged)
    capsys.readouterr()
    assert evaluate_main(["--checkpoint", str(diverged), "--split", "valid", "--max-batches", "1",
                          "--json", str(tmp_path / "result.json")]) == 2
    out, err = capsys.readouterr()
    assert out.startswith("valid ppl nan over ")
    assert err == (f"evaluate.py: error: {diverged}: valid perplexity is nan: its weights give no finite prediction "
                   f"(a diverged run's checkpoint); evaluate an earlier one (the run's best.pt), "
                   f"{tmp_path / 'result.json'} not written\n")
    assert not (tmp_path / "result.json").exists()
