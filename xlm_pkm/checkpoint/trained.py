"""A trained model, loaded whole and checked: from a run checkpoint or from an exported folder. Every command
that reads a trained model (evaluate.py, generate.py, export, train.init_from, slot counts...) loads it here.

    trained = load_trained("dumped/x/y/best.pt")   # or checkpoint.pt, or a folder of python -m xlm_pkm.inference.export
    trained.model, trained.cfg, trained.step        # eval mode, on the CPU; the run's config
    trained.codec().encode("The module")            # the text codec of trained.data_dir

The vocabulary the model was trained with (the fingerprint recorded with its weights) is checked against
that of `data_dir`: by default the run's data (data.path of its config), for a checkpoint and an exported
folder alike. An exported folder carries its own vocab and codes, so it can be its own data_dir (generate.py,
--import): it then needs no processed data at all.

A retrofit (model.base: model/retrofit.py) is its base, loaded from model.base.path (an exported folder's base/)
and checked against the digest its config records, with the checkpoint's trained tensors; a run's LoRA adapters
are merged into the base's weights (RetrofitLM.merge_adapters).
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass
from pathlib import Path

from xlm_pkm.checkpoint import dcp_tensors, sharded_values
from xlm_pkm.checkpoint import files as checkpoint
from xlm_pkm.config import Config, load_config_dict
from xlm_pkm.data.dictionary import Dictionary
from xlm_pkm.data.meta import file_digest
from xlm_pkm.data.text_codec import BPE_UNIT, Codec, data_unit, text_codec
from xlm_pkm.model.retrofit import RetrofitLM, load_base
from xlm_pkm.model.transformer import TransformerLM, model_config_digest
from xlm_pkm.runtime.distributed import DistEnv

WEIGHTS, CONFIG = "model.safetensors", "config.json"  # an exported folder's weights and config
FILES_DIGEST = "files_digest"  # the weights' metadata key: JSON {file name: blake2b} of the folder's other files


@dataclass
class TrainedModel:
    """A trained model and what the commands need of its run."""

    model: TransformerLM | RetrofitLM  # eval mode, on the CPU
    cfg: Config  # the run's resolved config
    dictionary: Dictionary  # the vocabulary of data_dir, the model's (fingerprints checked)
    data_dir: Path  # whose vocabulary was checked: the run's data, another data dir, or the exported folder itself
    step: int  # the training step of the weights
    vocab_fingerprint: str | None  # recorded with the weights (None: a checkpoint of an early version)
    source: Path  # the checkpoint file or the exported folder
    extra: dict  # a checkpoint's entries but its model (config, optimizers...); a folder's weights metadata

    def unit(self) -> str:
        """The data's unit (text_codec.py): meta.json's of data_dir for a checkpoint; for an exported folder, the
        one its weights' metadata records (BPE for a folder exported before units were recorded)."""
        return self.extra.get("unit", BPE_UNIT) if self.source.is_dir() else data_unit(self.data_dir)

    def codec(self) -> Codec:
        """Text <-> token ids with the run's own preprocessing (data_dir's vocab, and codes for BPE data)."""
        return text_codec(self.data_dir, self.unit())


def load_trained(path: str | Path, data_dir: str | Path | None = None, env: DistEnv | None = None) -> TrainedModel:
    """The trained model of a run checkpoint (checkpoint.pt, best.pt) or of an exported folder, after checking
    that the vocabulary of `data_dir` (default: the run's data) is the one the model was trained with.
    Given the `env` of several processes, it is collective: each rank loads its value columns, and if one rank
    cannot (its value shard file missing or damaged) every rank raises (sharded_values.on_every_rank). Loaded
    alone (no `env`), a model's value tables are whole, even in a process of a group (train.init_from)."""
    env = env or DistEnv()
    return sharded_values.on_every_rank(lambda: _load(Path(path), data_dir, env.is_distributed), env, path)


READS = 3  # times a checkpoint file that a live run replaces meanwhile is read before giving up


def _identity(path: Path) -> tuple[int, int] | None:
    """What changes when a save replaces the file at `path` (a rename: another inode), None if it is gone."""
    try:
        stat = path.stat()
    except OSError:
        return None
    return stat.st_ino, stat.st_mtime_ns


