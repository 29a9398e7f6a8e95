"""A trained model outside its run: loaded from a run checkpoint, or exported to a folder of plain files.

    python -m xlm_pkm.inference.export dumped/default/demo/best.pt exported/demo [--data DIR]
    model, dictionary = load_exported("exported/demo")         # eval mode, on the CPU
    model, codec, cfg = load_model("dumped/default/demo/best.pt")   # a checkpoint or an exported folder

An exported folder holds `model.safetensors` (the weights; a value table shared by several memory
layers is stored once, under its first name), `config.json` (the run's resolved config), and the
run's `vocab` and, for BPE data, its `codes` (fastBPE formats): everything needed to rebuild the model
and its text preprocessing (text_codec.py: BPE, byte or word level), without the optimizer and run
state of the checkpoint. The safetensors metadata records the training step, the vocabulary
fingerprint, the data's unit (meta.json's: "byte", "word", or "token" for BPE) and the xlm_pkm
version that wrote it.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

from xlm_pkm import __version__
from xlm_pkm.checkpoint.trained import CONFIG, WEIGHTS, load_trained, read_exported
from xlm_pkm.config import Config, to_dict
from xlm_pkm.data.dictionary import Dictionary
from xlm_pkm.data.text_codec import BPE_UNIT, LineCodec, data_unit, text_codec
from xlm_pkm.errors import USER_ERRORS, fail
from xlm_pkm.model.transformer import TransformerLM
from xlm_pkm.utils.atomic import temporary_name, write_bytes, write_error
from xlm_pkm.utils.program import program_name


def export(path: str | Path, out_dir: str | Path, data_dir: str | Path | None = None) -> Path:
    """Writes model.safetensors, config.json, vocab (and BPE codes) of the checkpoint at `path` to
    `out_dir` (created; each file written under a temporary name and renamed)."""
    from safetensors.torch import save_model

    model, cfg, state, data_dir = load_trained(path, data_dir)
    unit = data_unit(data_dir)
    text_files = ("codes", "vocab") if unit == BPE_UNIT else ("vocab",)
    for name in text_files:  # before anything is written: no half-exported folder
        if not (data_dir / name).is_file():
            raise FileNotFoundError(f"{data_dir / name} not found: the run's data dir holds {' and '.join(text_files)}")
    out = Path(out_dir)
    try:
        out.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise write_error(out, e) from None
    metadata = {"step": str(state["step"]), "vocab_fingerprint": Dictionary.load(data_dir / "vocab").fingerprint(),
                "unit": unit, "xlm_pkm_version": __version__, "source": str(path)}
    tmp = temporary_name(out / WEIGHTS)
    try:
        save_model(model, str(tmp), metadata=metadata)  # drops the duplicate names of a shared value table
        umask = os.umask(0)
        os.umask(umask)
        os.chmod(tmp, 0o666 & ~umask)  # as the other files (safetensors creates it private)
        os.replace(tmp, out / WEIGHTS)
    except OSError as e:
        raise write_error(out / WEIGHTS, e) from None
    finally:
        tmp.unlink(missing_ok=True)
    write_bytes(out / CONFIG, (json.dumps(to_dict(cfg), indent=2) + "\n").encode())
    for name in text_files:
        write_bytes(out / name, (data_dir / name).read_bytes())
    return out


def load_exported(out_dir: str | Path) -> tuple[TransformerLM, Dictionary]:
    """(model in eval mode on the CPU, dictionary) of a folder written by export()."""
    model, dictionary, _, _ = read_exported(out_dir)
    return model, dictionary


def load_model(path: str | Path, data_dir: str | Path | None = None) -> tuple[TransformerLM, LineCodec, Config]:
    """(model in eval mode on the CPU, its text codec, the run's config) from a run checkpoint (vocab and
    codes from `data_dir`, default the run's) or from an exported folder (its own)."""
    if Path(path).is_dir():
        model, _, cfg, metadata = read_exported(path)
        return model, text_codec(path, metadata.get("unit", BPE_UNIT)), cfg  # exported before units: BPE
    model, cfg, _, data_dir = load_trained(path, data_dir)
    return model, text_codec(data_dir, data_unit(data_dir)), cfg


def main(argv: list[str] | None = None) -> int:

    prog = program_name("python -m xlm_pkm.inference.export")
    parser = argparse.ArgumentParser(prog=prog, description=__doc__.split("\n")[0])
    parser.add_argument("checkpoint", help="checkpoint.pt or best.pt of a run")
    parser.add_argument("out_dir", help="folder to write model.safetensors, config.json, codes and vocab to")
    parser.add_argument("--data", help="processed data directory (default: the one the model was trained on)")
    args = parser.parse_args(argv)
    try:
        out = export(args.checkpoint, args.out_dir, args.data)
    except USER_ERRORS as e:
        return fail(prog, e)
    print(f"exported {args.checkpoint} to {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
