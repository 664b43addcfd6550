# Two entry points (see README): `make demo` runs the main job, `make test` runs the tests.
# Both start with `make setup`, which is fast when nothing changed.
PY := .venv/bin/python
CTXQ := .venv/bin/ctxq

.PHONY: setup setup-test demo test dist bench clean

# CTXQ_CUDA=1 make setup: with llama.cpp's CUDA backend, and NCCL where installed (CTXQ_NCCL_HOME, or the
# system's: scripts/nccl.sh; docs/cuda.md); `ctxq doctor` then says what was built.
setup:
	bash scripts/setup.sh

setup-test:
	EXTRAS=test bash scripts/setup.sh

demo: setup
	$(CTXQ) plan --ctx 65536 --gpus 16,16,16,8,8
	$(CTXQ) run --ctx 65536 -ctk q8_0 -ctv q8_0 -n 24 -p "The capital of France is"

# First the floors of the package (import-linter's contracts in pyproject.toml), then the suite.
# The suite includes tests/test_package.py: the built sdist and wheel, installed into a fresh venv
# outside the checkout, every command run from another folder (about 2 minutes; marked slow).
# One test process per core, up to four (TEST_WORKERS=1 for one), each pinned to its own cores; a file's tests stay
# in one process, with the files that build the same cached artifact (tests/conftest.py, _TOGETHER).
TEST_WORKERS ?= $(shell n=$$(nproc); echo $$(( n < 4 ? n : 4 )))
test: setup-test
	$(PY) scripts/lint_imports.py
	$(PY) -m pytest -q -n $(TEST_WORKERS) --dist loadfile --durations=25

# The sdist and the wheel, as tests/test_package.py builds them (setuptools' hook, then the wheel from the sdist).
dist: setup
	rm -rf dist && $(PY) -c "from setuptools import build_meta as b; b.build_sdist('dist')"
	$(PY) -m pip wheel -q --no-deps --no-build-isolation -w dist dist/ctxq-*.tar.gz

clean:
	rm -rf .venv build dist *.egg-info
