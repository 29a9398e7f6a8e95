"""Raw text -> Moses tokens -> fastBPE -> binary shards, streaming and in parallel.

    python -m xlm_pkm.data.preprocess (--input PATH [PATH ...] | --hf-dataset NAME [--hf-data-files PATTERN ...]
        [--hf-config C] [--hf-split S] [--text-field F]) --output DIR
        [--bpe-codes N | --codes FILE [--vocab FILE] | --tokenizer FOLDER [--gguf-file FILE]] [--workers N]
        [--valid-docs N] [--test-docs N] [--seed S] [--chunk-mb MB] [--keep-intermediate] [--slurm-partition P]

A Hugging Face dataset (--hf-dataset, streamed: hf_source.py) gives the shards the same documents give as JSONL.
With --tokenizer (a pretrained model's folder, for a model retrofitted with memories: model/retrofit.py), its
Hugging Face tokenizer makes the token ids instead of steps 2 to 5 (tokenized.py: the tokenizer's own ids, its
files and DIR/vocab of its tokens); the plan, held-out documents, shards and meta.json are the same.

Steps (see plan.py for the held-out split and the chunks):
  1. scan the inputs (one pass, parallel over files) and write DIR/plan.json; held-out sizes not given
     are then set from the number of documents (the paper's 5,000 each from 100,000 on, else 5% each,
     told in one line on stderr) and recorded;
  2. tokenize each chunk (Moses, one line per line, blank lines dropped, a blank line after each
     document) into DIR/work/NNNNN.{train,valid,test}.tok;
  3. learn DIR/codes with `fast learnbpe` on the train text (unless --codes);
  4. apply BPE to the train text with the fastBPE binding (same bytes as `fast applybpe`);
  5. DIR/vocab with `fast getvocab` on the train BPE text (unless --vocab: then that file, given before
     step 4, which is then limited to it too); valid/test BPE is limited to it, as in XLM;
  6. binarize: one DIR/train.NNN.bin per chunk, DIR/valid.000.bin, DIR/test.000.bin (shard.py),
     and DIR/meta.json, written last (meta.py). With --keep-intermediate, DIR/{train,valid,test}.{tok,bpe} too.
Every output is written under a temporary name unique to its process and renamed (xlm_pkm/utils/atomic.py); a
write that fails (disk full, read-only) is a one-line error and leaves the previous file. One run at a
time holds DIR (xlm_pkm/utils/lock.py); its workers die with it. A re-run skips finished work: DIR is complete only
when meta.json records these inputs and options and every file it lists is intact (re-hashed); a
damaged output is rebuilt. A DIR holding outputs but no plan.json is refused (not ours to trust).
Documents that are empty after tokenization are dropped.
Ctrl-C (SIGINT, to the whole process group from a terminal) ends the run with one line and exit status 130: the
workers ignore it and are ended by the parent (executor.py), the lock is released, and the line says what DIR keeps
(plan.json, the chunks done); the same command again resumes from there. A second Ctrl-C while it ends is ignored.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import logging
import os
import shutil
import signal
import sys
import threading
import time
from contextlib import ExitStack, contextmanager, suppress
from functools import partial
from pathlib import Path
from typing import Callable

from xlm_pkm.errors import EXIT_INTERRUPTED, USER_ERRORS, UserError, fail
from xlm_pkm.utils.atomic import atomic_file, is_temporary, write_error, write_text
from xlm_pkm.utils.lock import DirectoryLock
from xlm_pkm.utils.path_kind import path_problem
from xlm_pkm.utils.program import program_name

from .corpus import CorpusError, folder_files, missing_input
from .dictionary import Dictionary
from .executor import Executor
from .fastbpe import bpe_applier, check_codes, find_fastbpe, get_vocab, learn_codes
from .hf_source import DatasetInput, dataset_inputs, dataset_options
from .meta import SPLITS, output_record, verify_outputs
from .moses import tokenize_document
from .plan import (
    MB,
    Chunk,
    Plan,
    PlanError,
    held_out_notice,
    input_identity,
    input_mb,
    make_plan,
    open_input,
    resolve_held_out,
    scan_file,
)
from .shard import ShardWriter, is_complete, token_dtype
from .tokenized import (
    UNIT,
    binarize_documents,
    load_tokenizer,
    merge_shards,
    save_tokenizer,
    tokenizer_dictionary,
    tokenizer_digest,
    write_vocab,
)

HELD_OUT = ("valid", "test")
BPE_BATCH_LINES = 10_000
log = logging.getLogger("xlm_pkm.data.preprocess")


def work_file(work: Path, chunk: int, split: str, kind: str) -> Path:
    return work / f"{chunk:05d}.{split}.{kind}"


def tokenize_chunk(work: Path, held_out: dict[str, list[int]], chunk: Chunk, source: str | DatasetInput) -> None:
    """Tokenize the documents of a chunk of `source` into one .tok file per split (held-out ones by global index)."""
    outputs = [work_file(work, chunk.index, split, "tok") for split in SPLITS]
    if all(p.exists() for p in outputs):
        return
    split_of = {g: split for split in HELD_OUT for g in held_out[split]}
    with ExitStack() as stack:
        files = {split: stack.enter_context(atomic_file(p, "w", encoding="utf-8", newline="\n"))
                 for split, p in zip(SPLITS, outputs)}
        for index, text in enumerate(open_input(source)):
            if index < chunk.doc_start:
                continue
            if index >= chunk.doc_stop:
                break
            lines = tokenize_document(text)
            if lines:
                split = split_of.get(chunk.global_start + index - chunk.doc_start, "train")
                files[split].write("\n".join(lines) + "\n\n")


def apply_bpe(src: Path, dst: Path, codes: Path, vocab: Path | None) -> None:
    """Apply BPE codes (limited to `vocab` when given) to a text file, line by line, in batches."""
    if dst.exists():
        return
    applier = bpe_applier(codes, vocab)
    with (open(src, encoding="utf-8", newline="\n") as fin,
          atomic_file(dst, "w", encoding="utf-8", newline="\n") as fout):
        batch: list[str] = []
        for line in fin:
            batch.append(line.rstrip("\n"))
            if len(batch) == BPE_BATCH_LINES:
                fout.write("\n".join(applier.apply(batch)) + "\n")
                batch = []
        if batch:
            fout.write("\n".join(applier.apply(batch)) + "\n")


def bpe_documents(paths: list[Path], dictionary: Dictionary):
    """Token ids of each document in BPE text files: <s>, then each line's ids followed by </s>."""
    index, unk, eos = dictionary.ids.get, dictionary.unk, dictionary.eos
    for path in paths:
        with open(path, encoding="utf-8", newline="\n") as f:
            ids = [dictionary.bos]
            for line in f:
                if line == "\n":
                    if len(ids) > 1:
                        yield ids
                    ids = [dictionary.bos]
                else:
                    ids.extend(index(w, unk) for w in line.rstrip("\n").split(" ") if w)
                    ids.append(eos)
            if len(ids) > 1:
                yield ids


