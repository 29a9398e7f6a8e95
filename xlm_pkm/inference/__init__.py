"""Using a trained model: generating text, sampling, exporting it to plain files that Hugging Face
transformers also loads, and back.

    generation.py    generate() with a key/value cache (generate.py's command line: launch/cli.py)
    sampling.py      greedy, temperature, top-k, top-p
    export.py        a folder of safetensors + config.json + vocab + the code below (python -m
                     xlm_pkm.inference.export), and --import back to a run checkpoint
    hf_config.py     what a folder adds for transformers: config.json's keys, tokenizer_config.json, the
                     declared list of the modules it carries
    hf_code.py       the folder's code: the modules below and the declared ones, flat, importing each other
    hf_modeling.py   AutoModelForCausalLM of a folder (copied there; imports transformers)
    hf_tokenizer.py  AutoTokenizer of a folder (copied there; pure Python): TextCodec's ids and text

May import: errors, utils, config, runtime, data, model, checkpoint.
"""
