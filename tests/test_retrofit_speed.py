"""benchmarks/retrofit_speed.py on the tiny random Llama of conftest.tiny_base: its peer (the frozen base's forward
+ the backward a memory's layer needs) computes the base's loss and, at the memory's layer, the gradient a fully
trainable base computes there; a run writes its rows, shares and machine; what it does not time is refused in one
line."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

transformers = pytest.importorskip("transformers")

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "benchmarks"))
import retrofit_speed  # noqa: E402

from xlm_pkm.errors import EXIT_ERROR  # noqa: E402
from xlm_pkm.runtime.precision import grad_scaler  # noqa: E402
from xlm_pkm.train.step import loss_backward  # noqa: E402

TINY = ["model.base.layers=[1]", "model.memory.n_keys=8", "model.memory.k_dim=16", "model.memory.heads=2",
        "model.memory.knn=4", "data.batch_size=2", "data.bptt=8", "train.device=cpu"]


def overrides(base) -> list[str]:
    return [f"model.base.path={base}", *TINY]


def test_the_peer_is_the_base_with_the_gradient_at_the_memory_s_layer(tiny_base):
    """Reference: the plain transformers model, every weight trainable, the gradient of its loss at layer 1's MLP
    output (which the peer's gate adds to) kept and summed over the tokens; it must cross layer 2 to get there."""
    cfg = retrofit_speed.measured_config(retrofit_speed.REPO / "configs" / "retrofit.yaml", overrides(tiny_base))
    cpu = torch.device("cpu")
    peer = retrofit_speed.build_peer(cfg, cpu)
    x, y = retrofit_speed.random_batch(cfg, cpu)  # (2, 8) each
    nll = loss_backward(peer, x, y, "fp32", cpu, grad_scaler("fp32", cpu))
    (gate,) = [beside.gate for beside in peer.beside.values()]

    base = transformers.AutoModelForCausalLM.from_pretrained(tiny_base)
    kept = []
    base.model.layers[0].mlp.register_forward_hook(lambda mlp, args, out: kept.append(out) or out.retain_grad())
    logits = base(input_ids=x).logits  # (2, 8, vocab)
    loss = F.cross_entropy(logits.flatten(0, 1), y.flatten())
    loss.backward()
    expected = kept[0].grad.sum((0, 1))  # (dim,)

    # the same float32 operations in both (the peer skips the weights' gradients): rounding of a 16-token sum only
    assert float(nll) == pytest.approx(loss.detach().item(), rel=1e-6)
    assert gate.grad.abs().max() > 0
    torch.testing.assert_close(gate.grad, expected, rtol=1e-4, atol=1e-5 * float(expected.abs().max()))
    assert all(p.grad is None for name, p in peer.named_parameters() if "gate" not in name)  # the base frozen


@pytest.mark.slow
def test_a_run_writes_each_entry_its_share_and_the_machine(tiny_base, tmp_path):
    out = tmp_path / "retrofit_speed.json"
    subprocess.run([sys.executable, str(REPO / "benchmarks" / "retrofit_speed.py"), "--min-time", "0.01",
                    "--rounds", "2", "--warmup", "1", "--out", str(out), "--override", *overrides(tiny_base)],
                   check=True, capture_output=True, text=True, timeout=120, env={**os.environ, "OMP_NUM_THREADS": "1"})
    result = json.loads(out.read_text())
    assert result["benchmark"] == "retrofit_speed"
    assert result["settings"]["layers"] == [1] and result["settings"]["tokens_per_step"] == 16
    assert result["settings"]["params"]["gates"] == 32 and result["settings"]["params"]["memory_values"] == 64 * 32
    machine = result["machine"]
    assert machine["device"] == "cpu" and machine["cpu"] and machine["threads"] == 1
    assert machine["torch"] == torch.__version__ and machine["transformers"] == transformers.__version__
    rows = {r["entry"]: r for r in result["rows"]}
    assert list(rows) == list(retrofit_speed.ENTRIES)
    for row in rows.values():
        assert len(row["rounds_tokens_per_s"]) == 2 and all(s > 0 for s in row["rounds_tokens_per_s"])
        assert row["tokens_per_s"] == pytest.approx(sum(row["rounds_tokens_per_s"]) / 2, abs=0.1)  # median of 2
        assert row["ms_per_step"] == pytest.approx(1e3 * 16 / row["tokens_per_s"], rel=1e-3)
    for kind, (ours, base) in retrofit_speed.SHARES.items():
        share = result["memory_share"][kind]
        assert share["share"] == pytest.approx(1 - rows[ours]["tokens_per_s"] / rows[base]["tokens_per_s"], abs=1e-3)
        assert share["by_round"] == pytest.approx([1 - a / b for a, b in zip(rows[ours]["rounds_tokens_per_s"],
                                                                           rows[base]["rounds_tokens_per_s"])],
                                                  abs=1e-3)


@pytest.mark.parametrize("extra, key", [(["optim.lora.rank=2"], "optim.lora.rank"),
                                        (["optim.accumulate=2"], "optim.accumulate"),
                                        (None, "model.base.path")])
def test_what_it_does_not_time_is_refused_in_one_line(tiny_base, extra, key, capsys):
    given = ["model.base.path="] if extra is None else [*overrides(tiny_base), *extra]  # None: no base
    assert retrofit_speed.main(["--override", *given]) == EXIT_ERROR
    (line,) = capsys.readouterr().err.splitlines()
    assert line.startswith(f"{retrofit_speed.PROG}: error: {key}")
