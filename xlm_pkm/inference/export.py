"""A trained model outside its run: a run checkpoint exported to a folder of plain files, and back.

    python -m xlm_pkm.inference.export dumped/default/demo/best.pt exported/demo [--data DIR]
    python -m xlm_pkm.inference.export --import exported/demo imported.pt     # back to a run checkpoint

Every command that reads a run checkpoint also reads an exported folder (evaluate.py, generate.py,
train.init_from: checkpoint/trained.py's load_trained), so --import is for other tools that read run checkpoints.

An exported folder holds `model.safetensors` (the weights; a value table shared by several memory
layers is stored once, under its first name), `config.json` (the run's resolved config), and the
run's `vocab` and, for BPE data, its `codes` (fastBPE formats): everything needed to rebuild the model
and its text preprocessing (text_codec.py: BPE, byte or word level), without the optimizer and run
state of the checkpoint. It is also a Hugging Face transformers model: config.json adds the keys
transformers reads (model_type, auto_map...), and the folder carries the code to run it without xlm_pkm
(hf_code.py: modeling_xlm_pkm.py and the model's modules, for BPE data tokenization_xlm_pkm.py and
tokenizer_config.json):

    model = AutoModelForCausalLM.from_pretrained("exported/demo", trust_remote_code=True)
    tokenizer = AutoTokenizer.from_pretrained("exported/demo", trust_remote_code=True)   # BPE data

The safetensors metadata records the training step, the vocabulary fingerprint, the data's unit
(meta.json's: "byte", "word", "tokenizer", or "token" for BPE) and the xlm_pkm version that wrote it.

A retrofit (model.base: model/retrofit.py) is exported standalone: `base/` is a plain transformers folder of its
base (save_pretrained, float32, the run's LoRA adapters merged in, its own trained weights with
model.base.trainable), model.safetensors holds the memories and gates, and config.json's model.base.path is "base"
(relative to the folder; trainable false: base/ holds the weights); its data's tokenizer is the
folder's own (tokenizer.json and its config, as the tokenizer saves them: AutoTokenizer needs no remote code).

The safetensors metadata also records a hash of config.json's `model` section (model_config_digest), which
every loader checks (ours and the folder's own code): an edited architecture (n_heads 2 -> 4, the same shapes)
would otherwise load and run with the weights cut another way; and a hash of every other file it wrote
(`files_digest`: config.json whole, vocab, codes, the code, the tokenizer's files, base/), which our loader
checks (checkpoint/trained.py), so that an edited file is one line, not a model that runs other code or
reads another vocabulary. An export never carries plugins: our loader refuses a config.json that names some.
`--verify FOLDER` checks a folder's files against those hashes, e.g. before loading it with trust_remote_code
(a hash tells an edit, not who wrote the folder: its metadata can be rewritten with it).

OUT_DIR is new, empty, or a previous export (its model.safetensors written by export: its metadata has a
vocabulary fingerprint), which is replaced. Each export lists the files it wrote in export_manifest.json:
only those are replaced or removed (a file of the previous export that this one does not write: a stale
`codes`, code no longer needed); any other file in the folder (one's own notes.py) is kept, and one that this
export would overwrite is refused. Any other non-empty folder is refused before anything is written, so that
export never overwrites a `vocab`, `codes` or `config.json` it did not write. Every file is first written (and
flushed to disk) in a temporary folder inside OUT_DIR, then all are renamed into place: a failure (full disk)
is one line naming the file, and leaves the previous export whole.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import re
import shutil
import sys
import tempfile
from pathlib import Path

from xlm_pkm import __version__
from xlm_pkm.checkpoint import files as checkpoint
from xlm_pkm.checkpoint.trained import CONFIG, FILES_DIGEST, WEIGHTS, load_trained, verify_folder, weights_metadata
from xlm_pkm.config import add_plugins_option, import_plugins, to_dict
from xlm_pkm.data.meta import file_digest
from xlm_pkm.data.text_codec import BPE_UNIT
from xlm_pkm.data.tokenized import UNIT as TOKENIZER_UNIT
from xlm_pkm.errors import USER_ERRORS, fail
from xlm_pkm.inference.hf_code import folder_code
from xlm_pkm.inference.hf_config import TOKENIZER_CONFIG, carried_code, hf_keys, tokenizer_config
from xlm_pkm.model.retrofit import RetrofitLM, quiet_transformers
from xlm_pkm.model.transformer import TransformerLM, model_config_digest
from xlm_pkm.utils.atomic import OutputError, is_temporary, temporary_name, write_error
from xlm_pkm.utils.program import program_name

# the data files of an exported folder: ours, a retrofit's base/ and the files its tokenizer saves
BASE = "base"  # a retrofit's base, a transformers folder inside the export
EXPORTED = (WEIGHTS, CONFIG, "vocab", "codes", TOKENIZER_CONFIG, BASE, "tokenizer.json", "special_tokens_map.json",
            "added_tokens.json", "chat_template.jinja")
MANIFEST = "export_manifest.json"  # {"files": [...]}: the files the export wrote, the only ones a new one replaces


def export(path: str | Path, out_dir: str | Path, data_dir: str | Path | None = None) -> Path:
    """Writes model.safetensors, config.json, vocab (and BPE codes) of the checkpoint at `path` to
    `out_dir` (created; new, empty or a previous export, which is replaced whole or not at all)."""
    out = Path(out_dir)
    previous = _check_export_folder(out)  # before reading the checkpoint: no work lost
    trained = load_trained(path, data_dir)
    cfg, data_dir, dictionary, unit = trained.cfg, trained.data_dir, trained.dictionary, trained.unit()
    text_files = ("codes", "vocab") if unit == BPE_UNIT else ("vocab",)
    for name in text_files:  # before anything is written: no half-exported folder
        if not (data_dir / name).is_file():
            raise FileNotFoundError(f"{data_dir / name} not found: an export carries the run's "
                                    f"{' and '.join(text_files)} (from its data dir, or --data DIR)")
    if cfg.plugins:
        raise ValueError(f"{path}: the model's config imports plugins ({', '.join(cfg.plugins)}), whose code an "
                         f"exported folder cannot carry")
    base = trained.model.base if cfg.model.base.path else None
    if base is not None:  # standalone: the base in base/ (trained, if it was), its tokenizer's files beside ours
        cfg = dataclasses.replace(cfg, model=dataclasses.replace(cfg.model, base=dataclasses.replace(
            cfg.model.base, path=BASE, gguf_file="", digest="", trainable=False)))
        trained.model.holds_base = False  # model.safetensors: the memories and gates only
    configs = {CONFIG: {**to_dict(cfg), **hf_keys(cfg, dictionary, unit)}}
    if unit == BPE_UNIT:
        configs[TOKENIZER_CONFIG] = tokenizer_config(dictionary, cfg.model.max_len)
    metadata = {"step": str(trained.step), "vocab_fingerprint": dictionary.fingerprint(),
                "unit": unit, "xlm_pkm_version": __version__, "source": str(path),
                "model_config_digest": model_config_digest(json.loads(json.dumps(configs[CONFIG]["model"])))}
    texts = {**{name: (json.dumps(value, indent=2) + "\n").encode() for name, value in configs.items()},
             **{name: (data_dir / name).read_bytes() for name in text_files},
             **{name: code.encode() for name, code in folder_code(*carried_code(unit)).items()},
             **(_tokenizer_files(trained.codec()) if unit == TOKENIZER_UNIT else {})}
    written = [WEIGHTS, *texts, *([BASE] if base is not None else [])]
    if previous is not None:
        _refuse_overwriting(out, written, previous)
    texts[MANIFEST] = (json.dumps({"files": written}, indent=2) + "\n").encode()
    try:
        out.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise write_error(out, e) from None
    _write_export(out, trained.model, metadata, texts, previous is not None, base)
    for stale in set(previous or ()) - set(written):  # of the previous export: a BPE tokenizer, code, a base/
        shutil.rmtree(out / stale) if (out / stale).is_dir() else (out / stale).unlink(missing_ok=True)
    return out


def _tokenizer_files(codec) -> dict[str, bytes]:
    """{name: bytes} of the files a tokenizer's data's tokenizer saves (save_pretrained), for the folder."""
    with tempfile.TemporaryDirectory() as folder:
        saved = [Path(p) for p in codec.tokenizer.save_pretrained(folder) if Path(p).is_file()]
        return {p.name: p.read_bytes() for p in saved}


def _check_export_folder(out: Path) -> list[str] | None:
    """The files in `out` that the previous export wrote (its manifest; for an export of an earlier version, the
    names of its data files and code), which this one may replace or remove; None when `out` is missing or empty.
    Any other folder is refused (FileExistsError): export overwrites only files it wrote."""
    if not out.exists():
        return None
    if not out.is_dir():
        raise FileExistsError(f"{out} is a file: export writes a folder (give a new or empty one)")
    names = sorted(p.name for p in out.iterdir() if not is_temporary(p))  # *.tmp: left by a killed export
    if not names:
        return None
    if WEIGHTS in names and _written_by_export(out / WEIGHTS):
        try:
            files = json.loads((out / MANIFEST).read_text())["files"]
        except (OSError, ValueError, KeyError, TypeError):  # none: an earlier version's export
            entries, modules = carried_code(BPE_UNIT)  # the most code an export carries
            files = [*EXPORTED, *entries, *(f"{m.rpartition('.')[2]}.py" for m in modules)]
        return [n for n in names if n in files]  # names in the folder only: never a path elsewhere
    others = [n for n in names if n not in EXPORTED and not n.endswith(".py")]
    if others:
        holds = f"it holds {', '.join(others[:4])}{' ...' if len(others) > 4 else ''}"
    elif WEIGHTS not in names:
        holds = f"it holds {', '.join(names)} but no {WEIGHTS}"
    else:
        holds = f"its {WEIGHTS} was not written by export"
    raise FileExistsError(f"{out} is not empty and not a previous export ({holds}): export into a new or empty "
                          f"folder, or a previous export (its {WEIGHTS} written by export), so that no other file "
                          f"is overwritten")


def _refuse_overwriting(out: Path, names: list[str], previous: list[str]) -> None:
    """FileExistsError if a file of `names` is in `out` but the previous export did not write it: a user's own."""
    theirs = [n for n in names if n not in previous and (out / n).exists()]
    if theirs:
        raise FileExistsError(f"{out / theirs[0]} was not written by the previous export (it is not in its "
                              f"{MANIFEST}), and this export writes a file of that name: move it away, or export "
                              f"into another folder")


