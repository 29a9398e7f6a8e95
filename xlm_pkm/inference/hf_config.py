"""What an exported folder adds for Hugging Face transformers (export.py): config.json's keys, the
tokenizer's config, and the modules whose code it carries (hf_code.py).

config.json is the run's resolved config (model, data, optim, train, plugins) plus `hf_keys`: the model
type and auto_map that send AutoConfig / AutoModelForCausalLM / AutoTokenizer to the folder's code
(trust_remote_code=True), and the numbers transformers' generate() and lm-evaluation-harness read. No
eos_token_id: `</s>` ends a line of a document, not the text, so generate() runs to its max_new_tokens as
generate.py does.
"""

from __future__ import annotations

from xlm_pkm.config import Config
from xlm_pkm.data.dictionary import Dictionary
from xlm_pkm.data.text_codec import BPE_UNIT

MODEL_TYPE = "xlm_pkm"
TOKENIZER_CONFIG = "tokenizer_config.json"
MODELING, TOKENIZATION = "modeling_xlm_pkm", "tokenization_xlm_pkm"


def code_entries(unit: str) -> dict[str, str]:
    """{file name in the folder: module under xlm_pkm/}: the model's code, and the tokenizer's for BPE data
    (byte- and word-level data have no transformers tokenizer here: use the folder's vocab)."""
    entries = {f"{MODELING}.py": "inference/hf_modeling.py"}
    if unit == BPE_UNIT:
        entries[f"{TOKENIZATION}.py"] = "inference/hf_tokenizer.py"
    return entries


def hf_keys(cfg: Config, dictionary: Dictionary, unit: str) -> dict:
    auto_map = {"AutoConfig": f"{MODELING}.XlmPkmConfig", "AutoModelForCausalLM": f"{MODELING}.XlmPkmForCausalLM"}
    if unit == BPE_UNIT:
        auto_map["AutoTokenizer"] = [f"{TOKENIZATION}.XlmPkmTokenizer", None]
    keys = {"model_type": MODEL_TYPE, "architectures": ["XlmPkmForCausalLM"], "auto_map": auto_map,
            "vocab_size": cfg.model.vocab_size, "bos_token_id": dictionary.bos, "pad_token_id": dictionary.pad,
            "use_cache": True, "tie_word_embeddings": False}
    if cfg.model.family == "transformer":  # learnt positions: the longest sequence the model reads
        keys["max_position_embeddings"] = cfg.model.max_len
    return keys


def tokenizer_config(dictionary: Dictionary, max_len: int) -> dict:
    return {"tokenizer_class": "XlmPkmTokenizer",
            "auto_map": {"AutoTokenizer": [f"{TOKENIZATION}.XlmPkmTokenizer", None]},
            "bos_token": dictionary.words[dictionary.bos], "eos_token": dictionary.words[dictionary.eos],
            "pad_token": dictionary.words[dictionary.pad], "unk_token": dictionary.words[dictionary.unk],
            "model_max_length": max_len}