def binarize(paths: list[Path], shard: Path, dictionary: Dictionary) -> None:
    if is_complete(shard, dictionary.fingerprint()):
        return
    with ShardWriter(shard, token_dtype(len(dictionary)), dictionary.fingerprint()) as writer:
        for ids in bpe_documents(paths, dictionary):
            writer.add_document(ids)


def binarize_chunk(out: Path, work: Path, chunk: int) -> None:
    """BPE of the chunk's held-out text (limited to the vocab), then its train shard."""
    for split in HELD_OUT:
        apply_bpe(work_file(work, chunk, split, "tok"), work_file(work, chunk, split, "bpe"), out / "codes",
                  out / "vocab")
    binarize([work_file(work, chunk, "train", "bpe")], out / f"train.{chunk:03d}.bin", Dictionary.load(out / "vocab"))


def _concatenate(paths: list[Path], dst: Path) -> None:
    with atomic_file(dst) as fout:
        for p in paths:
            with open(p, "rb") as fin:
                shutil.copyfileobj(fin, fout, 1 << 20)


def _outputs_without_plan(out: Path) -> list[str]:
    """Names in `out` that a preprocessing run writes after plan.json."""
    ours = {"meta.json", "codes", "vocab"} | {f"{s}.{k}" for s in SPLITS for k in ("tok", "bpe")}
    return sorted(p.name for p in out.iterdir()
                  if p.name in ours or (p.suffix == ".bin" and p.name.split(".")[0] in SPLITS))


