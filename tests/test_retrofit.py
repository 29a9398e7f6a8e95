"""model.base (model/retrofit.py): memories beside the MLPs of a pretrained Hugging Face causal LM. The base is a
tiny random Llama made here, with its own tokenizer (conftest.tiny_base), and the tiny corpus made with that
tokenizer (conftest.tiny_base_data): the base's logits at step 0, what trains, the data's ids, the commands on a
retrofitted run (resume, evaluate, generate, export), a changed base refused, the config's errors."""

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from conftest import logged_losses
from test_hf_export import WITHOUT_XLM_PKM

from xlm_pkm.checkpoint.trained import load_trained
from xlm_pkm.config import load_config
from xlm_pkm.data.dictionary import Dictionary
from xlm_pkm.data.shard import read_shard
from xlm_pkm.data.text_codec import text_codec
from xlm_pkm.errors import ConfigError
from xlm_pkm.inference.export import export
from xlm_pkm.inference.generation import generate
from xlm_pkm.inference.sampling import Sampling
from xlm_pkm.launch.cli import evaluate_main, generate_main
from xlm_pkm.model.retrofit import RetrofitLM, load_base, resolved, sized
from xlm_pkm.train.trainer import Trainer

transformers = pytest.importorskip("transformers")

MEMORY = ["model.memory.n_keys=8", "model.memory.k_dim=16", "model.memory.heads=2", "model.memory.knn=4",
          "model.memory.query_norm=layernorm"]
VARIANTS = {"pkm": [], "peer": ["model.memory.values=peer"],
            "ultramem": ["model.memory.key_type=tucker", "model.memory.tucker.cores=2", "model.memory.values=expanded",
                         "model.memory.expanded.expansion=2", "model.memory.score=identity"]}
RUN = ["data.batch_size=4", "data.eval_batch_size=8", "data.bptt=16", "optim.lr=3e-3", "optim.warmup_steps=2",
       "optim.values_lr=1e-2", "train.device=cpu", "train.log_every=1", "train.eval_every=1000",
       "train.eval_max_batches=2", "train.max_steps=4", "train.exp_name=retro", "train.num_threads=1"]
LORA = ["optim.lora.rank=2", "optim.lora.alpha=4"]


def model_overrides(base, *extra) -> list[str]:
    return [f"model.base.path={base}", "model.base.layers=[2]", *MEMORY, *extra]


def make_trainer(base, data, dump, exp_id: str, *extra) -> Trainer:
    """A Trainer of a retrofit of `base` on its tokenizer's `data`, its run under `dump`."""
    return Trainer(load_config(None, [*model_overrides(base), f"data.path={data}", f"train.dump_path={dump}", *RUN,
                                      f"train.exp_id={exp_id}", *extra]))


@pytest.fixture
def retrofit_trainer(tiny_base, tiny_base_data, tmp_path):
    """trainer(exp_id, *extra, base=tiny_base): make_trainer under tmp_path."""
    return lambda exp_id, *extra, base=tiny_base: make_trainer(base, tiny_base_data, tmp_path, exp_id, *extra)


def trained(trainer: Trainer) -> Trainer:
    try:
        trainer.train()
    finally:
        trainer.close()
    return trainer


@pytest.fixture(scope="module")
def full_run(tiny_base, tiny_base_data, tmp_path_factory):
    """(a retrofit trained 4 steps, its trained tensors before): shared by the tests that read a finished run."""
    trainer = make_trainer(tiny_base, tiny_base_data, tmp_path_factory.mktemp("retro"), "full")
    before = {k: v.clone() for k, v in trainer.model.state_dict().items()}
    return trained(trainer), before


@pytest.mark.parametrize("variant", VARIANTS)
def test_at_step_0_the_logits_are_the_base_s_and_the_gate_opens_first(tiny_base, variant):
    cfg = load_config(None, model_overrides(tiny_base, *VARIANTS[variant])).model
    base = transformers.AutoModelForCausalLM.from_pretrained(tiny_base)
    model = RetrofitLM(resolved(cfg), load_base(cfg.base))
    x = torch.randint(0, model.cfg.vocab_size, (2, 12))
    assert (model(x) - base(x).logits).abs().max() <= 1e-5  # float32: the gate's zeros add exact zeros
    model(x, targets=x).mean().backward()
    with_grad = {name for name, p in model.named_parameters() if p.grad is not None and bool(p.grad.any())}
    assert with_grad == {"beside.2.gate"}  # the base frozen; the memory trains once the gate has opened
    opened = RetrofitLM(resolved(cfg), load_base(cfg.base))
    opened.load_state_dict({**model.state_dict(), "beside.2.gate": torch.full((32,), 0.5)})
    assert (opened(x) - base(x).logits).abs().max() > 1e-3  # the memory is wired in


