"""results/retrofit/study/run.sh end to end on the tests' tiny random Llama (conftest.tiny_base) in place of
SmolLM2: a start trained here, 4 facts a seed, one pass, one setting of three methods; every run's scores and the
report come out, and a second call runs nothing again."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
TINY = ["model.memory.n_keys=8", "model.memory.k_dim=16", "model.memory.heads=2", "model.memory.knn=4",
        "model.base.layers=[2]", "data.bptt=16", "data.eval_batch_size=8", "train.num_threads=1",
        "train.eval_max_batches=2"]


@pytest.mark.slow
def test_the_retrofit_study_runs_and_resumes(tiny_base, tiny_base_data, tmp_path):
    pytest.importorskip("peft")
    env = {**os.environ, "PYTHONPATH": str(ROOT), "PYTHON": sys.executable}
    start = subprocess.run([sys.executable, "train.py", "--config", "configs/retrofit_fixed_routing.yaml",
                            "--no-test",
                            f"model.base.path={tiny_base}", f"data.path={tiny_base_data}", *TINY,
                            f"train.dump_path={tmp_path}", "train.exp_id=start", "data.batch_size=4",
                            "train.max_steps=10", "train.eval_every=10"], cwd=ROOT, env=env, capture_output=True,
                           text=True, timeout=600)
    assert start.returncode == 0, start.stderr[-3000:]
    out = tmp_path / "study"
    env.update(START=str(tmp_path / "retrofit" / "start" / "best.pt"), BASE=str(tiny_base), DATA=str(tiny_base_data),
               DUMP=str(tmp_path / "dump"), STUDY_OUT=str(out), FACTS="4", PASSES="1", PARAPHRASES="2",
               DOC_TOKENS="16", LEVELS="0.2", SCORE_ARGS="--max-batches 1",
               FT_ARGS=" ".join([f"model.base.path={tiny_base}", *TINY]),
               ONLY=r"^memory (sparse_memory top_t=100,lr=1000|full lr=1e-4|lora_r8 lr=1e-3)$")
    for _call in range(2):  # the second call runs nothing again
        done = subprocess.run(["bash", "results/retrofit/study/run.sh"], cwd=ROOT, env=env, capture_output=True,
                              text=True, timeout=3000)
        assert done.returncode == 0, (done.stdout[-3000:], done.stderr[-3000:])
    assert "done before" in done.stdout and "failed" not in done.stdout
    rows = [json.loads(line) for line in (out / "scores.jsonl").read_text().splitlines()]
    runs = {(r["method"], r["seed"]) for r in rows}
    assert {("pretrained", s) for s in (3, 0, 1, 2)} <= runs
    assert {("sparse_memory", 3), ("full", 3), ("lora_r8", 3)} <= runs
    assert {m for m, s in runs if s == 0} > {"pretrained"}  # the chosen settings ran on the verdict seeds
    assert all("knowledge_hits" in r for r in rows) and (out / "report.md").is_file()  # the tiny base knows none