def _load_plan(out: Path, inputs: list[str | DatasetInput], options: dict, executor: Executor) -> Plan:
    """DIR/plan.json if it is the plan of these inputs and options (held-out sizes not given resolved
    from its number of documents, as when it was made), else a new plan from a scan of the inputs."""
    path = out / "plan.json"
    sizes = [input_mb(p) for p in inputs]
    identities = executor.map(input_identity, inputs, "hash inputs", sizes)
    _check_distinct(inputs, identities)
    if path.exists():
        plan = Plan.load(path)
        if plan.inputs == identities:
            options = resolve_held_out(options, plan.n_docs)
        if plan.inputs != identities or plan.options != options:
            raise PlanError(f"{out} holds the output of other inputs or options (see {path}): "
                            "use another --output or delete it")
        return plan
    found = _outputs_without_plan(out)
    if found:
        raise PlanError(f"{out} holds {', '.join(found[:4])}{' ...' if len(found) > 4 else ''} but no plan.json: "
                        "not the output of these inputs; use another --output or delete them")
    scans = executor.map(scan_file, inputs, "scan", sizes)
    plan = make_plan(identities, options, scans)
    plan.save(path)
    return plan


def _remove_temporary_files(out: Path) -> None:
    """Temporary files left by killed runs (this run holds the lock: none is in use)."""
    for directory in (out, out / "work"):
        if directory.is_dir():
            for p in directory.iterdir():
                if is_temporary(p) and p.is_file():
                    p.unlink()


def _plan_record(plan: Plan) -> dict:
    return {"inputs": plan.inputs, "options": plan.options}


def _is_complete(out: Path, plan: Plan) -> bool:
    """True when meta.json proves `out` complete; else removes meta.json and the damaged files it lists."""
    problem, damaged = verify_outputs(out, _plan_record(plan))
    if problem is None:
        return True
    if (out / "meta.json").exists():
        log.warning("%s: rebuilding what is missing or damaged", problem)
        (out / "meta.json").unlink()
    for path in damaged:
        path.unlink(missing_ok=True)
    return False


def preprocess(inputs: list[str | DatasetInput], output: str | Path, n_codes: int = 60000, codes: str | None = None,
               valid_docs: int | None = None, test_docs: int | None = None, seed: int = 0,
               chunk_mb: float | None = None, keep_intermediate: bool = False, executor: Executor | None = None,
               vocab: str | None = None, notice: Callable[[str], None] | None = None, tokenizer: str | None = None,
               gguf_file: str | None = None) -> dict:
    """Run the pipeline; return {step: seconds} (steps skipped on a re-run take ~0 s). `vocab` (with
    `codes`): reuse that vocabulary (e.g. a pretraining corpus's), words outside it become <unk>. `tokenizer`: a
    Hugging Face model's folder (`gguf_file`: its GGUF file) whose tokenizer makes the ids (tokenized.py).
    valid_docs / test_docs None: `plan.default_held_out` of the number of documents; when that is not
    the paper's 5,000, `notice` (default: a logged warning) gets a line saying so. `inputs` are file paths, or
    a dataset's inputs (`hf_source.dataset_inputs`)."""
    out, work = Path(output), Path(output) / "work"
    problem = path_problem("folder", out) if os.path.lexists(out) else None
    if problem:  # a file, a pipe, a broken symbolic link (a link to a folder is one)
        raise PlanError(f"--output: {problem}: give a folder (a new one, or one that preprocessing wrote)")
    if tokenizer and (codes or vocab or keep_intermediate):
        raise PlanError("--tokenizer makes the ids itself: no --codes, --vocab or --keep-intermediate")
    tokenizer = load_tokenizer(tokenizer, gguf_file, "--tokenizer") if tokenizer else None
    options = _checked_options(inputs, n_codes, codes, valid_docs, test_docs, seed, chunk_mb, vocab, tokenizer)
    executor = executor or Executor()
    executor.slurm_folder = work / "slurm"
    with DirectoryLock(out, "preprocess.lock", "wait for it to finish or stop it", remove=True):
        try:
            with executor:
                _remove_temporary_files(out)
                return _run(inputs, out, work, options, codes, vocab, keep_intermediate, executor,
                            notice or log.warning, tokenizer)
        except BaseException as e:
            if not isinstance(e, Exception) and not executor.slurm_partition:  # Ctrl-C: the workers were ended
                with suppress(OSError):  # (executor.py), their unfinished files are not worth keeping; else the
                    _remove_temporary_files(out)  # next run removes them
            raise


