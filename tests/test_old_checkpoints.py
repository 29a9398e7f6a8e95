"""Run checkpoints written before the package was regrouped by role (issue 30) still load, evaluate and
resume. tests/data/before_regroup/ holds a tiny run made by the code of commit 6434b32 (make.py, run
there): the conftest's tiny model on the conftest's tiny corpus, train.eval_every=2, stopped by SIGTERM at
step 4 of 8; checkpoint.pt and best.pt (step 4), its config.yaml and metrics.jsonl."""

import json
import math
import shutil
from pathlib import Path

import pytest
import torch

from xlm_pkm.checkpoint.trained import load_trained
from xlm_pkm.train.evaluation import evaluate_checkpoint

OLD = Path(__file__).parent / "data" / "before_regroup"
EXTRA = ("train.eval_every=2",)  # the old run's one override beyond the conftest's tiny ones


def test_the_tiny_corpus_is_the_one_the_old_run_trained_on(tiny_data_dir):
    assert json.loads((tiny_data_dir / "meta.json").read_text())["fingerprint"] == \
        torch.load(OLD / "best.pt", weights_only=False)["vocab_fingerprint"]


def test_an_old_best_checkpoint_loads_and_evaluates_to_the_perplexity_its_run_logged(tiny_data_dir):
    trained = load_trained(OLD / "best.pt", tiny_data_dir)
    assert trained.step == 4 and trained.cfg.model.dim == 32
    logged = [e for e in map(json.loads, (OLD / "metrics.jsonl").read_text().splitlines()) if e["event"] == "valid"]
    result = evaluate_checkpoint(OLD / "best.pt", "valid", str(tiny_data_dir), max_batches=4)
    assert math.isclose(result["ppl"], logged[-1]["ppl"], rel_tol=1e-6), (result["ppl"], logged[-1]["ppl"])


@pytest.mark.slow
def test_an_old_run_checkpoint_resumes_exactly_as_an_uninterrupted_run_of_today(tiny_run, reference_run, train_losses,
                                                                                 tmp_path):
    run_dir = tmp_path / "tiny" / "before_regroup"
    run_dir.mkdir(parents=True)
    for name in ("checkpoint.pt", "config.yaml", "metrics.jsonl"):
        shutil.copy(OLD / name, run_dir / name)
    resumed = tiny_run(tmp_path, "train.exp_id=before_regroup", *EXTRA)
    assert resumed.resumed
    full = reference_run(*EXTRA)
    # steps 1-4 logged by the old code, 5-8 by today's after the resume: all equal today's uninterrupted run
    # up to float32 rounding: issue 36 changed the summation order of the memory's backward (the key search
    # through the selected sub-keys), so the old code's steps differ from today's in the last bits
    # (step 4: 6.8951526 then, 6.8951530 now). Today's own resume is bit-exact (test_resume_checks.py).
    old, today = train_losses(resumed.run_dir), train_losses(full.run_dir)
    assert old.keys() == today.keys() and all(math.isclose(old[s], today[s], rel_tol=1e-6) for s in old)
    # the parameters likewise, to Adam's step size: the attention keys' bias has a zero gradient in exact
    # arithmetic, so Adam turns the rounding noise of its gradient into steps of about lr
    for name, p in full.model.state_dict().items():
        torch.testing.assert_close(resumed.model.state_dict()[name], p, rtol=1e-5, atol=2e-3, msg=name)