def _load(path: Path, data_dir: str | Path | None, sharded: bool) -> TrainedModel:
    """_load_file, read again when a live run replaced the checkpoint meanwhile: a save renames a new checkpoint.pt
    into place, then removes the tensors' folder (or best.pt's value files) that the previous one named, which a
    load between the two reads cannot find any more."""
    if path.is_dir():
        return _load_folder(path, data_dir)
    if not path.exists():
        raise FileNotFoundError(f"{path} does not exist: give a run's checkpoint.pt or best.pt, or a folder "
                                f"written by python -m xlm_pkm.inference.export")
    for _ in range(READS):
        before = _identity(path)
        try:
            return _load_file(path, data_dir, sharded)
        except (ValueError, FileNotFoundError):
            if _identity(path) == before:  # the file read is the file there: really damaged
                raise
    raise ValueError(f"{path}: replaced by a newer checkpoint each of the {READS} times it was read (a live run "
                     f"saving it meanwhile): run the command again, or give a copy")


def _load_file(path: Path, data_dir: str | Path | None, sharded: bool) -> TrainedModel:
    state = checkpoint.load(path, mmap=True)  # its tables read into the model's, no copy of them held meanwhile
    if dcp_tensors.KEY in state:  # checkpoint.pt's tensors, read whole at once: the folder it names is still there
        state = dcp_tensors.read_whole(state, path, optimizers=False)
    cfg = load_config_dict(state["config"], source=str(path))
    data_dir, dictionary = _check_vocabulary(cfg, state.get("vocab_fingerprint"), data_dir, path)
    _check_codes(state.get("codes_digest"), Path(cfg.data.path), data_dir, path)
    model = _build(cfg, whole=not sharded)  # sharded values: this rank's columns under several processes (env)
    shard = sharded_values.model_shard(model)
    if dcp_tensors.KEY in state:  # this rank's columns of sharded values
        names = sharded_values.sharded_names(model)
        state["model"] = {k: t[:, shard.columns(t.shape[1])] if k in names else t for k, t in state["model"].items()}
    else:
        state = sharded_values.attach(state, path, shard)
    if cfg.model.base.path and cfg.optim.lora.rank:
        state["model"] = model.merge_adapters(state["model"], cfg.optim.lora.alpha / cfg.optim.lora.rank)
    checkpoint.load_model_state(model, state.pop("model"), path)
    return TrainedModel(model.eval(), cfg, dictionary, data_dir, state["step"], state.get("vocab_fingerprint"),
                        path, state)


def _load_folder(out: Path, data_dir: str | Path | None) -> TrainedModel:
    """An exported folder: model.safetensors (its metadata: step, vocab_fingerprint, unit...), config.json."""
    from safetensors.torch import load_model as load_weights

    for name in (WEIGHTS, CONFIG):
        if not (out / name).is_file():
            raise FileNotFoundError(f"{out / name} not found: not a folder written by python -m "
                                    f"xlm_pkm.inference.export (nor a run's checkpoint.pt or best.pt)")
    try:
        raw = json.loads((out / CONFIG).read_text())
    except json.JSONDecodeError as e:
        raise ValueError(f"{out / CONFIG}: not valid JSON ({e})") from None
    if not isinstance(raw, dict):
        raise ValueError(f"{out / CONFIG}: not a JSON object (an exported config)")
    if raw.get("plugins"):
        raise ValueError(f"{out / CONFIG}: names plugins ({raw['plugins']}), which an exported folder never carries "
                         f"(export refuses them): the file was edited; an exported folder runs no code of its own")
    metadata = weights_metadata(out)
    verify_folder(out, metadata)
    _check_model_config(raw.get("model"), metadata.get("model_config_digest"), out)
    run_keys = {f.name for f in dataclasses.fields(Config)}  # not the keys transformers reads (inference/hf_config.py)
    cfg = load_config_dict({k: v for k, v in raw.items() if k in run_keys}, source=str(out / CONFIG))
    data_dir, dictionary = _check_vocabulary(cfg, metadata.get("vocab_fingerprint"), data_dir, out / WEIGHTS)
    _check_codes(None, out, data_dir, out / WEIGHTS)
    model = _build(cfg, whole=True, root=out)  # an exported folder holds whole value tables (and a retrofit's base)
    try:
        load_weights(model, str(out / WEIGHTS))
    except RuntimeError as e:
        raise ValueError(f"{out / WEIGHTS}: weights of another architecture than {out / CONFIG} "
                         f"({' '.join(str(e).split())[:300]})") from None
    checkpoint.refuse_non_finite(model.state_dict(), out / WEIGHTS)
    return TrainedModel(model.eval(), cfg, dictionary, data_dir, int(metadata.get("step", 0)),
                        metadata.get("vocab_fingerprint"), out, metadata)