def _checked_options(inputs, n_codes, codes, valid_docs, test_docs, seed, chunk_mb, vocab, tokenizer=None) -> dict:
    """The options that must match on a re-run, after checking the inputs and the codes (or the tokenizer)."""
    for p in inputs:
        if isinstance(p, DatasetInput):
            continue
        if Path(p).is_dir():
            raise CorpusError(_directory_input(Path(p)))
        if not Path(p).is_file():
            raise CorpusError(missing_input(Path(p)))
    for name, n in (("--valid-docs", valid_docs), ("--test-docs", test_docs)):
        if n is not None and n < 0:
            raise PlanError(f"{name} must be >= 0, got {n} (or leave it out: 5% of the documents, at most 5,000)")
    held_out = {"valid_docs": valid_docs, "test_docs": test_docs, "seed": seed, "chunk_mb": chunk_mb}
    if tokenizer is not None:
        return {**held_out, "tokenizer_sha256": tokenizer_digest(tokenizer),
                **({"hf_dataset": dataset_options(inputs)} if dataset_options(inputs) else {})}
    find_fastbpe()
    for option, path in (("--codes", codes), ("--vocab", vocab)):
        problem = path_problem("file", Path(path)) if path and os.path.lexists(path) else None
        if problem:  # a folder, or a pipe: read more than once (checked, hashed, copied)
            raise PlanError(f"{option}: {problem}")
    codes_digest = None
    if codes:
        check_codes(Path(codes))
        codes_digest = hashlib.sha256(Path(codes).read_bytes()).hexdigest()
    elif n_codes < 1:
        raise PlanError(f"--bpe-codes must be positive, got {n_codes}")
    options = {**held_out, "n_codes": None if codes else n_codes, "codes_sha256": codes_digest}
    if vocab:  # a key only then: data dirs made without --vocab stay complete
        if not codes:
            raise PlanError("--vocab needs --codes (the codes that vocabulary was made with)")
        Dictionary.load(vocab)  # DictionaryError if missing or malformed
        options["vocab_sha256"] = hashlib.sha256(Path(vocab).read_bytes()).hexdigest()
    if dataset_options(inputs):  # a key only then, as vocab_sha256
        options["hf_dataset"] = dataset_options(inputs)
    return options


def _directory_input(path: Path) -> str:
    """What to say of a directory given as --input: inputs are files (give the directory's files)."""
    try:
        files, kinds = folder_files(path)
    except OSError as e:
        return f"--input {path} is a directory, not a file ({e.strerror} to list it): give text or JSONL files"
    if not files:
        return f"--input {path} is a directory, with no files in it: give text or JSONL files"
    patterns = [str(path / kind) for kind in kinds]  # DIR/*.jsonl, DIR/*.txt.gz...
    return (f"--input {path} is a directory, not a file: give its files, e.g. --input {' '.join(patterns[:3])} "
            f"({len(files)} file{'s' if len(files) > 1 else ''} there)")


