# Set-up and everyday commands. Everything runs from the repo's own .venv.
# The interpreter: the distribution's /usr/bin/python3 when it is 3.11+ and has venv, else the
# first python3 on PATH (`make install PYTHON=...` picks another). Debian's links libpython into
# the executable; pyenv's default build (configured without --enable-optimizations) calls it
# through a shared library. Measured side by side on these machines, Debian's takes about a fifth
# less time to READY and for `podctl status`, and runs a pure-Python loop 9% faster (absolute
# times move with the host's speed: `make bench` prints the day's).
SYSTEM_PYTHON := /usr/bin/python3
PYTHON ?= $(shell $(SYSTEM_PYTHON) -c 'import sys, ensurepip, venv; \
  sys.exit(sys.version_info < (3, 11))' >/dev/null 2>&1 && echo $(SYSTEM_PYTHON) || echo python3)
VENV   := .venv
PY     := $(VENV)/bin/python
PKGS   := poddaemon cli protocol

.PHONY: install compile test lint bench demo clean

install: $(VENV)/.installed

# Byte-compile on install: PYTHONDONTWRITEBYTECODE=1 would otherwise recompile every start.
$(VENV)/.installed: pyproject.toml
	@# A venv made from another interpreter is made afresh: `venv` would keep its old links and
	@# pair them with the new interpreter's standard library.
	@want=$$($(PYTHON) -c 'import os, sys; print(os.path.realpath(sys.executable))') && \
	  have=$$(realpath -q $(VENV)/bin/python || true) && \
	  if [ -n "$$have" ] && [ "$$have" != "$$want" ]; then \
	    echo "$(VENV) was made from $$have: making it afresh from $$want"; rm -rf $(VENV); fi
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -e '.[dev]'
	@# The editable install's import finder costs ~20 ms at every start of podctl and of a pod;
	@# poddaemon/_devfinder.py, run from a .pth line, finds the packages for free. (Once: site
	@# reads a venv's .pth files twice, and compiling the finder again cost ~1 ms per start.)
	$(PY) -c "import glob, os, site; sp = site.getsitepackages()[0]; \
	  [os.remove(p) for p in glob.glob(sp + '/__editable__*poddaemon*') + glob.glob(sp + '/poddaemon-repo.pth')]; \
	  f = os.path.join(os.getcwd(), 'poddaemon', '_devfinder.py'); \
	  open(sp + '/poddaemon-dev.pth', 'w').write(f'import sys; any(getattr(x, \"__name__\", \"\") == \"RepoFinder\" for x in sys.meta_path) or (lambda h: (exec(compile(h.read(), {f!r}, \"exec\"), {{\"__file__\": {f!r}}}), h.close()))(open({f!r}))\n')"
	$(PY) -m compileall -q $(VENV)/lib >/dev/null || true
	touch $@

compile:
	@$(PY) -m compileall -q $(PKGS) >/dev/null

# The suite waits on real processes most of the time (one core ~70% busy): two pytest-xdist
# workers run it in about half the time (~26 min serial on these 2-core machines, 13-18 min with
# two). `make test JOBS=1` runs it serially (to time a test alone, say).
JOBS ?= 2
test: install compile
	$(PY) -m pytest -q -p no:cacheprovider $(if $(filter-out 1,$(JOBS)),-n $(JOBS))

lint: install
	$(VENV)/bin/ruff check .
	$(VENV)/bin/mypy

bench: install compile
	$(PY) -m bench

demo: install compile
	$(PY) -m poddaemon.demo

clean:
	rm -rf $(VENV) build *.egg-info .pytest_cache .mypy_cache .ruff_cache
