# QuillCache: the two commands of the README are `make run` and `make test`.
# Both create .venv, install the Debian packages they need (when root and missing),
# install the package editable and build the Cython extensions.

PYTHON   ?= python3
VENV     ?= .venv
PY       := $(VENV)/bin/python
PIP      := $(VENV)/bin/pip
STAMP    := $(VENV)/.quillcache-installed
DEB_PKGS := liburing-dev pkg-config redis-server etcd-server
N        ?= 500
PYTEST_ARGS ?=
# The main suite's pytest-xdist workers in `make test` (whole test files to each, as one frees up);
# 0 runs it in one process.
PYTEST_WORKERS ?= 2
MAIN_SUITE    = -m "not engines" -n $(PYTEST_WORKERS) --dist loadfile $(PYTEST_ARGS)

.PHONY: all help build deps bench-deps _debs run gateway lint test bench crash man clean distclean engines engines-clean cluster nixl

# The engines' own venv (vLLM, SGLang, LMCache on the CPU torch wheel), for the tests marked
# `engines`. Every pin is in requirements/engines.txt and installed with --no-deps, torch first.
# QUILLCACHE_NO_ENGINES=1 skips those tests in `make test` (and says so): a newcomer without
# network access can then run the main suite; it is not a full test run.
ENGINES_VENV ?= .venv-engines
EPY          := $(ENGINES_VENV)/bin/python
ESTAMP       := $(ENGINES_VENV)/.engines-installed
EDEPS        := $(ENGINES_VENV)/.engines-packages-installed
ENGINES_LOG  := $(ENGINES_VENV).log
# Not $(MAKE) itself on the line that runs the suite: `make -n test` would run that line.
BG_MAKE       = $(MAKE)
ENGINES_TORCH := torch==2.13.0
QUILLCACHE_NO_ENGINES ?=
# The test files with tests marked `engines`: only they are collected in the engines venv.
ENGINE_TESTS  = $(shell grep -rl --include='test_*.py' 'mark.engines' tests)

all: build

# `make help`: every target a newcomer runs, one line each (tests/cli/test_makefile.py holds it to the .PHONY list).
help:
	@echo "QuillCache make targets (the README's two commands are make run and make test):"
	@echo "  make run       build, then one node in the foreground on 127.0.0.1:7470 (data in ./var); Ctrl-C stops it"
	@echo "  make test      build, ruff, the suite, then the engine tests in .venv-engines"
	@echo "  make cluster   etcd and three nodes on loopback; kill -9 one to watch failure detection; Ctrl-C stops all"
	@echo "  make gateway   one node, two simulated engines sharing it as their pool, the gateway on 127.0.0.1:8088"
	@echo "  make build     .venv, the Debian packages (as root), the package editable, the Cython extensions"
	@echo "  make engines   .venv-engines: CPU torch, vLLM, SGLang, LMCache (for the engine tests)"
	@echo "  make lint      ruff check on the tree"
	@echo "  make bench     asv on this commit, then bench/native_core.py"
	@echo "  make crash     the long crash-injection campaign (N=500 cycles)"
	@echo "  make man       regenerate man/ from the command-line help"
	@echo "  make clean     remove build output; make distclean also the venvs and var/"
	@echo "  make nixl      NIXL (transfer/nixl.py) into .venv, --no-deps (make test does it)"
	@echo "  make engines-clean  remove .venv-engines"

# Debian packages: installed only when running as root and something is missing.
deps:
	@$(MAKE) --no-print-directory _debs PKGS="$(DEB_PKGS)"

bench-deps:
	@$(MAKE) --no-print-directory _debs PKGS="$(DEB_PKGS) libibverbs1"

_debs:
	@missing=""; for p in $(PKGS); do \
	    dpkg-query -W -f='$${Status}' $$p 2>/dev/null | grep -q "install ok installed" || missing="$$missing $$p"; \
	done; \
	if [ -n "$$missing" ]; then \
	    if [ "$$(id -u)" = "0" ] && command -v apt-get >/dev/null; then \
	        echo "installing Debian packages:$$missing"; \
	        apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq $$missing >/dev/null; \
	    else \
	        echo "note: missing Debian packages:$$missing (not root: building without them where possible)"; \
	    fi; \
	fi

