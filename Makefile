# Two commands do all set-up on a fresh clone:
#   make demo   - the main job on embedded defaults (bundled data, in-process engine)
#   make test   - the test suite
# make docs builds the documentation site into site/ (strict), make docs-serve serves it.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: demo test test-compile install-check bench clean mutation docs docs-serve

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --quiet -e '.[dev,flower,docs]'
	touch $(STAMP)

# The JavaScript side (web/: onnxruntime-node and onnxruntime-web from the lockfile; the
# postinstall's CUDA download skipped) and Debian's Chromium for the browser test (Playwright
# drives it through executable_path; its own browser download is never used).
WEB_STAMP := web/node_modules/.installed
CHROMIUM := /usr/lib/chromium/chromium

$(WEB_STAMP): web/package-lock.json
	cd web && ONNXRUNTIME_NODE_INSTALL=skip npm ci --no-audit --no-fund --loglevel=error
	touch $(WEB_STAMP)

$(CHROMIUM):
	apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium >/dev/null

demo: $(STAMP)
	$(BIN)/nefl-zoo build resnet110 --gamma 0.2
	$(BIN)/nefl-zoo profile resnet110/nefl-wd-aligned
	$(BIN)/nefl-zoo train specs/train/digits-aligned-quick.yaml --out runs/demo --overwrite
	$(BIN)/nefl-zoo export runs/demo --out exports/demo
	$(BIN)/nefl-zoo bench-tiers exports/demo --batch 1
	$(BIN)/python tools/demo_figure.py exports/demo
	$(BIN)/nefl-zoo select exports/demo --max-params 200000

test: $(STAMP) $(WEB_STAMP) $(CHROMIUM)
	$(BIN)/python -m pytest -n 3 --dist loadfile --no-loadscope-reorder -m "not compile"

# The tests that compile with TorchInductor (marker `compile`): tens of seconds on a machine
# whose TorchInductor cache is empty, so CI runs them once, apart from the suite.
test-compile: $(STAMP)
	$(BIN)/python -m pytest -m compile

# The product as users get it (.ci/install-check): the sdist and the wheel built once, the wheel
# installed into a fresh virtualenv at the newest releases the dependency ranges allow and at
# their floors, and the README's commands run from an empty folder.
install-check:
	.ci/install-check newest lowest

# The documentation site (mkdocs.yml, docs/): strict, so a broken link or reference fails.
DOCS_ENV := NO_MKDOCS_2_WARNING=1

docs: $(STAMP)
	$(DOCS_ENV) $(BIN)/mkdocs build --strict --site-dir site

docs-serve: $(STAMP)
	$(DOCS_ENV) $(BIN)/mkdocs serve

# Mutation testing (TESTING.md): each module of [tool.nefl-zoo.mutation] in
# pyproject.toml against its own test files, one worker; slow, not part of `make test`.
# `make mutation MODULES=nefl_zoo.fl.aggregation.nefedavg` runs one module; SAMPLE=120 scores 120 of its mutants (seed 0);
# CHILDREN=2 runs two mutants at once (one per core).
mutation: $(STAMP)
	OMP_NUM_THREADS=1 $(BIN)/python tools/mutation.py $(if $(SAMPLE),--sample $(SAMPLE)) $(if $(CHILDREN),--children $(CHILDREN)) $(MODULES)

bench: $(STAMP)
	$(BIN)/python benchmarks/bench_slim.py
	$(BIN)/python benchmarks/bench_fl.py
	$(BIN)/python benchmarks/bench_export.py

clean:
	rm -rf $(VENV) runs exports/*/ site build dist cli/web
