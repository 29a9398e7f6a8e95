# Set-up and entry points. `make demo` and `make test` work on a fresh clone (CPU, no GPU).
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
PIP := $(PY) -m pip -q
FASTBPE := tools/fastbpe/fast
SAMPLE := data/processed/sample

.PHONY: install demo data test test-slow test-cluster bench clean

install: $(VENV)/.installed $(FASTBPE)

# The virtual environment: torch 2.13.0 unless a torch is already importable there, then the rest, then
# this checkout itself (editable: `import xlm_pkm` and the xlm-pkm-* commands work from any directory)
# with its optional extras (pyproject.toml), so that the tests of LoRA, datasets, transformers, lm-eval, W&B and
# retrofits (gguf) run too.
$(VENV)/.installed: requirements.txt requirements-test.txt pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -c "import torch" 2>/dev/null || $(PIP) install torch==2.13.0
	$(PIP) install -r requirements.txt -r requirements-test.txt cython setuptools wheel
	$(PIP) install --no-build-isolation fastBPE==0.1.0
	$(PIP) install --no-build-isolation -e ".[lora,hf,eval,wandb,retrofit]"
	touch $@

# fastBPE's command-line tool (learnbpe, applybpe, getvocab), compiled from its PyPI source release.
$(FASTBPE): $(VENV)/.installed
	rm -rf tools/fastbpe && mkdir -p tools/fastbpe
	$(PIP) download --no-binary :all: --no-deps fastBPE==0.1.0 -d tools/fastbpe
	tar -xzf tools/fastbpe/fastBPE-0.1.0.tar.gz -C tools/fastbpe
	g++ -std=c++11 -pthread -O3 tools/fastbpe/fastBPE-0.1.0/fastBPE/main.cc \
		-Itools/fastbpe/fastBPE-0.1.0/fastBPE -o $@

data: $(SAMPLE)/.done

$(SAMPLE)/.done: install data/sample/python-docs.jsonl.xz
	$(PY) -m xlm_pkm.data.preprocess --input data/sample/python-docs.jsonl.xz --output $(SAMPLE) \
		--bpe-codes 8000 --valid-docs 20 --test-docs 20 --workers 2
	touch $@

# The main job: train configs/default.yaml on the bundled corpus (resumes if interrupted; a finished
# run is not retrained), evaluate its best checkpoint on the test split, and print a sample of its text.
# THREADS=N: every command on N CPU threads (OMP_NUM_THREADS), e.g. THREADS=1 on a machine other jobs load.
DEMO_RUN := dumped/default/demo
THREADS ?=
RUN := $(if $(THREADS),OMP_NUM_THREADS=$(THREADS) )$(PY)

demo: data
	$(RUN) -m xlm_pkm.data.stats $(SAMPLE)
	$(RUN) train.py --config configs/default.yaml train.exp_id=demo --no-test
	$(RUN) evaluate.py --checkpoint $(DEMO_RUN)/best.pt --split test --json $(DEMO_RUN)/test.json
	$(RUN) generate.py --checkpoint $(DEMO_RUN)/best.pt --max-tokens 80 --top-p 0.9 --seed 0 "The built-in function"

# The linter first (pyproject.toml's [tool.ruff]: `$(PY) -m ruff check --fix .` mends what it can), then the tests.
# The tests a change is checked with (~2 minutes on 2 cores): all but those marked slow (whole commands in
# several processes, torchrun, torch.compile, benchmarks, a fresh Python without xlm_pkm, and any test over
# about 3 s on 2 idle cores), which test-slow runs (~20 minutes); .ci/run runs both, then test-cluster.
test: install
	$(PY) -m ruff check .
	$(PY) -m pytest -q -n 2 -m "not slow" tests

test-slow: install
	$(PY) -m pytest -q -n 2 -m slow tests

# The SLURM path against a real SLURM on this machine (tests/cluster, ~5 minutes): scripts/local_slurm.sh
# starts slurmctld and two slurmd (as root; it installs slurm-wlm and munge with apt-get when missing),
# and stops them whatever the tests do. Skipped, with the reason, where that cannot be done.
test-cluster: install
	@if [ "$$(id -u)" != 0 ]; then echo "test-cluster: skipped: running slurmd needs root"; exit 0; fi; \
	if ! command -v slurmctld >/dev/null && ! command -v apt-get >/dev/null; then \
		echo "test-cluster: skipped: SLURM is not installed and there is no apt-get to install it"; exit 0; fi; \
	scripts/local_slurm.sh start 2 || exit 1; \
	trap 'scripts/local_slurm.sh stop' EXIT; \
	eval "$$(scripts/local_slurm.sh env)"; \
	XLM_PKM_TEST_CLUSTER=1 timeout 1500 $(PY) -m pytest -q tests/cluster

# Benchmarks, sized for this machine (CPU: the reduced sizes of the committed *_cpu.json), each writing
# <benchmark>_<cpu|cuda>.json to BENCH_OUT: dumped/bench unless asked (BENCH_OUT=benchmarks/results replaces
# the committed figures). benchmarks/gpu_suite.sh runs the GPU ones on a machine without this venv.
BENCH_OUT ?= dumped/bench

bench: install data
	$(PIP) install --no-deps -r requirements-bench.txt
	PYTHON=$(PY) bash benchmarks/run_all.sh $(BENCH_OUT)

clean:
	rm -rf $(VENV) tools $(SAMPLE)