def _check_distinct(inputs: list[str | DatasetInput], identities: list[list]) -> None:
    """Refuses an input given twice (by the same or another path, or a copy: same content). Its documents
    would be counted twice, and a held-out document would also be trained on through its copy."""
    seen: dict[str, str] = {}
    for source, (_, size, digest) in zip(inputs, identities):
        if not size:  # empty: refused later, as empty; None: a hub dataset's shard, each once
            continue
        flag, path = ("--hf-data-files", source.file) if isinstance(source, DatasetInput) else ("--input", source)
        if digest in seen:
            first = seen[digest]
            how = "the same file" if os.path.samefile(first, path) else "two files with the same content"
            raise CorpusError(f"{flag} {first} and {path} are {how}: give each input once (its documents would "
                              f"be counted twice, and valid/test documents would also be in train)")
        seen[digest] = path


def _run(inputs, out, work, options, codes, vocab, keep_intermediate, executor, notice, tokenizer=None) -> dict:
    """The body of `preprocess`, run while holding the output lock and the executor's worker pool."""
    times: dict[str, float] = {}
    t0 = time.perf_counter()
    plan = _load_plan(out, inputs, options, executor)
    told = held_out_notice(options, plan.options, plan.n_docs)
    if told:
        notice(told)
    chunks = plan.chunks()
    times["scan"] = time.perf_counter() - t0
    if _is_complete(out, plan):
        log.info("%s is complete: nothing to do", out)
        return times
    try:
        work.mkdir(exist_ok=True)
    except OSError as e:
        raise write_error(work, e) from None
    sizes = [c.n_bytes / MB for c in chunks]
    log.info("%d documents, %.1f MB of text, %d chunks of ~%g MB, %d workers", plan.n_docs, plan.n_bytes / MB,
             len(chunks), plan.chunk_mb, min(executor.workers, len(chunks)))

    def step(name: str, fn, *args):
        start = time.perf_counter()
        result = fn(*args)
        times[name] = time.perf_counter() - start
        log.info("%s: %.1f s", name, times[name])
        return result

    held_out = {"valid": plan.valid_docs, "test": plan.test_docs}
    source_of = {scan.path: source for scan, source in zip(plan.scans, inputs)}
    tasks = [(work, _held_out_slice(held_out, c), c, source_of[c.path]) for c in chunks]
    if tokenizer is not None:
        names, dictionary = step("tokenize", _tokenize_ids, out, work, tasks, tokenizer, executor, sizes)
        _write_meta(out, plan, chunks, dictionary, names, times, {"unit": UNIT})
        shutil.rmtree(work)
        return times
    step("tokenize", executor.map, _call_tokenize, tasks, "tokenize", sizes)
    train_tok = [work_file(work, c.index, "train", "tok") for c in chunks]
    train_bpe = [work_file(work, c.index, "train", "bpe") for c in chunks]
    if codes:
        step("codes", _concatenate, [Path(codes)], out / "codes")
    elif not (out / "codes").exists():
        step("learnbpe", learn_codes, options["n_codes"], train_tok, out / "codes")
    check_codes(out / "codes")
    if vocab:  # train BPE limited to it too, as valid/test's always is
        step("vocab", _concatenate, [Path(vocab)], out / "vocab")
    limit = out / "vocab" if vocab else None
    step("apply_bpe", executor.map, _call_apply_bpe,
         [(t, b, out / "codes", limit) for t, b in zip(train_tok, train_bpe)], "apply BPE", sizes)
    if not (out / "vocab").exists():
        step("getvocab", get_vocab, train_bpe, out / "vocab")
    dictionary = Dictionary.load(out / "vocab")
    step("binarize", _binarize_all, out, work, chunks, executor, sizes, dictionary)
    names = ["plan.json", "codes", "vocab"]
    if keep_intermediate:
        for split in SPLITS:
            for kind in ("tok", "bpe"):
                _concatenate([work_file(work, c.index, split, kind) for c in chunks], out / f"{split}.{kind}")
                names.append(f"{split}.{kind}")
    _write_meta(out, plan, chunks, dictionary, names, times)
    shutil.rmtree(work)
    return times


