"""What an exported folder adds for Hugging Face transformers (export.py): config.json's keys, the
tokenizer's config, and the declared list of the modules whose code it carries (hf_code.py writes them).

config.json is the run's resolved config (model, data, optim, train, plugins) plus `hf_keys`: the model
type and auto_map that send AutoConfig / AutoModelForCausalLM / AutoTokenizer to the folder's code
(trust_remote_code=True), and the numbers transformers' generate() and lm-evaluation-harness read. No
eos_token_id for our own data: `</s>` ends a line of a document, not the text, so generate() runs to its
max_new_tokens as generate.py does; a tokenizer's data (a retrofit's) has its end-of-text token, where generate()
stops.
"""

from __future__ import annotations

from xlm_pkm.config import Config
from xlm_pkm.data.dictionary import Dictionary
from xlm_pkm.data.text_codec import BPE_UNIT
from xlm_pkm.data.tokenized import UNIT as TOKENIZER_UNIT

MODEL_TYPE = "xlm_pkm"
TOKENIZER_CONFIG = "tokenizer_config.json"
MODELING, TOKENIZATION = "modeling_xlm_pkm", "tokenization_xlm_pkm"

# The xlm_pkm modules an exported folder carries, one a line, each beside the entry module that needs it: exactly
# those the entry imports, at any depth (an import of another one fails the export; one listed but never imported
# fails test_hf_export). A module the model's code starts (or stops) importing is one line here.
MODEL_MODULES = (  # for modeling_xlm_pkm.py (inference/hf_modeling.py): TransformerLM and its settings
    "xlm_pkm.errors",
    "xlm_pkm.registry",
    "xlm_pkm.settings",
    "xlm_pkm.model.model_settings",
    "xlm_pkm.model.transformer",
    "xlm_pkm.model.memory_host",
    "xlm_pkm.model.retrofit",
    "xlm_pkm.model.blocks",
    "xlm_pkm.model.attention",
    "xlm_pkm.model.adaptive_io",
    "xlm_pkm.model.adaptive_span",
    "xlm_pkm.model.all_attention",
    "xlm_pkm.model.stream_attention",
    "xlm_pkm.model.memory.memory_settings",
    "xlm_pkm.model.memory.pkm",
    "xlm_pkm.model.memory.keys",
    "xlm_pkm.model.memory.scores",
    "xlm_pkm.model.memory.selected_scores",
    "xlm_pkm.model.memory.triton_topk",
    "xlm_pkm.model.memory.slot_groups",
    "xlm_pkm.model.memory.stats",
    "xlm_pkm.utils.chunks",
    "xlm_pkm.utils.path_kind",
    "xlm_pkm.model.memory.dtypes",
    "xlm_pkm.model.memory.value_stores",
    "xlm_pkm.model.memory.value_read",
    "xlm_pkm.model.memory.triton_value_read",
    "xlm_pkm.model.memory.sharded_read",
    "xlm_pkm.model.memory.value_shards",
    "xlm_pkm.model.memory.peer",
    "xlm_pkm.model.memory.ultramem",
    "xlm_pkm.model.memory.engram",
    "xlm_pkm.model.memory.ngram_hash",
    "xlm_pkm.model.memory.token_compression",
    "xlm_pkm.data.dictionary",
)
TOKENIZER_MODULES = (  # for tokenization_xlm_pkm.py (inference/hf_tokenizer.py): Moses and BPE in pure Python
    "xlm_pkm.data.moses",
    "xlm_pkm.data.corpus",
    "xlm_pkm.data.bpe_apply",
)


def carried_code(unit: str) -> tuple[dict[str, str], tuple[str, ...]]:
    """({file name in the folder: entry module}, the modules carried beside them): the model's code, and the
    tokenizer's for BPE data (byte- and word-level data have no transformers tokenizer here: use the folder's vocab)."""
    if unit != BPE_UNIT:
        return {f"{MODELING}.py": "xlm_pkm.inference.hf_modeling"}, MODEL_MODULES
    return ({f"{MODELING}.py": "xlm_pkm.inference.hf_modeling", f"{TOKENIZATION}.py": "xlm_pkm.inference.hf_tokenizer"},
            MODEL_MODULES + TOKENIZER_MODULES)


def hf_keys(cfg: Config, dictionary: Dictionary, unit: str) -> dict:
    auto_map = {"AutoConfig": f"{MODELING}.XlmPkmConfig", "AutoModelForCausalLM": f"{MODELING}.XlmPkmForCausalLM"}
    if unit == BPE_UNIT:
        auto_map["AutoTokenizer"] = [f"{TOKENIZATION}.XlmPkmTokenizer", None]
    keys = {"model_type": MODEL_TYPE, "architectures": ["XlmPkmForCausalLM"], "auto_map": auto_map,
            "vocab_size": cfg.model.vocab_size, "bos_token_id": dictionary.bos, "pad_token_id": dictionary.pad,
            "use_cache": True, "tie_word_embeddings": False}
    if unit == TOKENIZER_UNIT:  # data/tokenized.py: its end of text ends a document
        keys["eos_token_id"] = dictionary.eos
    if cfg.model.family == "transformer":  # learnt positions: the longest sequence the model reads
        keys["max_position_embeddings"] = cfg.model.max_len
    return keys


def tokenizer_config(dictionary: Dictionary, max_len: int) -> dict:
    return {"tokenizer_class": "XlmPkmTokenizer",
            "auto_map": {"AutoTokenizer": [f"{TOKENIZATION}.XlmPkmTokenizer", None]},
            "bos_token": dictionary.words[dictionary.bos], "eos_token": dictionary.words[dictionary.eos],
            "pad_token": dictionary.words[dictionary.pad], "unk_token": dictionary.words[dictionary.unk],
            "model_max_length": max_len}
