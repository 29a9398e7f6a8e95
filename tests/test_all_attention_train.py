"""The all-attention family through the trainer and evaluate.py, at character level: exact resume with
the stream caches in the state, bpc against an independent computation, a product-key memory mixed in,
fresh evaluation streams at every pass, the accumulation warning, sampling and export without BPE."""

import json
import math

import pytest
import torch
import torch.nn.functional as F

from xlm_pkm.checkpoint import files as checkpoint
from xlm_pkm.checkpoint.trained import load_trained
from xlm_pkm.config import load_config, load_config_dict
from xlm_pkm.data.bytes import preprocess_bytes
from xlm_pkm.data.stream import TokenStream
from xlm_pkm.data.text_codec import ByteCodec
from xlm_pkm.errors import ConfigError
from xlm_pkm.inference.export import export
from xlm_pkm.launch.cli import evaluate_main, generate_main
from xlm_pkm.model.transformer import TransformerLM
from xlm_pkm.train.build import resolved_config
from xlm_pkm.train.evaluation import evaluate

ALL_ATTENTION = ["model.family=all_attention", "model.sublayers=[all_attention]", "model.persistent_vectors=8",
                 "model.span.max_span=32", "model.span.ramp=4", "model.span.loss_coeff=1e-3",
                 "data.shuffle_blocks=false", "optim.optimizer=adagrad", "optim.lr=0.05", "optim.clip_per_tensor=0.03",
                 "optim.schedule=linear_warmup"]


@pytest.fixture(scope="module")
def char_data(tiny_corpus, tmp_path_factory):
    """The tiny corpus at character level (byte shards, meta.json unit "byte")."""
    out = tmp_path_factory.mktemp("chars") / "tiny"
    preprocess_bytes(tiny_corpus, out, mode="fractions", held_out_fraction=0.02)
    return out


@pytest.fixture(scope="module")
def char_overrides(char_data):
    return [f"data.path={char_data}", *ALL_ATTENTION]


@pytest.mark.slow
def test_resume_with_stream_caches_equals_the_uninterrupted_run(tiny_run, train_losses, char_overrides, tmp_path):
    full = tiny_run(tmp_path, "train.exp_id=full", *char_overrides)
    tiny_run(tmp_path, "train.exp_id=cut", "train.max_steps=3", *char_overrides)
    saved = checkpoint.load(tmp_path / "tiny" / "cut" / "checkpoint.pt")["train_state"][0]["stream_cache"]
    assert len(saved) == 2 and all(c is not None and c.shape[0] == 4 for c in saved)  # each layer's (B, C, D)
    resumed = tiny_run(tmp_path, "train.exp_id=cut", *char_overrides)
    assert train_losses(resumed.run_dir) == train_losses(full.run_dir)  # bit-identical, float32 CPU
    for name, p in full.model.state_dict().items():
        assert torch.equal(p, resumed.model.state_dict()[name]), name
    for a, b in zip(full.model.stream_state(), resumed.model.stream_state()):
        assert torch.equal(a, b)
    assert all(0 <= float(z) <= 1 for span in full.model.spans() for z in span.z.detach())  # clamped after updates


def test_evaluate_reports_bpc_equal_to_an_independent_computation(tiny_run, char_overrides, char_data, tmp_path):
    run = tiny_run(tmp_path, "train.exp_id=bpc", "train.max_steps=4", *char_overrides)
    report = tmp_path / "eval.json"
    assert evaluate_main(["--checkpoint", str(run.best_path), "--split", "valid", "--json", str(report)]) == 0
    result = json.loads(report.read_text())
    state = checkpoint.load(run.best_path)
    cfg = load_config_dict(state["config"])
    model = TransformerLM(cfg.model)
    model.load_state_dict(state["model"])
    model.eval()
    nll, tokens = 0.0, 0
    with torch.no_grad():  # the whole valid split, streams in order, caches carried from block to block
        for x, y in TokenStream(char_data, "valid", cfg.data.eval_batch_size or cfg.data.batch_size, cfg.data.bptt,
                                train=False):
            logp = F.log_softmax(model(x).double(), dim=-1)
            nll -= logp.gather(-1, y[..., None]).sum().item()
            tokens += y.numel()
    assert result["tokens"] == tokens
    assert math.isclose(result["bpc"], nll / tokens / math.log(2), rel_tol=1e-6)


def test_all_attention_with_a_product_key_memory_trains(tiny_run, train_losses, char_overrides, tmp_path):
    run = tiny_run(tmp_path, "train.exp_id=pkm", "train.max_steps=2", *char_overrides)  # TINY: a memory at layer 2
    assert [layer for layer, _ in run.model.memories()] == [2]
    assert sorted(train_losses(run.run_dir)) == [1, 2]


def test_shuffled_blocks_are_refused_for_a_model_that_carries_a_cache(char_overrides):
    with pytest.raises(ConfigError, match="data.shuffle_blocks: all_attention carries its cache"):
        load_config(None, [*char_overrides, "data.shuffle_blocks=true"])


@pytest.mark.slow
def test_two_evaluation_passes_on_a_model_already_in_eval_mode_are_equal(char_overrides, char_data):
    """evaluate() starts new evaluation streams at every pass, not only on a train -> eval switch."""
    cfg = load_config(None, char_overrides)
    stream = TokenStream(char_data, "valid", 2, 16, train=False)
    cfg = resolved_config(cfg, len(stream.dictionary), cfg.train.exp_id)
    torch.manual_seed(0)
    model = TransformerLM(cfg.model).eval()
    with torch.no_grad():
        for span in model.spans():
            span.z.fill_(0.5)  # a context of 16 tokens: the first block reads the cache
    first, second = (evaluate(model, stream, torch.device("cpu"), max_batches=2) for _ in range(2))
    assert first["loss"] == second["loss"]


def test_accumulation_with_stream_caches_warns_at_start(tiny_trainer, char_overrides, tmp_path, capsys):
    tiny_trainer(tmp_path, *char_overrides, "optim.accumulate=2", test=False).close()
    assert "warning: optim.accumulate=2 with stream caches: a step reads 2 consecutive blocks of the same 4 " \
           "streams" in capsys.readouterr().out


def test_a_byte_level_model_is_sampled_and_exported(tiny_run, char_overrides, char_data, tmp_path, capsys):
    """generate.py and export work without BPE codes: the byte codec of the run's vocabulary."""
    run = tiny_run(tmp_path, "train.exp_id=gen", "train.max_steps=2", *char_overrides)
    exported = export(run.best_path, tmp_path / "exported")
    names = sorted(p.name for p in exported.iterdir() if p.suffix != ".py")
    assert names == ["config.json", "export_manifest.json", "model.safetensors", "vocab"]
    assert not (exported / "tokenization_xlm_pkm.py").exists()  # byte data: no transformers tokenizer
    capsys.readouterr()
    args = ["--max-tokens", "12", "--seed", "1", "--device", "cpu", "the function"]
    outputs = []
    for source in (run.best_path, exported):
        assert generate_main(["--checkpoint", str(source), *args]) == 0
        outputs.append(capsys.readouterr().out)
    assert outputs[0] == outputs[1] and outputs[0].startswith("the function")
    assert isinstance(load_trained(exported, exported).codec(), ByteCodec)