def _held_out_slice(held_out: dict[str, list[int]], chunk: Chunk) -> dict[str, list[int]]:
    stop = chunk.global_start + chunk.doc_stop - chunk.doc_start
    return {s: [g for g in held_out[s] if chunk.global_start <= g < stop] for s in HELD_OUT}


def _call_tokenize(args: tuple) -> None:
    tokenize_chunk(*args)


def _call_apply_bpe(args: tuple) -> None:
    apply_bpe(*args)


def _tokenize_ids(out: Path, work: Path, tasks: list[tuple], tokenizer, executor: Executor,
                  sizes: list[float]) -> tuple[list[str], Dictionary]:
    """--tokenizer's steps (tokenized.py): its files copied into `out` (the workers load it there), each chunk's
    train shard and held-out documents (in work/), the held-out shards, DIR/vocab with the train counts.
    Returns the files written besides the shards, and the vocabulary."""
    dictionary = tokenizer_dictionary(tokenizer)
    names = ["plan.json", "vocab"]
    for path in save_tokenizer(tokenizer, work):
        _concatenate([path], out / path.name)
        names.append(path.name)
    token_type = token_dtype(len(dictionary))
    jobs = [(out, work, held_out, chunk, source, dictionary.fingerprint(), token_type)
            for _, held_out, chunk, source in tasks]
    executor.map(_call_binarize_documents, jobs, "tokenize", sizes)
    chunks = [chunk.index for _, _, chunk, _ in tasks]
    for split in HELD_OUT:
        merge_shards([work_file(work, c, split, "bin") for c in chunks], out / f"{split}.000.bin",
                     dictionary.fingerprint(), token_type)
    write_vocab(out, dictionary, [out / f"train.{c:03d}.bin" for c in chunks])
    return names, dictionary


def _call_binarize_documents(args: tuple) -> None:
    """One chunk's documents, tokenized: train into DIR/train.NNN.bin, held-out ones into work/NNNNN.SPLIT.bin."""
    out, work, held_out, chunk, source, fingerprint, token_type = args
    split_of = {g: split for split in HELD_OUT for g in held_out[split]}
    shards = {"train": out / f"train.{chunk.index:03d}.bin",
              **{split: work_file(work, chunk.index, split, "bin") for split in HELD_OUT}}
    binarize_documents(out, _chunk_documents(chunk, source), shards, lambda g: split_of.get(g, "train"), fingerprint,
                       token_type)


def _chunk_documents(chunk: Chunk, source: str | DatasetInput):
    """(global index, text) of each document of a chunk."""
    for index, text in enumerate(open_input(source)):
        if index >= chunk.doc_stop:
            break
        if index >= chunk.doc_start:
            yield chunk.global_start + index - chunk.doc_start, text


def _binarize_all(out: Path, work: Path, chunks: list[Chunk], executor: Executor, sizes: list[float],
                  dictionary: Dictionary) -> None:
    executor.map(partial(binarize_chunk, out, work), [c.index for c in chunks], "binarize", sizes)
    for split in HELD_OUT:
        binarize([work_file(work, c.index, split, "bpe") for c in chunks], out / f"{split}.000.bin", dictionary)


def _write_meta(out: Path, plan: Plan, chunks: list[Chunk], dictionary: Dictionary, names: list[str],
                times: dict, unit: dict | None = None) -> None:
    """meta.json, written last: statistics, the plan, each split's shards and a record of every output (the
    files `names` and the shards); `unit`: {"unit": UNIT} for a tokenizer's data."""
    shards = {"train": [f"train.{c.index:03d}.bin" for c in chunks], **{s: [f"{s}.000.bin"] for s in HELD_OUT}}
    meta = {**(unit or {}), "inputs": [i[0] for i in plan.inputs], "documents": plan.n_docs,
            "text_mb": round(plan.n_bytes / MB, 3),
            "replaced_utf8_sequences": sum(s.replaced for s in plan.scans), "chunks": len(chunks),
            "chunk_mb": plan.chunk_mb, "options": plan.options, "vocab_size": len(dictionary),
            "fingerprint": dictionary.fingerprint(), "seconds": {k: round(v, 3) for k, v in times.items()},
            "plan": _plan_record(plan), **output_record(out, shards, names, dictionary.fingerprint())}
    write_text(out / "meta.json", json.dumps(meta, indent=1) + "\n")


