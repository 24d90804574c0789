# Set-up and everyday commands. Everything runs from the repo's own .venv.
PYTHON ?= python3
VENV   := .venv
PY     := $(VENV)/bin/python
PKGS   := poddaemon cli protocol

.PHONY: install compile test lint bench demo clean

install: $(VENV)/.installed

# Byte-compile on install: PYTHONDONTWRITEBYTECODE=1 would otherwise recompile every start.
$(VENV)/.installed: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -e '.[dev]'
	@# The editable install's import finder costs ~20 ms at every start of podctl and of a pod;
	@# a plain .pth line putting the repo on sys.path does the same job for free.
	$(PY) -c "import glob, os, site; sp = site.getsitepackages()[0]; \
	  [os.remove(p) for p in glob.glob(sp + '/__editable__*poddaemon*')]; \
	  open(sp + '/poddaemon-repo.pth', 'w').write(os.getcwd() + '\n')"
	$(PY) -m compileall -q $(VENV)/lib >/dev/null || true
	touch $@

compile:
	@$(PY) -m compileall -q $(PKGS) >/dev/null

test: install compile
	$(PY) -m pytest -q -p no:cacheprovider

lint: install
	$(VENV)/bin/ruff check .
	$(VENV)/bin/mypy

bench: install compile
	$(PY) -m bench

demo: install compile
	$(PY) -m poddaemon.demo

clean:
	rm -rf $(VENV) build *.egg-info .pytest_cache .mypy_cache .ruff_cache