$(PY):
	$(PYTHON) -c 'import sys; assert sys.version_info >= (3, 11), "Python 3.11+ required, found " + sys.version'
	$(PYTHON) -m venv $(VENV)

$(STAMP): $(PY) pyproject.toml setup.py
	$(PIP) install -q --upgrade pip setuptools wheel "Cython>=3.0"
	$(PIP) install -q --no-build-isolation -e '.[test]'
	touch $(STAMP)

# NIXL (bytes between nodes, transfer/nixl.py) in the main venv, with --no-deps: the wheel declares
# torch, which host memory does not need, and a plain install would pull a CUDA torch (~5 GB).
# Optional: where it cannot be installed the NIXL tests skip and say so in one line.
NIXL_PKG   := nixl-cu12==1.5.1
NIXL_STAMP := $(VENV)/.nixl-installed

nixl: $(NIXL_STAMP)

$(NIXL_STAMP): $(STAMP)
	@$(PIP) install -q --no-deps "$(NIXL_PKG)" && touch $(NIXL_STAMP) \
	    || echo "note: $(NIXL_PKG) could not be installed: the NIXL tests will be skipped"

# Incremental: cythonize rebuilds only what changed.
build: deps $(STAMP)
	$(PY) setup.py -q build_ext --inplace -j 2

run: build
	$(VENV)/bin/quillcached

# etcd and three nodes on loopback (tests/_support/devcluster.py): kill -9 one, the others serve; Ctrl-C stops all.
# CLUSTER_ARGS: e.g. "--start-timeout 120" on a slow machine, or "5" for five nodes.
CLUSTER_ARGS ?=
cluster: build
	$(PY) -m tests._support.devcluster $(CLUSTER_ARGS)

# ruff (configured in pyproject.toml) on the whole tree, then the suite.
lint: $(STAMP)
	$(VENV)/bin/ruff check .

# A gateway in front of two simulated engines sharing one node as their pool (conf/gateway.toml); Ctrl-C stops all.
gateway: build
	$(PY) -m tests._support.gateway_demo

# ruff runs once, inside the suite (tests/test__sourcecode.py); `make lint` runs it alone.
# The engines' venv (torch, vLLM, ...: downloads and unpacking, mostly waiting) installs in the
# background while the main suite runs, and the engine tests run there as soon as it is ready.
# The main suite runs on $(PYTEST_WORKERS) pytest-xdist workers: in one process it kept one of the two
# cores busy only three quarters of the time, waiting on the servers its tests start (alone on the
# machine, 9:46 in one process, 6:14 on two).  The pytest processes pick their servers' ports from
# disjoint slices (QUILLCACHE_PORT_SLICE, each worker a part of its process's: tests/_support/ports.py),
# so none can take a port another has just picked.  Their outputs
# go to $(ENGINES_LOG) (the install) and $(ENGINES_TEST_LOG) (the tests), printed after the main
# suite.  The background job builds $(ESTAMP), not `engines`: `build` would copy the extensions in
# place again under the running suite.  Exit 99 of that job: the venv could not be built.  The
# install runs niced (pip unpacks and byte-compiles torch and vLLM on the core the main suite, the
# longer of the two, would otherwise share); the engine tests do not.
ENGINES_TEST_LOG := $(ENGINES_VENV).tests.log
test: build nixl
ifeq ($(QUILLCACHE_NO_ENGINES),1)
	$(PY) -m pytest -q $(MAIN_SUITE)
	@echo "*** QUILLCACHE_NO_ENGINES=1: the engine tests (-m engines) were NOT run ***"
