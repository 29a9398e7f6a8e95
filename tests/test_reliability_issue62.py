"""Accidents of issues 62 and 63 that lost a user's file, overwrote an input, reused a stale run or said
nothing of a wrong figure, each reproduced (docs/reliability.md)."""

from pathlib import Path

import pytest
import torch
from test_export import VARIANTS, random_checkpoint

from xlm_pkm.inference.export import export

ROOT = Path(__file__).resolve().parent.parent


def one_line(capsys) -> str:
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1, err
    return err[0]


# ---- 62.12: an export loaded in bf16 or fp16 runs ------------------------------------------------------
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("kind", VARIANTS)
def test_an_export_loaded_in_half_precision_runs_its_memory_in_float32(kind, dtype, tiny_data_dir, tmp_path):
    """from_pretrained(..., dtype=bf16/fp16): the first forward failed ("mixed dtype (CPU)": the BatchNorm's
    parameters cast to bf16 against the float32 query). The memory layers stay float32 (the layer's numeric rule),
    the rest in `dtype`: the logits are the float32 model's within that dtype's rounding."""
    transformers = pytest.importorskip("transformers")
    original = random_checkpoint(tiny_data_dir, tmp_path / "random.pt", VARIANTS[kind]).eval()  # BatchNorm queries
    out = export(tmp_path / "random.pt", tmp_path / "exported")
    model = transformers.AutoModelForCausalLM.from_pretrained(out, trust_remote_code=True, dtype=dtype)
    assert {p.dtype for _, m in model.lm.memories() for p in m.parameters()} == {torch.float32}
    assert model.lm.tok_emb.weight.dtype == dtype
    tokens = torch.randint(4, original.cfg.vocab_size, (2, 16))
    tokens[:, 0] = 0
    with torch.no_grad():
        logits = model(tokens).logits
        reference = original(tokens)
    assert logits.dtype == dtype
    error = ((logits.float() - reference).abs().mean() / reference.abs().mean()).item()
    # the mean error relative to the logits' scale: a few roundings of the dtype (2^-8 for bf16, 2^-11 for fp16)
    # per layer, and the slots whose top-k place a rounding flips (measured: 0.007-0.009 in bf16, 0.0008-0.0025 in fp16)
    assert error < (2**-5 if dtype == torch.bfloat16 else 2**-7)
    ids = model.generate(tokens[:1, :5], max_new_tokens=4, do_sample=False)
    assert ids.shape == (1, 9)
