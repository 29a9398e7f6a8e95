"""Using a trained model: generating text, sampling, exporting it to plain files.

    generation.py  generate() with a key/value cache; generate.py's command line
    sampling.py    greedy, temperature, top-k, top-p
    export.py      a folder of safetensors + config.json + vocab (python -m xlm_pkm.inference.export)

May import: errors, utils, config, runtime, data, model, checkpoint.
"""