def test_the_shift_beside_a_memory_adds_its_vector_to_the_mlp_s_output(tiny_base):
    """model.base.shift: 0 at step 0 (the base's logits), trained from the first step with the gate; set to v with
    the gate shut, the model is the base whose layer-2 MLP output has v added (a hook on a plain base)."""
    cfg = load_config(None, model_overrides(tiny_base, "model.base.shift=true")).model
    model = RetrofitLM(resolved(cfg), load_base(cfg.base))
    base = transformers.AutoModelForCausalLM.from_pretrained(tiny_base)
    counts = model.param_counts()  # the log's parts of the dense parameters: the shift has its own
    assert counts["shifts"] == 32 and counts["dense"] == counts["base"] + counts["memory"] + counts["gates"] + 32
    x = torch.randint(0, model.cfg.vocab_size, (2, 12))
    assert (model(x) - base(x).logits).abs().max() <= 1e-5
    model(x, targets=x).mean().backward()
    assert {name for name, p in model.named_parameters() if p.grad is not None and bool(p.grad.any())} == \
        {"beside.2.gate", "beside.2.shift"}
    v = torch.randn(32)
    model.load_state_dict({**model.state_dict(), "beside.2.shift": v})
    base.model.layers[1].mlp.register_forward_hook(lambda mlp, args, out: out + v)
    with torch.no_grad():
        assert (model(x) - base(x).logits).abs().max() <= 1e-5


def test_a_retrofit_with_a_shift_exports_and_a_run_from_it_is_told_its_settings(retrofit_trainer, tmp_path):
    """The trained shift goes into the export (transformers' logits are ours); a run started from the checkpoint
    without model.base.shift is refused with the setting that gives it the trained model's tensors."""
    best = trained(retrofit_trainer("shift", "model.base.shift=true", "train.max_steps=2")).run_dir / "best.pt"
    trained_model = load_trained(best)
    assert trained_model.model.beside["2"].shift.abs().sum() > 0
    with pytest.raises(ConfigError, match=r"dropped: beside.2.shift; the trained model's settings: "
                                          r"model.base.shift=true \(here: false\)\)"):
        retrofit_trainer("from_shift", f"train.init_from={best}")
    x = torch.tensor([trained_model.codec().encode("The module said")])
    hf = transformers.AutoModelForCausalLM.from_pretrained(export(best, tmp_path / "exported"), trust_remote_code=True)
    with torch.no_grad():
        assert torch.equal(hf(x).logits, trained_model.model(x))


def test_a_qwen2_base_takes_a_memory_as_well(tmp_path):
    """Qwen2 (biases in attention, its own names) as a Llama: the base's logits at step 0, its cache in decoding."""
    config = transformers.Qwen2Config(vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=3,
                                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=32)
    torch.manual_seed(0)
    transformers.Qwen2ForCausalLM(config).save_pretrained(tmp_path / "qwen2")
    cfg = load_config(None, [f"model.base.path={tmp_path / 'qwen2'}", *MEMORY]).model  # layers: L - L//4 = 3
    base = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "qwen2")
    model = RetrofitLM(resolved(cfg), load_base(cfg.base)).eval()
    x = torch.randint(0, 64, (2, 10))
    with torch.no_grad():
        assert model.memories()[0][0] == 3 and (model(x) - base(x).logits).abs().max() <= 1e-5
        cache = model.new_cache()
        steps = torch.cat([model(x[:, :6], cache=cache), model(x[:, 6:], cache=cache)], dim=1)
        torch.testing.assert_close(steps, model(x), rtol=1e-5, atol=1e-5)


def test_the_data_holds_the_tokenizer_s_own_ids(tiny_base, tiny_base_data, tiny_corpus):
    tokenizer = transformers.AutoTokenizer.from_pretrained(tiny_base)
    dictionary = Dictionary.load(tiny_base_data / "vocab")
    assert len(dictionary) == len(tokenizer) and dictionary.eos == dictionary.bos == tokenizer.eos_token_id
    meta = json.loads((tiny_base_data / "meta.json").read_text())
    assert meta["unit"] == "tokenizer" and "tokenizer.json" in meta["files"]
    texts = [json.loads(line)["text"] for line in tiny_corpus.read_text().splitlines()]
    shards = [read_shard(tiny_base_data / e["file"]) for split in ("train", "valid", "test")
              for e in meta["splits"][split]]
    documents = sorted(s.tokens[a:b].tolist() for s in shards
                       for a, b in zip(s.doc_starts.tolist(), [*s.doc_starts[1:].tolist(), len(s.tokens)]))
    assert documents == sorted(tokenizer(t)["input_ids"] + [tokenizer.eos_token_id] for t in texts)
    codec = text_codec(tiny_base_data, "tokenizer")
    assert codec.encode("The module") == tokenizer("The module")["input_ids"]
    assert codec.decode(codec.encode("The module")) == "The module"
    words = dictionary.word_end_mask()  # a word starts with Ġ (byte-level BPE)
    assert words.any() and all(dictionary.words[i].startswith("\u0120") for i in words.nonzero()[0])


