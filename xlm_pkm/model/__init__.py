"""The language models: a transformer whose layers are named sublayers, and the all-attention family.

    model_settings.py    the settings, imported by the code and importing none of it (the memory's settings
                         apart): ModelConfig (model), with the rules between its sections, SpanConfig
                         (model.span), BaseConfig (model.base); SUBLAYERS, the registry of the sublayers' names
    transformer.py       TransformerLM: embeddings, blocks, output; memories, spans and stream caches
    blocks.py            the sublayers a layer is made of, by name (registered into SUBLAYERS), and Block
    attention.py         causal multi-head self-attention with a key/value cache
    all_attention.py     all-attention with persistent memory vectors (Sukhbaatar et al. 2019)
    stream_attention.py  all-attention that keeps its stream's cache across blocks
    adaptive_span.py     the adaptive attention span
    adaptive_io.py       adaptive input and adaptive softmax
    memory_host.py       MemoryHost: what a model holding memories offers the trainer (memories() and the rest)
    retrofit.py          RetrofitLM: memories beside the MLPs of a pretrained Hugging Face causal LM
    memory/              the product-key memory layer and its parts (a package of its own)

May import: errors, settings, registry, utils.path_kind, utils.chunks, model.memory, data.dictionary (alone
of data: Engram's token compression reads the vocabulary's special tokens and BPE continuation marker where
they are defined, as the trainer hands the model only the vocabulary's words; that module needs no torch and
imports no other of xlm_pkm's). The models need torch only (no runtime or training code):
`from xlm_pkm.model.transformer import TransformerLM` works in any PyTorch program.
"""
