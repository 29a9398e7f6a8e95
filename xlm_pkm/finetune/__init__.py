"""Starting from a trained model and training part of it.

    init_from.py        train.init_from: a trained model's weights, strict or retrofitted
    trainable.py        optim.trainable: which parameters train (all, memory, memory_values...)
    lora.py             optim.lora: LoRA adapters through peft, merged into best.pt
    memory_finetune.py  optim.memory_finetune: sparse memory finetuning (Lin et al. 2025), top-t slots by TF-IDF
    slot_counts.py      the background slot counts it ranks against (python -m xlm_pkm.finetune.slot_counts)

May import: errors, utils, settings, config, runtime, data, model, optim, checkpoint (their settings, LoraConfig and
MemoryFinetuneConfig, are optim/optim_settings.py's: this package sits above config.py).
"""
