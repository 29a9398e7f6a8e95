"""scripts/*.sh resolve relative paths against the caller's directory, not the repository."""

from __future__ import annotations

import json
import os
import re
import subprocess
from pathlib import Path

import pytest
from test_data_preprocess import write_jsonl

REPO = Path(__file__).resolve().parents[1]


def run_script(name, *args, cwd, **env):
    return subprocess.run([str(REPO / "scripts" / name), *args], cwd=cwd, capture_output=True, text=True,
                          env=dict(os.environ, **env))


@pytest.mark.slow
def test_preprocess_sh_with_relative_paths(tmp_path):
    write_jsonl(tmp_path / "in.jsonl", 8)
    result = run_script("preprocess.sh", "out", "in.jsonl", "--", "--bpe-codes", "20", "--valid-docs", "1",
                        "--test-docs", "1", cwd=tmp_path, WORKERS="1")
    assert result.returncode == 0, result.stderr
    assert (tmp_path / "out" / "meta.json").exists()


@pytest.mark.slow
def test_get_ccnews_sh_with_a_relative_data_dir(tmp_path):
    raw = tmp_path / "cc" / "raw"
    raw.mkdir(parents=True)
    (raw / "a.jsonl").write_text("".join(json.dumps({"url": f"u{i}", "language": "en", "maintext": f"Story {i} ."})
                                         + "\n" for i in range(8)))
    result = run_script("get-ccnews.sh", "cc", cwd=tmp_path, SKIP_DOWNLOAD="1", CODES="10", VALID_DOCS="1",
                        TEST_DOCS="1", WORKERS="1")
    assert result.returncode == 0, result.stderr
    assert (tmp_path / "cc" / "processed" / "meta.json").exists()


def test_get_ccnews_sh_hub_source_streams_the_hub_dataset(tmp_path):
    """SOURCE=hub: no download or export, the preprocessing reads the hub's CC-News (a stand-in python records
    its arguments: the hub is not reachable from the tests)."""
    fake = tmp_path / "python"
    fake.write_text(f'#!/bin/sh\nprintf "%s\\n" "$@" > {tmp_path}/args\n')
    fake.chmod(0o755)
    result = run_script("get-ccnews.sh", "cc", "--keep-intermediate", cwd=tmp_path, SOURCE="hub", WORKERS="1",
                        PYTHON=str(fake))
    assert result.returncode == 0, result.stderr
    assert (tmp_path / "args").read_text().splitlines() == [
        "-m", "xlm_pkm.data.preprocess", "--output", "cc/processed", "--workers", "1",
        "--hf-dataset", "vblagoje/cc_news", "--hf-split", "train", "--text-field", "text", "--bpe-codes", "60000",
        "--valid-docs", "5000", "--test-docs", "5000", "--seed", "0", "--keep-intermediate"]
    assert not (tmp_path / "cc").exists()


@pytest.mark.parametrize("script, module", [("train_torchrun.sh", "torch.distributed.run"),
                                            ("train_slurm.sh", "xlm_pkm.launch.slurm")])
def test_train_scripts_run_in_the_callers_directory(tmp_path, script, module):
    """A stand-in for python records where it runs and what it is given."""
    fake = tmp_path / "python"
    fake.write_text(f'#!/bin/sh\npwd > {tmp_path}/cwd\nprintf "%s\\n" "$@" > {tmp_path}/args\n')
    fake.chmod(0o755)
    caller = tmp_path / "caller"
    caller.mkdir()
    args = ["2"] if script == "train_torchrun.sh" else []
    result = run_script(script, *args, "--config", "my.yaml", "data.path=data/x", cwd=caller, PYTHON=str(fake))
    assert result.returncode == 0, result.stderr
    assert (tmp_path / "cwd").read_text().strip() == str(caller)
    passed = (tmp_path / "args").read_text().splitlines()
    assert passed[:2] == ["-m", module] and passed[-3:] == ["--config", "my.yaml", "data.path=data/x"]
    if script == "train_torchrun.sh":
        assert str(REPO / "train.py") in passed


def test_get_ccnews_writes_where_the_paper_configs_read():
    from xlm_pkm.config import load_config

    script = (REPO / "scripts" / "get-ccnews.sh").read_text()
    default = re.search(r"data=\$\{1:-([^}]+)\}", script).group(1)
    assert '"$data/processed"' in script
    assert load_config(REPO / "configs" / "paper" / "l12_d1024_m1.yaml").data.path == f"{default}/processed"
