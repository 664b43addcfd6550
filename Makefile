# Two entry points (see README): `make demo` runs the main job, `make test` runs the tests.
# Both start with `make setup`, which is fast when nothing changed.
PY := .venv/bin/python
CTXQ := .venv/bin/ctxq

.PHONY: setup setup-test demo test bench clean

setup:
	bash scripts/setup.sh

setup-test:
	EXTRAS=test bash scripts/setup.sh

demo: setup
	$(CTXQ) plan --ctx 65536 --gpus 16,16,16,8,8
	$(CTXQ) run --ctx 65536 -ctk q8_0 -ctv q8_0 -n 24 -p "The capital of France is"

test: setup-test
	$(PY) -m pytest -q

clean:
	rm -rf .venv build *.egg-info