def _written_by_export(weights: Path) -> bool:
    from safetensors import safe_open

    try:
        with safe_open(str(weights), "pt") as f:
            return "vocab_fingerprint" in (f.metadata() or {})
    except Exception:  # truncated or foreign
        return False


def _write_export(out: Path, model: TransformerLM | RetrofitLM, metadata: dict, texts: dict[str, bytes],
                  previous: bool, base=None) -> None:
    """Every file written and flushed to disk in a temporary folder inside `out`, then renamed into place (a
    retrofit's `base`, saved by transformers, as the folder base/): an error (disk full) before the renames leaves
    the previous export whole; it is one line (OutputError)."""
    from safetensors import SafetensorError
    from safetensors.torch import save_model

    stage = temporary_name(out / "export")
    names = [*texts]
    name, renaming = WEIGHTS, False
    try:
        stage.mkdir()
        for name, data in texts.items():
            (stage / name).write_bytes(data)
        if base is not None:
            name = BASE
            with quiet_transformers():
                base.save_pretrained(stage / BASE)
            names += [f"{BASE}/{p.name}" for p in (stage / BASE).iterdir()]
        name = WEIGHTS
        digests = {n: file_digest(stage / n) for n in names if n != MANIFEST}  # what a loader reads, but the weights
        metadata = {**metadata, FILES_DIGEST: json.dumps(digests, sort_keys=True)}
        save_model(model, str(stage / WEIGHTS), metadata=metadata)  # drops the duplicate names of a shared value table
        names.insert(0, WEIGHTS)
        umask = os.umask(0)
        os.umask(umask)
        for name in [n for n in names if n.endswith(".safetensors")]:
            os.chmod(stage / name, 0o666 & ~umask)  # as the other files (safetensors creates it private)
        for name in names:
            fd = os.open(stage / name, os.O_RDONLY)
            try:
                os.fsync(fd)
            finally:
                os.close(fd)
        renaming = True
        if base is not None:  # the previous base/ goes once this one is whole
            shutil.rmtree(out / BASE, ignore_errors=True)
            os.replace(stage / BASE, out / BASE)
        for name in [n for n in names if not n.startswith(f"{BASE}/")]:
            os.replace(stage / name, out / name)
    except OSError as e:
        raise _export_error(out, name, e, previous, renaming) from None
    except SafetensorError as e:
        error = _safetensors_os_error(e)
        if error is None:  # not an I/O error: a bug, keep the traceback
            raise
        raise _export_error(out, WEIGHTS, error, previous, renaming) from None
    finally:
        shutil.rmtree(stage, ignore_errors=True)