def test_only_the_memory_trains_and_a_checkpoint_holds_only_it(full_run, tiny_base):
    trainer, own = full_run
    assert set(own) == {k for k in own if k.startswith("beside.2.")}
    base = transformers.AutoModelForCausalLM.from_pretrained(tiny_base).state_dict()
    assert all(torch.equal(v, trainer.model.base.state_dict()[k]) for k, v in base.items())  # bit for bit
    assert all(not torch.equal(v, trainer.model.state_dict()[k]) for k, v in own.items() if v.is_floating_point()
               and "norm" not in k)  # every memory weight and the gate moved
    saved = torch.load(trainer.run_dir / "best.pt", weights_only=False)
    assert set(saved["model"]) <= set(own)
    assert saved["config"]["model"]["base"]["digest"] and saved["config"]["model"]["dim"] == 32


def test_with_lora_the_adapters_train_with_the_memory_and_the_base_stays(retrofit_trainer):
    pytest.importorskip("peft")
    trainer = retrofit_trainer("lora", *LORA)
    base = {k: v.clone() for k, v in trainer.model.base.state_dict().items() if ".lora_" not in k}
    names = {n for n, p in trainer.model.named_parameters() if p.requires_grad}
    assert any("q_proj.lora_A" in n for n in names) and any("down_proj.lora_B" in n for n in names)
    assert "beside.2.gate" in names and not [n for n in names if ".lora_" not in n and not n.startswith("beside.")]
    trained(trainer)
    after = trainer.model.base.state_dict()
    assert all(torch.equal(v, after[k]) for k, v in base.items())
    loaded = load_trained(trainer.run_dir / "best.pt").model  # the adapters merged into the base's weights
    x = torch.randint(0, 300, (2, 12))
    trainer.model.eval()
    with torch.no_grad():
        torch.testing.assert_close(loaded(x), trainer.model(x), rtol=1e-4, atol=1e-5)
    with pytest.raises(ConfigError, match="a retrofit trained with LoRA adapters"):  # a new run would lose them
        retrofit_trainer("from_lora", f"train.init_from={trainer.run_dir / 'best.pt'}")


def test_a_retrofit_resumes_exactly(full_run, retrofit_trainer):
    full, _ = full_run
    trained(retrofit_trainer("cut", "train.max_steps=2"))
    resumed = trained(retrofit_trainer("cut"))
    assert resumed.resumed and logged_losses(resumed.run_dir) == logged_losses(full.run_dir)
    for name, p in full.model.state_dict().items():
        assert torch.equal(p, resumed.model.state_dict()[name]), name


FULL = ["model.base.trainable=true", "optim.trainable=[base.model.layers.1.mlp.*,beside.*]", "optim.lr=1e-2"]


