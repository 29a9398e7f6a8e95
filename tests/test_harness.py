"""lm-evaluation-harness on exported models: its log-likelihood of a document against evaluate.py's, the local
tasks' accuracy against a choice made by our model directly, the results JSON, the one-line errors."""

import importlib.util
import json
import sys

import pytest
import torch

from xlm_pkm.data.preprocess import preprocess
from xlm_pkm.data.text_codec import TextCodec
from xlm_pkm.experiments.facts import write_facts_data
from xlm_pkm.experiments.harness import CLOZE, FACTS_QA, evaluate_tasks, held_out_documents, main, write_tasks
from xlm_pkm.inference.export import export
from xlm_pkm.train.evaluation import evaluate_checkpoint

needs_harness = pytest.mark.skipif(not all(importlib.util.find_spec(m) for m in ("lm_eval", "transformers")),
                                   reason="lm-eval and transformers are not installed (pip install 'xlm-pkm[eval]')")


def test_without_the_harness_the_command_names_the_extra(monkeypatch, tmp_path, capsys):
    monkeypatch.setitem(sys.modules, "lm_eval", None)
    assert main(["run", str(tmp_path), "--tasks", CLOZE]) == 2
    assert capsys.readouterr().err == ("python -m xlm_pkm.experiments.harness: error: lm-evaluation-harness is not "
                                       "installed: pip install 'xlm-pkm[eval]'\n")


@pytest.fixture(scope="module")
def exported(reference_run, tmp_path_factory):
    """(best.pt of the tiny reference run, its exported folder)."""
    best = reference_run().best_path
    return best, export(best, tmp_path_factory.mktemp("harness") / "exported")


@pytest.mark.slow
@needs_harness
def test_the_harness_log_likelihood_of_a_document_is_evaluate_pys(exported, tiny_data_dir, tmp_path):
    """A one-document test split (the run's vocabulary): evaluate.py's summed NLL of its tokens after <s> (the
    first block of as many: not the </s> preprocessing ends it with, which a text's tokens do not have) equals
    minus the harness's rolling log-likelihood of the document's text (its tokenizer, <s> as the prefix)."""
    from lm_eval.api.instance import Instance
    from lm_eval.models.huggingface import HFLM

    best, folder = exported
    source = tmp_path / "docs.jsonl"
    texts = ["The function returns a list of names.", "Each module has a name.", "A class defines new objects."]
    source.write_text("".join(json.dumps({"text": t}) + "\n" for t in texts))
    data = tmp_path / "data"
    preprocess([str(source)], data, codes=str(tiny_data_dir / "codes"), vocab=str(tiny_data_dir / "vocab"),
               valid_docs=1, test_docs=1, seed=0)
    [document] = held_out_documents(data)
    assert document in texts
    n = len(TextCodec(data).encode(document)) - 1  # the document's tokens after <s>, without the </s> ending it
    ours = evaluate_checkpoint(best, "test", str(data), batch_size=1, bptt=n, max_batches=1)  # exactly those
    assert ours["tokens"] == n <= 16
    lm = HFLM(pretrained=str(folder), trust_remote_code=True, batch_size=1, device="cpu")
    [loglikelihood] = lm.loglikelihood_rolling([Instance("loglikelihood_rolling", {}, (document,), 0)])
    assert loglikelihood == pytest.approx(-ours["loss"] * ours["tokens"], rel=1e-5)


def _our_choice(model, codec, context: str, choices: list[str], max_len: int) -> int:
    """The choice whose tokens have the highest log-likelihood after the context's, read as the harness reads
    them: context and context + " " + choice tokenised without <s>, the input cut to the last max_len ids."""
    scores = []
    context_ids = codec.encode(context)[1:]
    for choice in choices:
        whole = codec.encode(f"{context} {choice}")[1:]
        continuation = whole[len(context_ids):]
        ids = whole[-(max_len + 1):]
        with torch.no_grad():
            logp = model(torch.tensor([ids[:-1]])).log_softmax(-1)[0]  # (T, vocab)
        picked = logp[-len(continuation):].gather(1, torch.tensor(continuation)[:, None])
        scores.append(float(picked.sum()))
    return max(range(len(choices)), key=scores.__getitem__)


@pytest.mark.slow
@needs_harness
def test_local_tasks_score_what_the_model_chooses(exported, tiny_data_dir, tmp_path):
    from xlm_pkm.checkpoint.trained import load_trained

    best, folder = exported
    facts = write_facts_data(tmp_path / "facts", 10, seed=0, codes=str(tiny_data_dir / "codes"),
                             vocab=str(tiny_data_dir / "vocab"))
    assert write_tasks(tmp_path / "tasks", tiny_data_dir, facts) == [CLOZE, FACTS_QA]
    results = evaluate_tasks(best, [CLOZE, FACTS_QA], [str(tmp_path / "tasks")], limit=8, batch_size=4)
    assert json.loads((best.parent / "lm_eval.json").read_text())["results"] == json.loads(json.dumps(
        results["results"]))  # written next to the run
    trained = load_trained(best)
    model, cfg = trained.model, trained.cfg
    codec = TextCodec(tiny_data_dir)
    for task in (CLOZE, FACTS_QA):
        items = [json.loads(line) for line in (tmp_path / "tasks" / f"{task}.jsonl").read_text().splitlines()][:8]
        hits = [_our_choice(model, codec, i["context"], i["choices"], cfg.model.max_len) == i["label"] for i in items]
        assert results["results"][task]["acc,none"] == pytest.approx(sum(hits) / len(hits)), task


@pytest.mark.slow
@needs_harness
def test_an_unknown_task_is_one_line(exported, tiny_data_dir, tmp_path, capsys):
    _, folder = exported
    write_tasks(tmp_path / "tasks", tiny_data_dir)
    assert main(["run", str(folder), "--tasks", "xlm_pkm_clozee", "--include", str(tmp_path / "tasks")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "no lm-eval task xlm_pkm_clozee" in err[0] and f"local ones found: {CLOZE}" in err[0]
