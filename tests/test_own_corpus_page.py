"""docs/own-corpus.md, run as a user would: every command of its bash blocks in order, from a directory
outside the checkout holding the user's corpus (300 documents) and links to the three scripts and configs/, with the
venv's `python` on PATH; then its Python block as a script of the user's. Each `train.py` command gets
the tests' tiny-model overrides appended (TINY, 100 steps); the first one is stopped with a real SIGINT
after its second step, as the page says to."""

import math
import os
import re
import shlex
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from conftest import TINY

ROOT = Path(__file__).resolve().parent.parent
PAGE = ROOT / "docs" / "own-corpus.md"
SIZE = [o for o in TINY if not o.startswith("train.exp_name=")] + ["train.max_steps=100"]


def _commands(language: str) -> list[str]:
    blocks = re.findall(rf"```{language}\n(.*?)```", PAGE.read_text(), re.S)
    return [line for block in blocks for line in block.replace("\\\n", " ").splitlines() if line.strip()]


def _corpus(folder: Path, sample_docs: list[str]) -> None:
    """300 documents in two plain-text files (blank-line separated): pieces of the bundled corpus."""
    words = " ".join(sample_docs).split()
    docs = [" ".join(words[i * 60:(i + 1) * 60]) for i in range(300)]
    folder.mkdir()
    for name, part in (("a.txt", docs[:150]), ("b.txt", docs[150:])):
        (folder / name).write_text("\n\n".join(part) + "\n")


@pytest.mark.slow
def test_the_own_corpus_page_runs_as_written(tiny_corpus, tmp_path):
    import json

    _corpus(tmp_path / "my_corpus", [json.loads(line)["text"] for line in tiny_corpus.read_text().splitlines()])
    for script in ("train.py", "evaluate.py", "generate.py", "configs"):  # as in a checkout
        (tmp_path / script).symlink_to(ROOT / script)
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    env |= {"PATH": f"{Path(sys.executable).parent}{os.pathsep}{env['PATH']}", "PYTHONUNBUFFERED": "1"}
    commands = _commands("bash")
    assert [c.split()[1] for c in commands] == ["-m", "-m", "train.py", "train.py", "evaluate.py", "generate.py",
                                                "-m", *["train.py"] * 4, "-m", "-m"]
    stopped = False
    for command in commands:
        words = shlex.split(command, comments=True)
        words += SIZE if words[1] == "train.py" else []
        line = " ".join(map(shlex.quote, words)).replace(shlex.quote("my_corpus/*.txt"), "my_corpus/*.txt")
        if words[1] == "train.py" and not stopped:  # the page: stop it with Ctrl-C
            run = subprocess.Popen(["bash", "-c", line], cwd=tmp_path, env=env, stdout=subprocess.PIPE,
                                   stderr=subprocess.PIPE, text=True, start_new_session=True)
            metrics = tmp_path / "dumped" / "mine" / "first" / "metrics.jsonl"
            deadline = time.time() + 120
            while not (metrics.exists() and '"step": 2,' in metrics.read_text()) and time.time() < deadline:
                time.sleep(0.01)
            os.killpg(run.pid, signal.SIGINT)  # Ctrl-C reaches the terminal's whole process group
            out, err = run.communicate(timeout=120)
            assert run.returncode == 75, err
            assert "to resume (with the same launcher and number of processes): python train.py" in out
            stopped = True
            continue
        done = subprocess.run(["bash", "-c", line], cwd=tmp_path, env=env, capture_output=True, text=True,
                              timeout=300)
        assert done.returncode == 0, (command, done.stderr[-2000:])
        if "xlm_pkm.data.preprocess" in command:
            assert "300 documents: holding out 15 valid + 15 test (5% each;" in done.stderr
        if "exp_id=last" in command:
            assert "run directory dumped/mine/first (resumed at step" in done.stdout
        if "xlm_pkm.runs list" in command:
            assert "| mine/first | finished | 100 | " in done.stdout
            assert "| designs/relu-seed1 | finished | 100 | " in done.stdout
        if "xlm_pkm.runs compare" in command:
            header, _, pkm, relu = done.stdout.splitlines()
            assert header.startswith("| runs | model.memory.score | seeds | params | active params | valid ppl | "
                                     "test ppl | usage % L") and header.endswith(" | tokens/s |")
            assert pkm.startswith("| designs/pkm-seed0 designs/pkm-seed1 | softmax | 0 1 | ") and " ± " in pkm
            assert relu.startswith("| designs/relu-seed0 designs/relu-seed1 | relu | 0 1 | ")
    assert json.loads((tmp_path / "dumped" / "mine" / "first" / "test.json").read_text())["split"] == "test"
    [snippet] = re.findall(r"```python\n(.*?)```", PAGE.read_text(), re.S)
    (tmp_path / "my_script.py").write_text(snippet)
    mine = subprocess.run(["python", "my_script.py"], cwd=tmp_path, env=env, capture_output=True, text=True,
                          timeout=300)
    assert mine.returncode == 0 and mine.stdout.startswith("The"), mine.stderr[-2000:]


@pytest.mark.slow
def test_the_small_preset_trains_on_a_small_corpus(tiny_data_dir, tmp_path):
    """configs/small.yaml, the page's preset for a corpus of a few MB (issue 63), as it is (its model, batch and
    schedule), a few steps on the tests' tiny corpus: it builds, trains, validates and saves."""
    from xlm_pkm.config import load_config
    from xlm_pkm.train.trainer import Trainer

    cfg = load_config(ROOT / "configs" / "small.yaml", [f"data.path={tiny_data_dir}", f"train.dump_path={tmp_path}",
                                                        "train.max_steps=3", "train.eval_every=3",
                                                        "train.eval_max_batches=2", "train.num_threads=1",
                                                        "train.device=cpu", "train.exp_id=small"])
    assert (cfg.model.dim, cfg.model.n_layers, cfg.data.batch_size * cfg.data.bptt) == (128, 4, 2048)
    trainer = Trainer(cfg, test=False)
    try:
        valid = trainer.train()
    finally:
        trainer.close()
    assert trainer.step == 3 and math.isfinite(valid["ppl"])
    assert (tmp_path / "small" / "small" / "checkpoint.pt").is_file()
