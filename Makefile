# fedhier: `make run` and `make test` set everything up on a fresh machine.
PYTHON_BIN ?= python3
VENV       := .venv
PY         := $(VENV)/bin/python
STAMP      := $(VENV)/.fedhier-installed
RUN_ARGS   ?=

.PHONY: run test test-fast fuzz-long mutation lint bench experiments deploy-demo wheel clean

$(STAMP): pyproject.toml
	@test -x $(PY) || $(PYTHON_BIN) -m venv $(VENV)
	# torch is pinned first: a CPU wheel; an unpinned torch pulls a multi-GB CUDA build.
	$(PY) -m pip install -q torch==2.13.0
	$(PY) -m pip install -q -e ".[dev]"
	@touch $(STAMP)

## run: the default experiment (digits, Dirichlet 0.5, 20 clients, 4 edges, I=5, G=20)
run: $(STAMP)
	$(VENV)/bin/fedhier run $(RUN_ARGS)

## test: the whole test suite (includes Flower Simulation Engine runs on Ray)
# The wheel tests (tests/test_packaging.py) build and install fedhier into a fresh venv; they
# run in a session of their own: inside the whole suite their venv lost fedhier twice here.
# The deployment tests (marker `deployment`: real SuperLinks/SuperNodes on fixed ports, mostly
# waiting on Flower's polling) run in one process beside the rest. TEST_WORKERS=2 runs the rest
# in two pytest-xdist workers, a test file per worker at a time (--dist loadfile: module
# fixtures and a module's Ray connection stay in one process): 20 min instead of 29 alone,
# but beside the deployment stream two tests failed that way (docs/testing.md), so CI keeps 1.
TEST_WORKERS ?= 1
XDIST := $(if $(filter-out 1,$(TEST_WORKERS)),-n $(TEST_WORKERS) --dist loadfile,)
test: $(STAMP)
	@$(VENV)/bin/pytest -q -p no:cacheprovider -m deployment --ignore=tests/test_packaging.py \
	    > .deployment-tests.log 2>&1 & deploy=$$!; \
	$(VENV)/bin/pytest -q -m "not deployment" --ignore=tests/test_packaging.py \
	    $(XDIST); rest=$$?; \
	wait $$deploy; deployed=$$?; echo "--- deployment tests:"; cat .deployment-tests.log; \
	rm -f .deployment-tests.log; test $$rest -eq 0 -a $$deployed -eq 0
	$(VENV)/bin/pytest -q tests/test_packaging.py

## test-fast: everything except the slow Ray / flwr run tests
test-fast: $(STAMP)
	$(VENV)/bin/pytest -q -m "not slow"

## fuzz-long: hypothesis exploring fresh cases (CI runs the derandomized profile; docs/testing.md)
fuzz-long: $(STAMP)
	HYPOTHESIS_PROFILE=explore FEDHIER_FUZZ_PROFILE=long $(VENV)/bin/pytest -q -s \
		tests/test_fuzz_cli.py tests/test_faults.py -k "fuzz or random"

## mutation: mutmut over the core modules with their tests, 1 worker (slow; not in CI)
mutation: $(STAMP)
	$(PY) -m pip install -q "mutmut>=3.8,<4"
	$(PY) scripts/mutation.py

## bench: engines side by side on workload W1 (writes benchmarks/results/engines.json)
bench: $(STAMP)
	$(PY) benchmarks/engines.py

DEPLOY_ARGS ?=
## deploy-demo: SuperLink + 4 SuperNodes on 127.0.0.1 (TLS + SuperNode auth) via flwr run
deploy-demo: $(STAMP)
	$(VENV)/bin/fedhier deploy local --nodes 4 --groups 2 --grouping contiguous --local-period 5 --global-period 10 --rounds 2 $(DEPLOY_ARGS)

## experiments: every suite at full size (long), then docs/results.md and docs/figures/
experiments: $(STAMP)
	$(PY) -m fedhier.studies.experiments.publish

## wheel: build dist/fedhier-<version>-py3-none-any.whl (docs/install.md)
wheel: $(STAMP)
	$(PY) -m pip wheel -q --no-deps --no-build-isolation . -w dist

lint: $(STAMP)
	$(VENV)/bin/ruff check .
	$(VENV)/bin/mypy

clean:
	rm -rf $(VENV) .mypy_cache .ruff_cache .pytest_cache build dist *.egg-info
