"""A retrofit's inputs that are not what they should be (model.base.path, model.base.gguf_file, the GGUF converter's
arguments): each is one line naming the file and what is wrong, never a traceback. A GGUF file truncated in its
header, a base of another family than Llama's (GPT-2), a damaged or incomplete model.safetensors, a config whose
sizes are not its weights', a missing folder, and paths that are a file, a named pipe or a broken symbolic link
where a folder or a file is expected. The base is conftest's tiny random Llama."""

from __future__ import annotations

import json
import os
import re
import shutil
from pathlib import Path

import pytest

from xlm_pkm.data.preprocess import main as preprocess_main
from xlm_pkm.data.tokenized import load_tokenizer
from xlm_pkm.launch.cli import train_main
from xlm_pkm.model.retrofit import BaseConfig, base_files, load_base, load_base_config
from xlm_pkm.model.retrofit import main as gguf_main

transformers = pytest.importorskip("transformers")

RUN = ["model.base.layers=[2]", "model.n_memories=0", "model.memory.n_keys=8", "model.memory.k_dim=16",
       "model.memory.heads=2", "model.memory.knn=4", "data.batch_size=4", "data.eval_batch_size=8", "data.bptt=16",
       "train.device=cpu", "train.max_steps=1", "train.exp_name=retro", "train.num_threads=1"]


def train_error(base, data, dump, capsys, *extra) -> str:
    """The one line train.py writes on stderr for a retrofit of `base` (exit status 2)."""
    capsys.readouterr()
    status = train_main([f"model.base.path={base}", f"data.path={data}", f"train.dump_path={dump}", *RUN, *extra])
    err = capsys.readouterr().err
    assert status == 2, err
    lines = err.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in err, err
    assert lines[0].startswith("train.py: error: "), err
    return lines[0]


def copy_base(tiny_base: Path, to: Path) -> Path:
    shutil.copytree(tiny_base, to)
    return to


