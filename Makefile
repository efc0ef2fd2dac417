# Set-up is part of every target: a fresh Debian machine with Python 3.11 needs only `make demo` or `make test`.
PYTHON ?= python3
VENV   := .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.installed
TORCH  := torch==2.13.0

.PHONY: demo test build wheel system-deps clean lint asan

demo: build
	$(PY) -m fp_dcp bench

# The suite runs on both ends of the torch range pyproject.toml declares: on $(TORCH) in .venv, then on
# the oldest declared torch in .venv-torch-$(OLDEST_TORCH) (made by benchmarks/torch_matrix.sh and kept
# between runs: a CUDA build of torch from PyPI with its NVIDIA libraries, about 4 GB, run on CPU). There
# it leaves out tests/test_frameworks.py only: the framework packages pin a torch of their own.
OLDEST_TORCH := 2.7.1

test: lint
	FP_DCP_WERROR=1 $(PY) -m pytest -q
	KEEP=1 PYTHON=$(PYTHON) SUITE_ARGS=--ignore=tests/test_frameworks.py benchmarks/torch_matrix.sh $(OLDEST_TORCH)

# Debian packages: liburing-dev for the io_uring engine, libxxhash-dev for incremental saves' content hash
# (xxhash's xxhsum is the tests' reference for it), libisal-dev for the fastest CRC-32C, strace for the
# durability-order test, fio for the benchmark's disk limit.
system-deps:
	@if [ ! -f /usr/include/liburing.h ] || [ ! -f /usr/include/xxhash.h ] || [ ! -f /usr/include/isa-l/crc.h ] \
	    || ! command -v xxhsum >/dev/null || ! command -v strace >/dev/null || ! command -v fio >/dev/null; then \
	  if [ "$$(id -u)" = 0 ]; then \
	    apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq liburing-dev libxxhash-dev libisal-dev xxhash strace fio >/dev/null; \
	  else \
	    echo "warning: liburing-dev/libxxhash-dev/libisal-dev/xxhash/strace/fio missing and not root: building without io_uring, incremental saves or ISA-L" >&2; \
	  fi; \
	fi

$(PY):
	$(PYTHON) -m venv $(VENV)

# torch first and pinned: the CPU wheel of 2.13.0 is on these machines' disk; an unpinned
# torch in an empty venv would download a multi-GB CUDA build. s3fs is pinned beside the
# frameworks: the datasets release they pull in caps fsspec, and each s3fs pins its fsspec exactly.
$(STAMP): pyproject.toml setup.py | $(PY)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q $(TORCH)
	$(PY) -m pip install -q -e '.[test,dev]'
	$(PY) -m pip install -q lightning==2.6.6 accelerate==1.15.0 torchtitan==0.3.0 torchtune==0.6.1 torchao==0.15.0 s3fs==2026.2.0 || echo "warning: framework packages not installed: tests/test_frameworks.py will skip" >&2
	touch $@

build: system-deps $(STAMP)
	FP_DCP_WERROR=1 $(PY) setup.py -q build_ext --inplace

# Wheels users install without a compiler or the -dev packages: one per Python found (override with
# WHEEL_PYTHONS="python3.10 python3.12 ..."), each built from the sdist so that nothing of the in-place build
# slips in, then repaired by auditwheel: liburing, ISA-L and libxxhash copied into fp_dcp.libs/ and the tag
# raised to manylinux_2_28, the oldest glibc its symbols allow. Each wheel's native module is then loaded by its
# own Python with the system's copies of the three libraries hidden (tests/wheel_check.py; as root).
WHEEL_PYTHONS ?= $(shell for v in 3.10 3.11 3.12 3.13 3.14; do command -v python$$v >/dev/null && python$$v -c '' 2>/dev/null && echo python$$v; done; true)
WHEEL_PLATFORM := manylinux_2_28_$(shell uname -m)

wheel: system-deps $(STAMP)
	rm -rf build/wheel dist && mkdir -p build/wheel dist
	$(PY) setup.py -q sdist -d dist
	for py in $(WHEEL_PYTHONS); do $$py -m pip wheel --no-deps -q -w build/wheel dist/fp_dcp-*.tar.gz || exit 1; done
	PATH=$(CURDIR)/$(VENV)/bin:$$PATH $(VENV)/bin/auditwheel repair --plat $(WHEEL_PLATFORM) -w dist build/wheel/*.whl
	for py in $(WHEEL_PYTHONS); do \
	  tag=$$($$py -c 'import sys; print("cp%d%d" % sys.version_info[:2])'); \
	  $(PY) tests/wheel_check.py $$py dist/fp_dcp-*-$$tag-$$tag-$(WHEEL_PLATFORM).whl || exit 1; \
	done
	ls -l dist

clean:
	rm -rf $(VENV) .venv-torch-* build dist *.egg-info fp_dcp/_native/*.so

# ---- code health: lint runs with every `make test`; asan before each release ----

LINTED := fp_dcp tests benchmarks examples

lint: build
	$(VENV)/bin/ruff check $(LINTED)
	$(VENV)/bin/ruff format --check $(LINTED)
	$(VENV)/bin/mypy
	$(VENV)/bin/lint-imports --no-cache

# The C engine's tests against an AddressSanitizer build of fp_dcp._native._cio, made in a scratch copy of the
# tree (the normal build stays as it is). The interpreter is not instrumented, so libasan is preloaded;
# leak checking is off because CPython deliberately never frees some memory at exit. (valgrind is installed
# too, but without CPython's suppressions file it reports hundreds of false errors inside the interpreter.)
ASAN_DIR := build/asan
ASAN_LIB  = $(shell $(CC) -print-file-name=libasan.so)
ENGINE_TESTS := tests/test_cio.py tests/test_engine.py

asan: build
	rm -rf $(ASAN_DIR) && mkdir -p $(ASAN_DIR)
	cp -r setup.py pyproject.toml README.md MANIFEST.in fp_dcp_default_storage.pth cio cuda fp_dcp tests $(ASAN_DIR)/
	rm -rf $(ASAN_DIR)/fp_dcp/_native/*.so $(ASAN_DIR)/fp_dcp/__pycache__ $(ASAN_DIR)/tests/__pycache__
	cd $(ASAN_DIR) && FP_DCP_WERROR=1 CFLAGS="-fsanitize=address -fno-omit-frame-pointer -g" LDFLAGS="-fsanitize=address" \
	  $(CURDIR)/$(PY) setup.py -q build_ext --inplace
	cd $(ASAN_DIR) && LD_PRELOAD=$(ASAN_LIB) ASAN_OPTIONS=detect_leaks=0:abort_on_error=1 \
	  $(CURDIR)/$(PY) -c "import fp_dcp._native._cio as c; assert c.__file__.startswith('$(CURDIR)/$(ASAN_DIR)/'), c.__file__"
	cd $(ASAN_DIR) && LD_PRELOAD=$(ASAN_LIB) ASAN_OPTIONS=detect_leaks=0:abort_on_error=1 FP_DCP_WERROR=1 \
	  $(CURDIR)/$(PY) -m pytest -q -p no:cacheprovider $(ENGINE_TESTS)