def weights_metadata(out: Path) -> dict[str, str]:
    """The metadata of the exported folder's model.safetensors (ValueError when it is not a readable one)."""
    from safetensors import safe_open

    try:
        with safe_open(str(out / WEIGHTS), "pt") as f:
            return f.metadata() or {}
    except Exception as e:  # a truncated or foreign file
        raise ValueError(f"{out / WEIGHTS}: not a readable safetensors file ({e})") from None


def verify_folder(out: Path, metadata: dict) -> int:
    """The number of files of the exported folder `out` checked against the hashes that its weights' metadata
    records (FILES_DIGEST; none in a folder exported before they were recorded); ValueError naming the first one
    missing or edited since the export."""
    try:
        digests = json.loads(metadata.get(FILES_DIGEST, "{}"))
    except ValueError:
        digests = None
    if not isinstance(digests, dict) or not all(isinstance(v, str) for v in digests.values()):
        raise ValueError(f"{out / WEIGHTS}: its metadata's {FILES_DIGEST} is not the JSON that export writes")
    for name, digest in sorted(digests.items()):
        file = out / name
        if Path(name).is_absolute() or ".." in Path(name).parts or not file.is_file() or file.is_symlink():
            raise ValueError(f"{file}: recorded by {out / WEIGHTS} but not a file of the folder: copy the whole "
                             f"exported folder, or export the run again")
        if file_digest(file) != digest:
            raise ValueError(f"{file}: edited since the export (blake2b {file_digest(file)}, {out / WEIGHTS} records "
                             f"{digest}): restore it, or export the run again")
    return len(digests)


def _check_model_config(model: dict, digest: str | None, out: Path) -> None:
    """config.json's `model` section is the one the weights were exported with (the digest their metadata records;
    none before it was recorded): an edited n_heads keeps every shape and would load and run cut another way."""
    if digest is not None and model_config_digest(model) != digest:
        raise ValueError(f"{out / CONFIG}: its model section is not the one {out / WEIGHTS} was exported with (hash "
                         f"{model_config_digest(model)[:12]}, recorded {digest[:12]}): it was edited; export the run's "
                         f"checkpoint again, or restore config.json")


def _check_vocabulary(cfg: Config, fingerprint: str | None, data_dir: str | Path | None,
                      source: Path) -> tuple[Path, Dictionary]:
    """(data dir, its dictionary): default the run's data; its vocabulary is the model's (size and fingerprint; a
    retrofit's base may have more embedding rows than its tokenizer has tokens)."""
    data_dir = Path(data_dir or cfg.data.path)
    dictionary = Dictionary.load(data_dir / "vocab")
    if len(dictionary) > cfg.model.vocab_size or len(dictionary) < cfg.model.vocab_size and not cfg.model.base.path:
        raise ValueError(f"{source}: model has a vocabulary of {cfg.model.vocab_size} tokens, "
                         f"{data_dir}/vocab has {len(dictionary)}")
    checkpoint.check_vocabulary({"vocab_fingerprint": fingerprint}, dictionary.fingerprint(), data_dir / "vocab",
                                source)
    return data_dir, dictionary


def _check_codes(digest: str | None, own_data: Path, data_dir: Path, source: Path) -> None:
    """The BPE codes of `data_dir` are the model's: those whose `digest` its checkpoint records, else those of
    its own data (`own_data`: the run's data dir, or the exported folder), where it can be read. Other codes
    with the same vocabulary would split text otherwise without a word (and export would ship them)."""
    codes = data_dir / "codes"
    own = own_data / "codes"
    if not codes.is_file() or (digest is None and (not own.is_file() or own.resolve() == codes.resolve())):
        return
    expected = digest or file_digest(own)
    if file_digest(codes) != expected:
        raise ValueError(f"{codes}: other BPE codes than {source} was trained with (blake2b {file_digest(codes)}, "
                         f"the model's {expected}{'' if digest else ' in ' + str(own)}): text would be split "
                         f"into other tokens; give a data dir with the model's codes (its run's data.path)")


def _build(cfg: Config, whole: bool, root: Path | None = None) -> TransformerLM | RetrofitLM:
    """The run's model; with `whole`, sharded value tables (model.memory.shard_values) hold every column. A
    retrofit's base is read from model.base.path (relative to `root` when given: an exported folder)."""
    model_cfg = cfg.model
    if whole and cfg.model.memory.shard_values is True:
        model_cfg = dataclasses.replace(cfg.model, memory=dataclasses.replace(cfg.model.memory, shard_values=False))
    if model_cfg.base.path:
        return RetrofitLM(model_cfg, load_base(model_cfg.base, root))
    return TransformerLM(model_cfg)