else
	@echo "(meanwhile $(ENGINES_VENV) installs and the engine tests run in the background: logs in $(ENGINES_LOG) and $(ENGINES_TEST_LOG))"
	@rm -f $(ENGINES_TEST_LOG); \
	( nice -n 10 $(BG_MAKE) --no-print-directory $(ESTAMP) > $(ENGINES_LOG) 2>&1 || exit 99; \
	  QUILLCACHE_PORT_SLICE=1/2 VLLM_TARGET_DEVICE=cpu $(EPY) -m pytest -q -m engines $(ENGINE_TESTS) $(PYTEST_ARGS) \
	      > $(ENGINES_TEST_LOG) 2>&1 ) & bg=$$!; \
	QUILLCACHE_PORT_SLICE=0/2 $(PY) -m pytest -q $(MAIN_SUITE); rc=$$?; \
	wait $$bg; brc=$$?; \
	if [ $$brc -eq 99 ]; then cat $(ENGINES_LOG); echo "*** $(ENGINES_VENV) could not be built (log above): the engine \
	tests need it (first build downloads ~500 MB). Fix the network/index, or run \
	'make test QUILLCACHE_NO_ENGINES=1' to run the main suite only (not a full test run). ***"; exit 1; fi; \
	echo "--- the engine tests (-m engines, in $(ENGINES_VENV), run beside the main suite):"; \
	cat $(ENGINES_TEST_LOG); \
	if [ $$rc -ne 0 ]; then exit $$rc; fi; exit $$brc
endif

# Built once (stamps); the packages again when their pins change, quillcache when its metadata
# does. torch goes first and alone, and the build stops if it is a CUDA build. quillcache is
# installed editable (its Cython extensions are built in place by `make build`, shared with
# .venv: same interpreter).
engines: build $(ESTAMP)

$(EDEPS): requirements/engines.txt
	$(PYTHON) -m venv $(ENGINES_VENV)
	$(ENGINES_VENV)/bin/pip install -q --no-deps $(ENGINES_TORCH)
	$(ENGINES_VENV)/bin/pip install -q --no-deps -r requirements/engines.txt
	$(EPY) -c 'import sys, torch; sys.exit("CUDA torch installed: " + str(torch.version.cuda) if torch.version.cuda else 0)'
	touch $(EDEPS)

$(ESTAMP): $(EDEPS) pyproject.toml setup.py
	$(ENGINES_VENV)/bin/pip install -q --no-deps --no-build-isolation -e .
	@# importing vLLM makes torch's inductor cache directory: a throw-away one, not /tmp/torchinductor_<user>
	d=$$(mktemp -d) && TORCHINDUCTOR_CACHE_DIR=$$d VLLM_TARGET_DEVICE=cpu $(EPY) -c 'import vllm, sglang, lmcache, torch; print("engines venv:", "vllm", vllm.__version__, "sglang", sglang.__version__, "torch", torch.__version__)'; \
	  rc=$$?; rm -rf $$d; exit $$rc
	touch $(ESTAMP)

engines-clean:
	rm -rf $(ENGINES_VENV) $(ENGINES_LOG) $(ENGINES_TEST_LOG)

# asv over bench/suites/ on the current commit (offline: the existing venv), the standalone
# ratio script, then asv's HTML report of every commit recorded so far (docs/benchmarks.md).
bench: build bench-deps
	$(PIP) install -q --no-build-isolation -e '.[test,bench]'
	$(VENV)/bin/asv machine --yes >/dev/null
	$(VENV)/bin/asv run --quick --show-stderr --environment existing:$(abspath $(PY)) \
	    --set-commit-hash $$(git rev-parse HEAD)
	$(PY) bench/native_core.py
	$(VENV)/bin/asv publish
	@echo "asv HTML report: $(abspath .asv/html)/index.html (serve it: $(VENV)/bin/asv preview)"

crash: build
	QUILLCACHE_CRASH_CYCLES=$(N) $(PY) -m pytest -q tests/crash --crash-long

man: build
	$(PY) -m quillcache_cli.manpages man/

clean:
	rm -rf build src/quillcache/_native/*.c src/quillcache/_native/*.so src/quillcache/_native/*.html

distclean: clean
	rm -rf $(VENV) $(ENGINES_VENV) $(ENGINES_LOG) $(ENGINES_TEST_LOG) var .hypothesis .pytest_cache *.egg-info src/*.egg-info