def _export_error(out: Path, name: str, error: OSError, previous: bool, renaming: bool) -> OutputError:
    if renaming:  # files are being renamed into place: the folder may mix both exports
        state = f"; {out} may now mix the previous export and this one: export again"
    else:
        state = f"; the previous export in {out} is kept" if previous else ""
    return OutputError(f"cannot write {out / name}: {error.strerror or error}{state}")


def _safetensors_os_error(error: Exception) -> OSError | None:
    """The OSError inside a SafetensorError of an I/O failure ('... (os error 28)'), None for another one."""
    found = re.search(r"\(os error (\d+)\)|Os \{ code: (\d+)", str(error))
    if found is None:
        return None
    code = int(found.group(1) or found.group(2))
    return OSError(code, os.strerror(code))


def verify_export(folder: Path) -> int:
    """The number of files of the exported `folder` that match the hashes its weights record (ValueError naming
    the first that does not: trained.verify_folder)."""
    if not (folder / WEIGHTS).is_file():
        raise FileNotFoundError(f"{folder / WEIGHTS} not found: not a folder written by python -m "
                                f"xlm_pkm.inference.export")
    metadata = weights_metadata(folder)
    if FILES_DIGEST not in metadata:
        raise ValueError(f"{folder / WEIGHTS}: records no hashes of the folder's files (exported by an earlier "
                         f"version): export the run again to have them")
    return verify_folder(folder, metadata)