@pytest.mark.slow
def test_full_finetuning_trains_the_base_s_named_weights_and_its_checkpoints_hold_them(retrofit_trainer, tiny_base,
                                                                                      tmp_path):
    """model.base.trainable: the base's weights that optim.trainable names train (here one layer's MLP), the others
    stay the base's bit for bit; best.pt holds every weight; evaluation and export read them; a cut run resumes to the
    same weights and losses bit for bit."""
    whole = trained(retrofit_trainer("whole", *FULL))
    base = transformers.AutoModelForCausalLM.from_pretrained(tiny_base).state_dict()
    after = {k.removeprefix("base."): v for k, v in whole.model.state_dict().items() if k.startswith("base.")}
    assert after.keys() == base.keys()
    changed = {k for k, v in base.items() if not torch.equal(v, after[k])}
    assert changed == {f"model.layers.1.mlp.{p}_proj.weight" for p in ("gate", "up", "down")}
    saved = torch.load(whole.run_dir / "best.pt", weights_only=False)["model"]
    assert {f"base.{k}" for k in base} <= saved.keys() and torch.equal(saved["base.model.layers.1.mlp.up_proj.weight"],
                                                                       after["model.layers.1.mlp.up_proj.weight"])
    x = torch.randint(0, 300, (2, 12))
    whole.model.eval()
    with torch.no_grad():
        ours = whole.model(x)
        assert torch.equal(load_trained(whole.run_dir / "best.pt").model(x), ours)
        folder = export(whole.run_dir / "best.pt", tmp_path / "exported")  # base/ holds the trained base
        hf = transformers.AutoModelForCausalLM.from_pretrained(folder, trust_remote_code=True)
        assert torch.equal(hf(x).logits, ours)
    exported = json.loads((folder / "config.json").read_text())["model"]["base"]
    assert exported["trainable"] is False and not any(k.startswith("base.") for k in load_trained(folder, folder)
                                                      .model.state_dict())
    trained(retrofit_trainer("cut", *FULL, "train.max_steps=2"))
    resumed = trained(retrofit_trainer("cut", *FULL))
    assert resumed.resumed and logged_losses(resumed.run_dir) == logged_losses(whole.run_dir)
    for name, p in whole.model.state_dict().items():
        assert torch.equal(p, resumed.model.state_dict()[name]), name


@pytest.mark.slow
def test_full_finetuning_starts_from_a_retrofit_whose_base_was_frozen_not_the_reverse(full_run, retrofit_trainer):
    frozen = full_run[0].run_dir / "best.pt"
    full = retrofit_trainer("from_frozen", "model.base.trainable=true", f"train.init_from={frozen}")
    try:
        assert full.initialised.new == [] and full.initialised.dropped == []  # the base's weights: from its files
        source = full_run[0].model.state_dict()
        assert all(torch.equal(full.model.state_dict()[k], v) for k, v in source.items())
        trained(full)
    finally:
        full.close()
    with pytest.raises(ConfigError, match="model.base.trainable=true$"):
        retrofit_trainer("back", f"train.init_from={full.run_dir / 'best.pt'}")


def test_with_lora_a_retrofit_may_train_its_adapters_alone(retrofit_trainer):
    pytest.importorskip("peft")
    trainer = retrofit_trainer("lora_only", *LORA, 'optim.trainable=["*.lora_A.*","*.lora_B.*"]')
    names = {n for n, p in trainer.model.named_parameters() if p.requires_grad}
    assert names and all(".lora_" in n for n in names)


@pytest.mark.slow
def test_evaluate_generate_and_export_a_retrofit(full_run, tmp_path, capsys):
    best = str(full_run[0].run_dir / "best.pt")
    assert evaluate_main(["--checkpoint", best, "--split", "valid", "--json", str(tmp_path / "r.json")]) == 0
    result = json.loads((tmp_path / "r.json").read_text())
    assert result["ppl"] > 1 and result["words"] > 0 and [m["layer"] for m in result["memories"]] == [2]
    assert 0 < result["memories"][0]["usage"] <= 100 and result["memories"][0]["kl"] >= 0
    capsys.readouterr()
    assert generate_main(["The module", "--checkpoint", best, "--greedy", "--max-tokens", "5"]) == 0
    assert capsys.readouterr().out.startswith("The module")
    trained_model = load_trained(best)
    folder = export(best, tmp_path / "exported")
    assert (folder / "base" / "model.safetensors").is_file() and (folder / "tokenizer.json").is_file()
    x = torch.tensor([trained_model.codec().encode("The module said")])
    hf = transformers.AutoModelForCausalLM.from_pretrained(folder, trust_remote_code=True)
    with torch.no_grad():
        assert torch.equal(hf(x).logits, trained_model.model(x))
        assert torch.equal(load_trained(folder, folder).model(x), trained_model.model(x))
    tokenizer = transformers.AutoTokenizer.from_pretrained(folder, trust_remote_code=True)
    assert tokenizer("The module said")["input_ids"] == x[0].tolist()
    new = hf.generate(x, max_new_tokens=4, do_sample=False)[0, x.shape[1]:].tolist()  # the base's DynamicCache
    eos = trained_model.dictionary.eos  # where transformers' generate() stops, and ours with stop=eos
    ours = generate(trained_model.model, x[0].tolist(), 4, Sampling(greedy=True), stop=eos)[0]
    assert new in (ours, [*ours, eos])


