"""Optimizers and learning rates (paper §4.3): dense Adam on a schedule, the memory values on their own.

    optim_settings.py  the settings, imported by the code and importing none of it: OptimConfig (optim), with
                   LoraConfig and MemoryFinetuneConfig (optim.lora, optim.memory_finetune: the code is in
                   finetune/, which loads checkpoints and so sits above config.py; these settings sit here, in
                   the section they belong to, below it); the registries its names are chosen from
                   (DENSE_OPTIMIZERS, VALUE_OPTIMIZERS, SCHEDULES), filled by the two modules below
    optimizers.py  Optimizers: one optimizer per parameter group, chosen by name (registered into
                   DENSE_OPTIMIZERS, VALUE_OPTIMIZERS, each declaring its state size); fp16 loss-scaled steps
                   skipped on every rank together
    schedule.py    the dense learning rate by step (registered into SCHEDULES: inverse_sqrt, linear_warmup,
                   constant)
    clipping.py    gradient norm and clipping over sparse and sharded gradients
    lazy_adam.py   Adam on the rows of a row-sparse gradient only (the memory values)
    rowwise_adagrad.py  FBGEMM's exact row-wise Adagrad on row-sparse gradients: one accumulator per row
    stochastic_rounding.py  a bfloat16 table's row updates rounded stochastically, from a counter-based stream
    fused_rows.py  LazyAdam, sparse Adagrad, row-wise Adagrad and sparse SGD with their row update in one pass,
                   no host sync on a GPU (optim.fused_values); the CPU functions the kernels are checked against
    triton_rows.py the Triton kernels of fused_rows.py, and the sync-free norm of a sparse gradient
    adagrad.py     Adagrad with per-tensor step clipping (the all-attention paper)

May import: errors, utils, settings, registry.
"""