def main(argv: list[str] | None = None) -> int:
    prog = program_name("python -m xlm_pkm.data.preprocess")
    parser = argparse.ArgumentParser(prog=prog, description=__doc__.split("\n")[0])
    source = parser.add_mutually_exclusive_group(required=True)
    source.add_argument("--input", nargs="+", help="text (blank-line separated) or JSONL files, may be .gz/.xz/.bz2")
    source.add_argument("--hf-dataset", metavar="NAME", help="a Hugging Face dataset, streamed: a hub name (online), "
                                                             "or parquet, json, arrow, csv with --hf-data-files")
    hf = parser.add_argument_group("Hugging Face dataset (with --hf-dataset; as datasets.load_dataset's arguments)")
    hf.add_argument("--hf-data-files", nargs="+", metavar="PATTERN", help="its data files (local files or globs for a "
                                                                          "builder such as parquet)")
    hf.add_argument("--hf-config", metavar="NAME", help="its configuration (load_dataset's name)")
    hf.add_argument("--hf-split", metavar="SPLIT", help="its split (default train)")
    hf.add_argument("--text-field", metavar="FIELD", help="the field holding each document's text (default text)")
    parser.add_argument("--output", required=True, help="output directory")
    bpe = parser.add_mutually_exclusive_group()
    bpe.add_argument("--bpe-codes", type=int, default=60000,
                     help="BPE merges to learn on train (default 60000, the paper's)")
    bpe.add_argument("--codes", help="use this fastBPE codes file instead of learning one")
    bpe.add_argument("--tokenizer", metavar="FOLDER",
                     help="a Hugging Face model's folder: its tokenizer makes the ids, in place of Moses and BPE (for "
                          "a model retrofitted with memories, model.base.path)")
    parser.add_argument("--gguf-file", metavar="FILE", help="with --tokenizer: the tokenizer of this GGUF file of the "
                                                           "folder")
    parser.add_argument("--vocab", help="with --codes: use this vocab file (e.g. the pretraining corpus's, so that "
                                        "its models read this data) instead of making one; other words become <unk>")
    parser.add_argument("--workers", type=int, default=os.cpu_count() or 1,
                        help="worker processes (default: all cores)")
    parser.add_argument("--valid-docs", type=int, help="documents held out for valid (default: 5000, the paper's, "
                                                       "from 100,000 documents on, else 5%% of the documents)")
    parser.add_argument("--test-docs", type=int, help="documents held out for test (default: as --valid-docs)")
    parser.add_argument("--seed", type=int, default=0, help="seed of the held-out document choice")
    parser.add_argument("--chunk-mb", type=float, default=None,
                        help="MB of text per chunk/train shard (default: total/64 in [1, 64])")
    parser.add_argument("--keep-intermediate", action="store_true", help="also write DIR/{train,valid,test}.{tok,bpe}")
    parser.add_argument("--slurm-partition",
                        help="run the per-chunk steps as SLURM array jobs (submitit) on this partition")
    parser.add_argument("--slurm-time", type=int, default=240, help="minutes per SLURM job (default 240)")
    parser.add_argument("--slurm-parallelism", type=int, default=256,
                        help="SLURM array jobs running at once (default 256)")
    args = parser.parse_args(argv)
    given = [f"--{k.replace('_', '-')}" for k in ("hf_data_files", "hf_config", "hf_split", "text_field")
             if getattr(args, k) is not None]
    if args.gguf_file and not args.tokenizer:
        parser.error("--gguf-file needs --tokenizer FOLDER (the folder holding it)")
    if given and not args.hf_dataset:
        parser.error(f"{', '.join(given)} need{'s' * (len(given) == 1)} --hf-dataset NAME (the dataset to read)")
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s", stream=sys.stderr)
    executor = Executor(args.workers, args.slurm_partition, slurm_time_min=args.slurm_time,
                        slurm_parallelism=args.slurm_parallelism)
    with _first_ctrl_c_only() as interrupted:
        try:
            inputs = args.input or dataset_inputs(args.hf_dataset, args.hf_data_files, args.hf_split or "train",
                                                  args.text_field or "text", args.hf_config)
            times = preprocess(inputs, args.output, args.bpe_codes, args.codes, args.valid_docs, args.test_docs,
                               args.seed, args.chunk_mb, args.keep_intermediate, executor, args.vocab,
                               notice=lambda line: print(f"{prog}: {line}", file=sys.stderr, flush=True),
                               tokenizer=args.tokenizer, gguf_file=args.gguf_file)
        except KeyboardInterrupt:
            return fail(prog, _interrupted(Path(args.output)), EXIT_INTERRUPTED)
        except USER_ERRORS as e:
            if interrupted:  # what the Ctrl-C caused (fastBPE's tool, in the process group, got the SIGINT too)
                return fail(prog, _interrupted(Path(args.output)), EXIT_INTERRUPTED)
            return fail(prog, e)
    log.info("done in %.1f s: %s", sum(times.values()), args.output)
    return 0


