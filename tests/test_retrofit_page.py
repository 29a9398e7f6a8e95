"""docs/retrofit.md, run as a user would: every command of its bash blocks in order, from a directory outside the
checkout holding the page's files (the corpus, the facts, configs/, benchmarks/ and the three scripts), with the
venv's `python` on PATH; then its Python block. The model is the tests' tiny random Llama (conftest.tiny_base) in
place of SmolLM2: the install lines are left out and the GGUF conversion is a copy of it; the corpus is the tiny
one; each `train.py` command gets the tiny sizes appended, the speed benchmark the tiny sizes and one short round."""

import json
import lzma
import os
import re
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PAGE = ROOT / "docs" / "retrofit.md"
TINY = ["model.memory.n_keys=8", "model.memory.k_dim=16", "model.memory.heads=2", "model.memory.knn=4",
        "data.bptt=16", "data.eval_batch_size=8", "train.num_threads=1", "train.eval_max_batches=2"]
STEPS = {"first": ["data.batch_size=4", "train.max_steps=20", "train.eval_every=20"],
         "mine": ["train.max_steps=40", "train.eval_every=40"]}  # 8 passes over the 5 facts
BENCH = ["--min-time", "0.01", "--rounds", "1", "--warmup", "1", "--out", "retrofit_speed.json", "--override", *TINY,
         "data.batch_size=4"]  # its JSON in the page's directory, not the checkout's dumped/bench/


def _blocks(language: str) -> list[str]:
    return re.findall(rf"```{language}\n(.*?)```", PAGE.read_text(), re.S)


def _commands() -> list[str]:
    lines = [line for block in _blocks("bash") for line in block.replace("\\\n", " ").splitlines()]
    return [line for line in lines if line.strip() and not line.lstrip().startswith("#")]


@pytest.mark.slow
def test_the_retrofit_page_runs_as_written(tiny_base, tiny_corpus, tmp_path):
    (tmp_path / "data" / "sample").mkdir(parents=True)
    (tmp_path / "data" / "sample" / "python-docs.jsonl.xz").write_bytes(lzma.compress(tiny_corpus.read_bytes()))
    shutil.copytree(ROOT / "data" / "facts", tmp_path / "data" / "facts")
    (tmp_path / "configs").symlink_to(ROOT / "configs")
    (tmp_path / "benchmarks").symlink_to(ROOT / "benchmarks")
    for script in ("train.py", "evaluate.py", "generate.py"):
        (tmp_path / script).symlink_to(ROOT / script)
    env = {**os.environ, "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}",
           "PYTHONPATH": str(ROOT), "PYTHONUNBUFFERED": "1"}  # this checkout's xlm_pkm, wherever the venv's points
    commands = _commands()
    assert [c.split()[0] for c in commands[:3]] == ["pip", "pip", "smol=$(python"]
    outputs = {}
    for command in commands[3:]:
        words = shlex.split(command)
        if words[:3] == ["python", "-m", "xlm_pkm.model.retrofit"]:  # the GGUF file's folder: the tiny base's
            shutil.copytree(tiny_base, tmp_path / words[-1])
            continue
        if words[1] == "train.py":
            words += TINY + STEPS[next(w.split("=")[1] for w in words if w.startswith("train.exp_id="))]
        if words[1] == "benchmarks/retrofit_speed.py":
            words += BENCH
        done = subprocess.run(words, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600)
        assert done.returncode == 0, (command, done.stderr[-3000:])
        outputs.setdefault(" ".join(words[:3]), []).append(done.stdout)
    assert "memory at layer 2: usage" in outputs["python evaluate.py --checkpoint"][0]
    prompts = ("The capital of France is", "The search service stores its data in")
    assert all(out.startswith(p) for out, p in zip(outputs["python generate.py --checkpoint"], prompts, strict=True))
    (scores,) = outputs["python -m xlm_pkm.experiments.continual"]
    assert '"em": ' in scores and '"valid_ppl": ' in scores
    assert (tmp_path / "exported" / "smollm2-facts" / "base" / "model.safetensors").is_file()
    meta = json.loads((tmp_path / "data" / "processed" / "sample-smollm2" / "meta.json").read_text())
    assert meta["unit"] == "tokenizer"
    speed = json.loads((tmp_path / "retrofit_speed.json").read_text())
    assert set(speed["memory_share"]) == {"training", "inference"} and speed["settings"]["layers"] == [2]
    (script,) = _blocks("python")
    done = subprocess.run([sys.executable, "-c", script], cwd=tmp_path, env=env, capture_output=True, text=True,
                          timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.startswith("The search service stores its data in")
