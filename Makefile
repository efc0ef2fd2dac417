# Set-up is part of every target: a fresh Debian machine with Python 3.11 needs only `make demo` or `make test`.
PYTHON ?= python3
VENV   := .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.installed
TORCH  := torch==2.13.0

.PHONY: demo test build system-deps clean

demo: build
	$(PY) -m fp_dcp.bench

test: build
	FP_DCP_WERROR=1 $(PY) -m pytest -q

# Debian packages: liburing-dev for the io_uring engine, strace for the durability-order test.
system-deps:
	@if [ ! -f /usr/include/liburing.h ] || ! command -v strace >/dev/null; then \
	  if [ "$$(id -u)" = 0 ]; then \
	    apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq liburing-dev strace >/dev/null; \
	  else \
	    echo "warning: liburing-dev/strace missing and not root: building without io_uring" >&2; \
	  fi; \
	fi

$(PY):
	$(PYTHON) -m venv $(VENV)

# torch first and pinned: the CPU wheel of 2.13.0 is on these machines' disk; an unpinned
# torch in an empty venv would download a multi-GB CUDA build.
$(STAMP): pyproject.toml setup.py | $(PY)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q $(TORCH)
	$(PY) -m pip install -q -e '.[test]'
	touch $@

build: system-deps $(STAMP)
	FP_DCP_WERROR=1 $(PY) setup.py -q build_ext --inplace

clean:
	rm -rf $(VENV) build *.egg-info fp_dcp/*.so