@contextmanager
def _first_ctrl_c_only():
    """Inside, the first Ctrl-C raises KeyboardInterrupt and the next ones are ignored, to the end of the process
    (the run is ending: its workers ended, its lock released, without a second KeyboardInterrupt in the middle).
    Yields a list that holds SIGINT once one came."""
    came: list[int] = []
    if threading.current_thread() is not threading.main_thread() or \
            signal.getsignal(signal.SIGINT) is not signal.default_int_handler:  # ignored (nohup, &), or someone's
        yield came
        return

    def on_sigint(signum, frame):
        came.append(signum)
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        raise KeyboardInterrupt

    signal.signal(signal.SIGINT, on_sigint)
    try:
        yield came
    finally:
        if not came:
            signal.signal(signal.SIGINT, signal.default_int_handler)


def _interrupted(out: Path) -> UserError:
    """The line of a run stopped by Ctrl-C: what `out` keeps, which the same command reuses (a re-run skips every
    chunk whose outputs exist, the codes and vocab once written; temporary files are removed)."""
    try:
        chunks = len(Plan.load(out / "plan.json").chunks())
    except PlanError:  # none yet (or unreadable: the re-run says so)
        return UserError(f"interrupted (Ctrl-C) while scanning the inputs, before {out / 'plan.json'} was written: "
                         f"nothing to keep; the same command starts again")
    if (out / "meta.json").is_file():
        return UserError(f"interrupted (Ctrl-C) after {out} was complete (meta.json written): nothing lost")
    work = out / "work"

    def done(path_of) -> int:
        return sum(path_of(c).is_file() for c in range(chunks))

    counts = [("chunks tokenized", done(lambda c: work_file(work, c, "train", "tok"))),
              ("with BPE applied", done(lambda c: work_file(work, c, "train", "bpe"))),
              ("train shards", done(lambda c: out / f"train.{c:03d}.bin"))]
    kept = ["plan.json (the scan and held-out documents)", *(f"{n} of {chunks} {what}" for what, n in counts if n)]
    kept += [f"the {what} ({name})" for what, name in (("BPE codes", "codes"), ("vocabulary", "vocab"))
             if (out / name).is_file()]
    return UserError(f"interrupted (Ctrl-C); {out} keeps {', '.join(kept)}: run the same command again to resume "
                     f"(it reuses what is done)")


if __name__ == "__main__":
    sys.exit(main())