def test_a_changed_base_is_refused_on_resume_and_evaluation(retrofit_trainer, tiny_base, tmp_path, capsys):
    base = tmp_path / "base"
    shutil.copytree(tiny_base, base)
    run = trained(retrofit_trainer("changed", "train.max_steps=2", base=base))
    model = transformers.AutoModelForCausalLM.from_pretrained(base)
    with torch.no_grad():
        model.model.norm.weight.mul_(2)
    model.save_pretrained(base)
    capsys.readouterr()
    assert evaluate_main(["--checkpoint", str(run.run_dir / "best.pt"), "--max-batches", "1"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "model.base.path: the files of" in err[0] and "changed since the run recorded" in err[0]
    with pytest.raises(ConfigError, match="model.base.digest"):  # resumed with today's config: its digest differs
        retrofit_trainer("changed", base=base)


@pytest.mark.parametrize(("extra", "error"), [
    ([], r"^model.base.layers: the base has decoder layers 1 to 2, got \[3\]$"),
    (["model.n_memories=1"], r"^model.n_memories=1: a retrofit \(model.base.path\) places its memories at"),
    (["train.parallel=fsdp"], r"^train.parallel=fsdp: a retrofit"),
    (["optim.trainable=memory_values"], r"^optim.trainable=memory_values: the memories' gates stay at"),
    (["model.base.trainable=true", *LORA], r"^model.base.trainable: LoRA \(optim.lora.rank=2\) adapts a frozen base"),
])
def test_bad_retrofit_settings_are_one_line_errors(retrofit_trainer, extra, error):
    with pytest.raises(ConfigError, match=error):
        retrofit_trainer("bad", *(extra or ["model.base.layers=[3]"]))


def test_layers_without_a_base_are_refused_and_a_base_without_layers_takes_the_paper_s_place(tiny_base):
    with pytest.raises(ConfigError, match=r"^model.base.layers: set model.base.path"):
        load_config(None, ["model.base.layers=[1]"])
    with pytest.raises(ConfigError, match=r"^model.base.trainable: set model.base.path"):
        load_config(None, ["model.base.trainable=true"])
    for n_layers, layer in ((2, 2), (30, 23), (12, 9)):  # L - L//4: transformer.memory_layers's top memory
        base_config = transformers.LlamaConfig(num_hidden_layers=n_layers)
        assert sized(load_config(None, [f"model.base.path={tiny_base}"]).model, base_config).base.layers == [layer]


@pytest.mark.slow
def test_an_exported_retrofit_loads_where_xlm_pkm_is_not_installed(full_run, tmp_path):
    folder = export(full_run[0].run_dir / "best.pt", tmp_path / "exported")
    trained_model = load_trained(folder, folder)
    tokens = torch.tensor([trained_model.codec().encode("The module said that")])
    torch.save({"folders": {"retrofit": str(folder)}, "tokens": tokens, "prompt": tokens[:, :4], "new_tokens": 4,
                "text": "The module said that"}, tmp_path / "inputs.pt")
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    done = subprocess.run([sys.executable, "-c", WITHOUT_XLM_PKM, "inputs.pt", "outputs.pt"], cwd=tmp_path, env=env,
                          capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-2000:]
    outputs = torch.load(tmp_path / "outputs.pt")
    with torch.no_grad():
        torch.testing.assert_close(outputs["retrofit"]["logits"], trained_model.model(tokens), rtol=0, atol=1e-5)
    assert outputs["tokenizer"] == tokens[0].tolist()


@pytest.mark.slow
def test_a_retrofit_trains_under_torchrun_as_on_one_process(full_run, tiny_base, tiny_base_data, tmp_path):
    """train.py under torchrun, 2 processes of 2 streams each (DDP), against one process of the same 4 streams:
    the same losses and weights, to float rounding (gradients averaged over the ranks)."""
    one, _ = full_run
    overrides = [*model_overrides(tiny_base), f"data.path={tiny_base_data}", f"train.dump_path={tmp_path}", *RUN,
                 "train.exp_id=two", "data.batch_size=2", "model.n_memories=0"]  # (configs/default.yaml's: 1)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
           str(Path(__file__).resolve().parents[1] / "train.py"), "--no-test", *overrides]
    done = subprocess.run(cmd, cwd=tmp_path, capture_output=True, text=True, timeout=600,
                          env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert done.returncode == 0, done.stderr[-3000:]
    two = load_trained(tmp_path / "retro" / "two" / "checkpoint.pt").model
    losses = logged_losses(tmp_path / "retro" / "two")
    assert losses.keys() == logged_losses(one.run_dir).keys()
    for step, loss in logged_losses(one.run_dir).items():
        assert loss == pytest.approx(losses[step], rel=1e-5), step
    for name, p in one.model.state_dict().items():
        torch.testing.assert_close(two.state_dict()[name], p, rtol=1e-4, atol=1e-5)
