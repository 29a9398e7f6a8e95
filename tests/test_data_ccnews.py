"""The local steps of scripts/get-ccnews.sh (export + preprocessing) on a hand-made news-please dump."""

from __future__ import annotations

import gzip
import json
import os
import subprocess
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]


@pytest.mark.slow
def test_get_ccnews_local_steps(tmp_path):
    raw = tmp_path / "raw"
    raw.mkdir()
    records = [{"url": f"https://news.example/{i}", "title": f"Title {i}", "language": "en",
                "maintext": f"Story {i} happened today.\nPeople said it was news number {i}."} for i in range(12)]
    records += [dict(records[0]), {"url": "https://news.example/fr", "language": "fr", "maintext": "Bonjour."},
                {"url": "https://news.example/empty", "language": "en", "maintext": ""}]
    (raw / "articles.1.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records) + "not json\n")
    env = dict(os.environ, SKIP_DOWNLOAD="1", CODES="30", VALID_DOCS="2", TEST_DOCS="2", WORKERS="1")
    result = subprocess.run([str(REPO / "scripts" / "get-ccnews.sh"), str(tmp_path), "--keep-intermediate"],
                            env=env, capture_output=True, text=True)
    assert result.returncode == 0, result.stderr
    exported = [json.loads(line) for line in gzip.open(tmp_path / "jsonl" / "ccnews.0000.jsonl.gz", "rt")]
    assert [a["id"] for a in exported] == [f"https://news.example/{i}" for i in range(12)]
    assert exported[3]["text"] == "Title 3\n\nStory 3 happened today.\nPeople said it was news number 3."
    out = tmp_path / "processed"
    docs = {s: (out / f"{s}.tok").read_text().count("\n\n") for s in ("train", "valid", "test")}
    assert docs == {"train": 8, "valid": 2, "test": 2}
    assert (out / "train.000.bin").exists() and len((out / "codes").read_text().splitlines()) == 30
