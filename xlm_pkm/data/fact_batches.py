"""Fact batches: a finetuning step's batch is one fact's N paraphrases (Lin et al. 2025, §3: each batch
holds one fact rewritten N times, padded, the padding masked).

    write_fact_batches(DIR, [[ids of each paraphrase] for each fact], dictionary)   # DIR/fact_batches.json
    batches = FactBatches(DIR, paraphrases=16)       # data.fact_batches=16 in a run
    x, y = next(iter(batches))                       # (n, T), (n, T): n = 16 / world_size rows

Fact i's batch is its first N paraphrases (each `<s>` + the sentence's ids), right-padded to the longest:
x holds `<pad>` and y holds PAD_TARGET after each sequence's end, so that the loss and the memory's slot
counts leave those positions out (the model is causal: padding on the right changes no earlier position).
Facts arrive in order, one per step (the continual setting), and again from the first after the last
(an epoch). With several ranks, rank r takes paraphrases r, r + W, ... of the fact. The state is
{epoch, step} as TokenStream's, with what must match on resume (not the number of processes: a step reads
the same fact on any).
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import torch

from .dictionary import Dictionary
from .meta import load_meta

FILE = "fact_batches.json"
KIND = "xlm_pkm fact batches"
PAD_TARGET = -100  # a target the loss ignores (torch's cross_entropy ignore_index)


def write_fact_batches(data_dir: str | Path, facts: list[list[list[int]]], dictionary: Dictionary) -> Path:
    """data_dir/fact_batches.json: each fact's paraphrases as ids (each starting with <s>)."""
    path = Path(data_dir) / FILE
    record = {"kind": KIND, "vocab_fingerprint": dictionary.fingerprint(), "facts": facts}
    path.write_text(json.dumps(record), encoding="utf-8")
    return path


class FactBatches:
    def __init__(self, data_dir: str | Path, paraphrases: int, rank: int = 0, world_size: int = 1):
        data_dir = Path(data_dir)
        path = data_dir / FILE
        if not path.is_file():
            raise FileNotFoundError(f"data.fact_batches: {data_dir} has no {FILE} (written by python -m "
                                    f"xlm_pkm.experiments.facts, or data/fact_batches.write_fact_batches)")
        record = json.loads(path.read_text(encoding="utf-8"))
        if not isinstance(record, dict) or record.get("kind") != KIND:
            raise ValueError(f"data.fact_batches: {path} is not a fact batches file")
        self.dictionary = Dictionary.load(data_dir / "vocab")
        if record["vocab_fingerprint"] != self.dictionary.fingerprint():
            raise ValueError(f"data.fact_batches: {path} was written with another vocabulary than {data_dir}/vocab")
        stored = min(len(p) for p in record["facts"])
        if paraphrases > stored:
            raise ValueError(f"data.fact_batches={paraphrases}: {path} holds {stored} paraphrases per fact")
        if paraphrases % world_size:
            raise ValueError(f"data.fact_batches={paraphrases}: not divisible by the {world_size} processes, "
                             f"which split each fact's paraphrases between them")
        self.facts = [p[:paraphrases][rank::world_size] for p in record["facts"]]
        self.data_dir, self.split, self.unit = data_dir, "train", load_meta(data_dir).get("unit", "token")
        self.paraphrases, self.world_size = paraphrases, world_size
        self.epoch = self.step = 0

    def __len__(self) -> int:
        return len(self.facts)

    def batch(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Fact i's (x, y), each (n, T): T + 1 = its longest paraphrase, padded as the module docstring says."""
        sequences = self.facts[i]
        width = max(len(s) for s in sequences) - 1
        x = np.full((len(sequences), width), self.dictionary.pad, dtype=np.int64)
        y = np.full((len(sequences), width), PAD_TARGET, dtype=np.int64)
        for row, ids in enumerate(sequences):
            x[row, :len(ids) - 1], y[row, :len(ids) - 1] = ids[:-1], ids[1:]
        return torch.from_numpy(x), torch.from_numpy(y)

    def __iter__(self):
        while True:
            while self.step < len(self.facts):
                self.step += 1
                yield self.batch(self.step - 1)
            self.step = 0
            self.epoch += 1

    def state_dict(self) -> dict[str, int]:
        return {"epoch": self.epoch, "step": self.step, "fact_batches": self.paraphrases,
                "world_size": self.world_size, "facts": len(self.facts)}

    def load_state_dict(self, state: dict[str, int]) -> None:
        for key in ("fact_batches", "facts"):  # a step reads one fact whatever the ranks: any world_size resumes
            if state.get(key) != self.state_dict()[key]:
                raise ValueError(f"the checkpoint's data position does not match {self.data_dir}: its {key} is "
                                 f"{state.get(key)}, this run's {self.state_dict()[key]}; resume with the "
                                 f"run's data.path and data.fact_batches")
        self.epoch, self.step = int(state["epoch"]), int(state["step"])
