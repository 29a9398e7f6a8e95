"""A run checkpoint made by the code before the regroup: tiny run stopped by SIGTERM at step 4 of 8."""
import os, signal, sys, shutil
from pathlib import Path
sys.path.insert(0, "/work/main"); sys.path.insert(0, "/work/main/tests")
import lzma
from itertools import islice
from xlm_pkm.data.preprocess import preprocess
from conftest import TINY, SAMPLE, TINY_DOCS
from xlm_pkm.config import load_config
from xlm_pkm.trainer import Trainer
out = Path("/tmp/oldckpt")
corpus = out / "tiny.jsonl"
with lzma.open(SAMPLE, "rt", encoding="utf-8") as f:
    corpus.write_text("".join(islice(f, TINY_DOCS)), encoding="utf-8")
data = out / "data"
if not (data / "meta.json").exists():
    preprocess([str(corpus)], data, n_codes=500, valid_docs=4, test_docs=4, seed=1, chunk_mb=0.25, keep_intermediate=True)
step_once = Trainer.train_step
def step_then_signal(self, batches):
    o = step_once(self, batches)
    if self.step == 4:
        os.kill(os.getpid(), signal.SIGTERM)
    return o
Trainer.train_step = step_then_signal
t = Trainer(load_config(None, [f"data.path={data}", f"train.dump_path={out/'dump'}", *TINY, "train.eval_every=2",
                               "train.exp_id=before_regroup"]), test=True)
try:
    t.train()
finally:
    t.close()
print(t.step, t.stopped, t.run_dir)
