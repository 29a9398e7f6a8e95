"""Experiments built on the framework; nothing else in xlm_pkm imports them.

    reproduce.py        every cell of one of the paper's tables or figures (or of the variants' study),
                        at full size or scaled down
    report.py           the report: the paper's tables beside ours, figures, verdicts over seeds
    introspect.py       what a trained memory stores: the contexts that read its most used slots
    facts.py            facts to finetune on (made-up, or one's own file), preprocessed with the pretraining vocabulary
    fact_scores.py      how much of the facts a model learnt: EM, forced choice, the controls against chance
    continual.py        learning those facts against forgetting the pretraining corpus: `continual score`, the CLI
    knowledge.py        forgetting what the base knew: greedy EM on world-knowledge questions, the share kept
    continual_report.py the continual study's report: settings chosen on held-out facts, paired forgetting ratios
    harness.py          lm-evaluation-harness on a run or an exported folder; local cloze and facts QA tasks
    ngram_gain.py       where a model's gain lies: test loss on tokens with a frequent training N-gram vs the rest
    study.py            a study (cells × seeds × an lr grid on a token budget): runs what is missing in N streams
    study_plan.py       a study file, the runs it asks for, each cell's lr chosen on validation
    study_report.py     a study's report: lr choices, learning curves, compute, paired comparisons
    paired.py           paired differences over seeds: t interval, Holm's correction, verdict words

May import: errors, utils, settings, config, registry, runtime, data, model, optim, checkpoint, finetune, train,
inference, launch, runs.
"""