def gguf_header(path: Path) -> Path:
    """A GGUF file of a tiny Llama's metadata (its header) and one tensor, as llama.cpp's writer makes it."""
    gguf = pytest.importorskip("gguf")
    import numpy as np

    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_block_count(2)
    writer.add_context_length(64)
    writer.add_embedding_length(32)
    writer.add_feed_forward_length(64)
    writer.add_head_count(4)
    writer.add_head_count_kv(2)
    writer.add_layer_norm_rms_eps(1e-6)
    writer.add_tokenizer_model("gpt2")
    writer.add_token_list(["a", "b", "ab"])
    writer.add_token_types([1, 1, 1])
    writer.add_token_merges(["a b"])
    writer.add_eos_token_id(0)
    writer.add_tensor("token_embd.weight", np.zeros((3, 32), dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


# ---- the four accidents of issue 83, item 11 ----------------------------------------------------------------------

@pytest.mark.parametrize("size", [30, 200])  # in the counts, in the metadata's keys and values
def test_a_gguf_file_truncated_in_its_header_is_one_line(tmp_path, capsys, size):
    whole = gguf_header(tmp_path / "whole.gguf").read_bytes()
    folder = tmp_path / "base"
    folder.mkdir()
    (folder / "model.gguf").write_bytes(whole[:size])
    assert gguf_main([str(folder / "model.gguf"), str(tmp_path / "out")]) == 2  # python -m xlm_pkm.model.retrofit
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and f"{folder / 'model.gguf'} is truncated or damaged" in err[0], err
    assert "model.base" not in err[0]  # the command's argument is a path, not a config key
    assert not (tmp_path / "out").exists()
    cfg = BaseConfig(path=str(folder), gguf_file="model.gguf")  # model.base.gguf_file: the config, the tokenizer
    with pytest.raises(ValueError, match=r"^model.base.gguf_file: .*model.gguf is truncated or damaged"):
        load_base_config(cfg)
    with pytest.raises(ValueError, match=r"model.gguf is truncated or damaged"):
        load_tokenizer(folder, "model.gguf")


def test_a_base_of_another_family_says_which_are_supported(tiny_base, tiny_base_data, tmp_path, capsys):
    gpt2 = tmp_path / "gpt2"
    tokenizer = transformers.AutoTokenizer.from_pretrained(tiny_base)
    tokenizer.save_pretrained(gpt2)
    eos = tokenizer.eos_token_id
    config = transformers.GPT2Config(vocab_size=len(tokenizer) + 20, n_embd=32, n_layer=2, n_head=4, n_positions=64,
                                     bos_token_id=eos, eos_token_id=eos)
    transformers.GPT2LMHeadModel(config).save_pretrained(gpt2)
    line = train_error(gpt2, tiny_base_data, tmp_path / "dump", capsys)
    assert f"model.base.path: {gpt2} holds a gpt2 model (GPT2Config, with no intermediate_size)" in line
    assert "Llama-family models (Llama, Mistral, Qwen2, SmolLM2)" in line


def test_a_damaged_model_safetensors_is_named(tiny_base, tiny_base_data, tmp_path, capsys):
    base = copy_base(tiny_base, tmp_path / "base")
    weights = base / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[: weights.stat().st_size // 2])  # a copy cut short
    line = train_error(base, tiny_base_data, tmp_path / "dump", capsys)
    assert f"model.base.path: {weights} is damaged or truncated" in line


def test_a_missing_base_folder_is_named_not_a_tokenizer_option(tiny_base_data, tmp_path, capsys):
    line = train_error(tmp_path / "nowhere", tiny_base_data, tmp_path / "dump", capsys)
    assert f"no folder {tmp_path / 'nowhere'}" in line and "--tokenizer" not in line
    with pytest.raises(FileNotFoundError, match=r"^model.base.path: no folder .*nowhere"):
        base_files(BaseConfig(path=str(tmp_path / "nowhere")))


# ---- more weights that are not the config's --------------------------------------------------------------------

def test_weights_missing_or_of_other_sizes_than_the_config_says_are_one_line(tiny_base, tmp_path, capsys):
    from safetensors.torch import load_file, save_file

    partial = copy_base(tiny_base, tmp_path / "partial")
    state = load_file(partial / "model.safetensors")
    del state["model.layers.0.mlp.up_proj.weight"]
    save_file(state, partial / "model.safetensors", metadata={"format": "pt"})
    capsys.readouterr()
    with pytest.raises(ValueError, match=r"lacks 1 of its model's weights \(model.layers.0.mlp.up_proj.weight\)"):
        load_base(BaseConfig(path=str(partial)))  # transformers would have started it at random
    assert "LOAD REPORT" not in capsys.readouterr().err  # the one line says it

    resized = copy_base(tiny_base, tmp_path / "resized")
    config = json.loads((resized / "config.json").read_text())
    (resized / "config.json").write_text(json.dumps({**config, "intermediate_size": 48}))
    with pytest.raises(ValueError, match=r"^model.base.path: the weights of .*resized do not have the sizes its "
                                         r"config gives them \(model.layers.*mlp"):
        load_base(BaseConfig(path=str(resized)))


# ---- a file, a pipe or a broken link where a folder or a file is expected --------------------------------------

def test_a_base_path_that_is_a_file_a_pipe_or_a_broken_link_is_one_line(tiny_base, tmp_path):
    (tmp_path / "file").write_text("not a model")
    os.mkfifo(tmp_path / "pipe")
    (tmp_path / "link").symlink_to(tmp_path / "gone")
    for name, said in (("file", "is a file, not a folder"), ("pipe", "is a named pipe (FIFO), not a folder"),
                       ("link", f"is a symbolic link to {tmp_path / 'gone'}, which does not exist")):
        with pytest.raises(FileNotFoundError, match=re.escape(f"model.base.path: {tmp_path / name} {said}")):
            base_files(BaseConfig(path=str(tmp_path / name)))
        with pytest.raises(FileNotFoundError, match="^" + re.escape(f"{tmp_path / name} {said}")):  # build.py's
            load_tokenizer(tmp_path / name)
    (tmp_path / "snapshot").symlink_to(tiny_base)  # a link to a model's folder (a Hugging Face cache's) is one
    assert [p.name for p in base_files(BaseConfig(path=str(tmp_path / "snapshot")))] == ["config.json",
                                                                                         "model.safetensors"]


def test_weights_or_a_gguf_file_that_is_a_pipe_or_a_folder_is_refused_before_it_is_read(tiny_base, tmp_path, capsys):
    base = copy_base(tiny_base, tmp_path / "base")
    (base / "model.safetensors").unlink()
    os.mkfifo(base / "model.safetensors")  # reading it (its digest) would wait for a writer forever
    with pytest.raises(FileNotFoundError, match=r"model.safetensors is a named pipe \(FIFO\), not a regular file"):
        base_files(BaseConfig(path=str(base)))
    (base / "model.gguf").mkdir()
    with pytest.raises(FileNotFoundError, match=r"^model.base.gguf_file: .*model.gguf is a folder, not a regular"):
        base_files(BaseConfig(path=str(base), gguf_file="model.gguf"))
    assert gguf_main([str(base / "model.safetensors"), str(tmp_path / "out")]) == 2
    assert capsys.readouterr().err.strip().endswith("model.safetensors is a named pipe (FIFO), not a regular file "
                                                    "(the GGUF model file to convert)")
    (tmp_path / "dangling").symlink_to(tmp_path / "gone")
    gguf_header(tmp_path / "m.gguf")
    assert gguf_main([str(tmp_path / "m.gguf"), str(tmp_path / "dangling")]) == 2
    assert "dangling is a symbolic link to" in capsys.readouterr().err


def test_preprocess_tokenizer_that_is_a_file_or_a_pipe_is_one_line(tiny_corpus, tmp_path, capsys):
    os.mkfifo(tmp_path / "pipe")
    for name, said in (("pipe", "is a named pipe (FIFO), not a folder"), ("nowhere", "")):
        assert preprocess_main(["--input", str(tiny_corpus), "--output", str(tmp_path / "out"),
                                "--tokenizer", str(tmp_path / name)]) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and err[0].startswith("python -m xlm_pkm.data.preprocess: error: --tokenizer: "), err
        assert (f"{tmp_path / name} {said}" if said else f"no folder {tmp_path / name}") in err[0]


def whole_gguf(tiny_base: Path, path: Path) -> Path:
    """The tiny base as a GGUF file (float32), as llama.cpp's convert script writes a Llama: its weights under GGUF's
    names, q and k rows permuted for its rotary embedding, its byte-level BPE tokenizer."""
    gguf = pytest.importorskip("gguf")
    from safetensors.numpy import load_file

    config = json.loads((tiny_base / "config.json").read_text())
    bpe = json.loads((tiny_base / "tokenizer.json").read_text())["model"]
    tokens = [token for token, _ in sorted(bpe["vocab"].items(), key=lambda item: item[1])]
    tokens += [f"<unused{i}>" for i in range(config["vocab_size"] - len(tokens))]
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_block_count(2)
    writer.add_context_length(64)
    writer.add_embedding_length(32)
    writer.add_feed_forward_length(64)
    writer.add_head_count(4)
    writer.add_head_count_kv(2)
    writer.add_layer_norm_rms_eps(config["rms_norm_eps"])
    writer.add_rope_freq_base(config.get("rope_theta", 10000.0))
    writer.add_tokenizer_model("gpt2")
    writer.add_token_list(tokens)
    writer.add_token_types([1] * len(tokens))
    writer.add_token_merges([m if isinstance(m, str) else " ".join(m) for m in bpe["merges"]])
    writer.add_eos_token_id(config["eos_token_id"])
    names = {"self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
             "self_attn.o_proj": "attn_output", "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up",
             "mlp.down_proj": "ffn_down", "input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm"}
    for name, tensor in load_file(tiny_base / "model.safetensors").items():
        if name == "model.embed_tokens.weight":
            writer.add_tensor("token_embd.weight", tensor)
        elif name == "model.norm.weight":
            writer.add_tensor("output_norm.weight", tensor)
        else:
            layer, module = name.split(".")[2], ".".join(name.split(".")[3:-1])
            heads = {"self_attn.q_proj": 4, "self_attn.k_proj": 2}.get(module)
            if heads:  # llama.cpp's order of the rotary halves
                tensor = tensor.reshape(heads, 2, -1, tensor.shape[1]).swapaxes(1, 2).reshape(tensor.shape)
            writer.add_tensor(f"blk.{layer}.{names[module]}.weight", tensor)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def test_a_whole_gguf_file_still_loads_and_converts(tiny_base, tmp_path, capsys):
    import torch

    gguf = whole_gguf(tiny_base, tmp_path / "tiny.gguf")
    tokens = torch.tensor([[1, 5, 9, 30]])
    with torch.no_grad():  # the checks of the weights (none missing, of the config's sizes) refuse none of it
        assert torch.allclose(load_base(BaseConfig(path=str(tmp_path), gguf_file="tiny.gguf"))(tokens).logits,
                              load_base(BaseConfig(path=str(tiny_base)))(tokens).logits, atol=1e-5)
    assert gguf_main([str(gguf), str(tmp_path / "folder")]) == 0
    assert base_files(BaseConfig(path=str(tmp_path / "folder")))[1].name == "model.safetensors"
    (tmp_path / "file").write_text("x")
    capsys.readouterr()
    assert gguf_main([str(gguf), str(tmp_path / "file" / "folder")]) == 2  # a folder under a file: said at once
    assert capsys.readouterr().err.strip().splitlines() == [
        f"python -m xlm_pkm.model.retrofit: error: {tmp_path / 'file' / 'folder'}: cannot make this folder: "
        f"{tmp_path / 'file'} is a file, not a folder"]
