#!/usr/bin/env bash
# GPU check for fp-dcp's staging (docs/gpu.md), for a single-GPU machine without network access.
#
#   benchmarks/gpu_check.sh OUT_DIR            # at most 8 minutes on one H200
#
# Builds the C extension in place (no downloads: pip --no-build-isolation --no-deps, else
# setup.py), says which I/O engine runs (io_uring needs liburing at build time; without it the
# threads engine is used), runs the GPU and staging tests, then benchmarks/gpu_check.py: pinned D2H
# peak, staging throughput, save GB/s from GPU tensors against FileSystemWriter(thread_count=1),
# async blocked time against sync save time, and the training demo's overhead per iteration.
# The table is printed at the end; OUT_DIR gets gpu_check.json, train_demo.json and the logs.
# Environment: PYTHON (default python3), CHECK_DIR (where checkpoints are written; default: the
# repository, i.e. the local disk), SIZE_GIB (state size, default 4), DEMO_ARGS (model of the demo).
set -euo pipefail
cd "$(dirname "$0")/.."
OUT=${1:?usage: benchmarks/gpu_check.sh OUT_DIR}
mkdir -p "$OUT"
OUT=$(cd "$OUT" && pwd)
PYTHON=${PYTHON:-python3}
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"  # fp_dcp importable even if only built in place
START=$SECONDS

echo "== build"
if ! "$PYTHON" -m pip install -q --no-build-isolation --no-deps -e . >"$OUT/build.log" 2>&1; then
  echo "pip install -e . failed (see build.log); building the extension in place"
  "$PYTHON" setup.py -q build_ext --inplace >>"$OUT/build.log" 2>&1
fi
"$PYTHON" - <<'PY'
import fp_dcp, torch
from fp_dcp import _cio
info = fp_dcp.engine_info(".")
print(f"fp_dcp._cio built {'with' if _cio.HAVE_IO_URING else 'WITHOUT'} liburing; engine here: {info['engine']}"
      + (f" (fallback: {info['fallback_reason']})" if info["fallback_reason"] else "")
      + f", O_DIRECT: {info['direct_io']}")
print(f"torch {torch.__version__}, CUDA available: {torch.cuda.is_available()}"
      + (f", {torch.cuda.get_device_name()}" if torch.cuda.is_available() else ""))
PY

echo "== tests (GPU, staging, overlap, kernels)"
set +e
timeout 150 "$PYTHON" -m pytest -q -p no:cacheprovider tests/test_staging.py tests/test_cuda_sources.py \
  tests/test_overlap.py 2>&1 | tee "$OUT/tests.log" | tail -n 15
TESTS=${PIPESTATUS[0]}
set -e
echo "tests exit status: $TESTS; build and tests took $(( SECONDS - START )) s"

echo "== measurements"
BUDGET=$(( 450 - (SECONDS - START) ))
"$PYTHON" benchmarks/gpu_check.py "$OUT" --device cuda --size-gib "${SIZE_GIB:-4}" --dir "${CHECK_DIR:-.}" \
  --budget-s "$BUDGET" --tests-status "$TESTS" \
  --demo-args "${DEMO_ARGS:---vocab 32768 --dim 1024 --layers 8 --heads 16 --seq 1024 --batch 64 --warmup 2 --iters 3 --rounds 2}" \
  2>&1 | tee "$OUT/measure.log"
exit "$TESTS"
