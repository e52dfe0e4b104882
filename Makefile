# Two entry points; each builds the virtual environment first when it is missing.
#   make demo   - a real audit of a built-in defense on the embedded data, 4 images a step, with its positive control (3 min 40 s measured on 2 CPU cores once the venv is built; a fresh machine adds the venv, about 1.5 min)
#   make test   - the test suite
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
OUT ?= audit-out

.PHONY: demo test venv weights bench clean

$(VENV)/.installed: setup.cfg setup.py
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --upgrade pip
	$(PY) -m pip install -e ".[test]"
	touch $@

venv: $(VENV)/.installed

weights: venv
	$(VENV)/bin/gia-audit weights lpips

demo: weights
	$(VENV)/bin/gia-audit audit --images 4 --out $(OUT)

test: venv
	$(PY) -m pytest -q -n 2 --dist loadfile

bench: venv
	$(PY) -m bench.bench_attack

clean:
	rm -rf $(OUT) .pytest_cache
