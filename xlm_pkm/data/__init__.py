"""Corpus pipeline: raw text -> Moses -> fastBPE -> binary shards -> (batch, bptt) blocks.

    corpus.py      read documents from text / JSONL files (.gz/.xz/.bz2), count bad UTF-8
    moses.py       Moses punctuation normalization + tokenization (sacremoses)
    fastbpe.py     fastBPE CLI (learnbpe, getvocab) and Python binding (apply), codes check
    bpe_apply.py   fastBPE's apply (with its vocab limit) in pure Python, for the transformers tokenizer
    hf_source.py   Hugging Face datasets (hub or local parquet / JSON lines / Arrow) as inputs, streamed
    plan.py        scan of the inputs, seeded held-out documents, chunks of work
    executor.py    tasks in-process, on a worker pool, or as SLURM array jobs (submitit)
    preprocess.py  the CLI tying them together (python -m xlm_pkm.data.preprocess --help)
    meta.py        meta.json (written last): proof of completeness, each split's shards, check_split
    dictionary.py  vocabulary with <s> </s> <pad> <unk> first
    shard.py       the binary shard format (readable with numpy alone, checksummed)
    stream.py      TokenStream: rank-disjoint, resumable LM batches, blocks shuffled per epoch; DataConfig, the
                   settings (data), here since this module imports no other of data/
    fact_batches.py  FactBatches: one fact's paraphrases per batch, padded, padding masked (finetuning)
    stats.py       corpus statistics (python -m xlm_pkm.data.stats DIR)
    bytes.py       character-level data (enwik8, text8): one token per byte
    words.py       word-level data as the all-attention authors read WikiText-103
    tokenized.py   documents -> shards with a Hugging Face tokenizer (preprocess --tokenizer: a pretrained model's)
    text_codec.py  text <-> token ids with a run's own preprocessing (generation, export, facts)

May import: errors, utils, settings.
"""