def import_exported(folder: str | Path, out_path: str | Path) -> Path:
    """The exported folder back as a run checkpoint (best.pt's form: config, model, step, vocab_fingerprint),
    for tools that read run checkpoints: model and config as they went out, bit for bit."""
    out_path = Path(out_path)
    if out_path.exists():
        raise FileExistsError(f"{out_path} exists: import writes a new checkpoint file")
    trained = load_trained(folder, folder)  # its own vocab
    state = {"config": to_dict(trained.cfg), "model": trained.model.state_dict(), "step": trained.step,
             "vocab_fingerprint": trained.vocab_fingerprint}
    checkpoint.save_atomic(state, out_path)  # whole or not at all; a failed write is one line
    return out_path


def main(argv: list[str] | None = None) -> int:

    prog = program_name("python -m xlm_pkm.inference.export")
    parser = argparse.ArgumentParser(prog=prog, description=__doc__.split("\n")[0])
    parser.add_argument("checkpoint", help="checkpoint.pt or best.pt of a run (with --import or --verify: an exported "
                                           "folder)")
    parser.add_argument("out_dir", nargs="?", help="folder to export to (with --import: the checkpoint file to write)")
    parser.add_argument("--data", help="processed data directory (default: the one the model was trained on)")
    parser.add_argument("--import", dest="back", action="store_true",
                        help="the other way: an exported folder back into a run checkpoint (best.pt's form)")
    parser.add_argument("--verify", action="store_true",
                        help="check an exported folder's files against the hashes its weights record, and exit")
    add_plugins_option(parser)
    args = parser.parse_args(argv)
    if (args.out_dir is None) != args.verify:
        parser.error("give CHECKPOINT OUT_DIR, or --verify FOLDER")
    try:
        import_plugins(args.plugins)
        if args.verify:
            print(f"{args.checkpoint}: {verify_export(Path(args.checkpoint))} files as exported")
            return 0
        if args.back:
            if args.data:
                raise ValueError("--data: an exported folder carries its own vocab and codes")
            out = import_exported(args.checkpoint, args.out_dir)
        else:
            out = export(args.checkpoint, args.out_dir, args.data)
    except USER_ERRORS as e:
        return fail(prog, e)
    print(f"{'imported' if args.back else 'exported'} {args.checkpoint} to {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
