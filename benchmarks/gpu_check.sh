#!/usr/bin/env bash
# GPU check for fp-dcp (docs/gpu.md), for a single-GPU machine without network access.
#
#   benchmarks/gpu_check.sh OUT_DIR            # about 7 minutes on one H200
#
# Uses .dep (headers and libraries of liburing and libxxhash, and a static fio: see
# ../shared/gpu/prepare-deps.sh) where the machine lacks them. Builds the C extension in place,
# says which I/O engine runs, runs the GPU tests in file order on CUDA and on the CPU route
# (the CUDA runtime double), then benchmarks/gpu_check.py, whose table is printed at the end
# even when a section fails, then benchmarks/node_bench.py: 8 ranks on the one GPU (gloo) saving
# and loading their FSDP2 shards in 8 tmpfs directories against fio --numjobs=8 (about a minute).
# OUT_DIR gets gpu_check.json, train_demo.json, node_bench.json and the logs.
# Environment: PYTHON (default python3), CHECK_DIR (where checkpoints are written; default: the
# repository, i.e. the local disk), BUDGET_S (gpu_check.py's time budget, default 270), SKIP
# (gpu_check.py sections to skip, comma-separated; "node" skips node_bench.py), NODE_GB and
# NODE_ROUNDS (node_bench.py's --gb and --rounds, default 8 and 1).
set -euo pipefail
cd "$(dirname "$0")/.."
OUT=${1:?usage: benchmarks/gpu_check.sh OUT_DIR}
mkdir -p "$OUT"
OUT=$(cd "$OUT" && pwd)
PYTHON=${PYTHON:-python3}
if [ -d .dep ]; then
  export CPATH=$PWD/.dep/include LIBRARY_PATH=$PWD/.dep/lib LD_LIBRARY_PATH=$PWD/.dep/lib PATH=$PWD/.dep/bin:$PATH
fi
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
START=$SECONDS

echo "== build"
"$PYTHON" setup.py -q build_ext --inplace >"$OUT/build.log" 2>&1 || { tail -20 "$OUT/build.log"; exit 1; }
"$PYTHON" - <<'PY'
import fp_dcp, torch
from fp_dcp import _cio
info = fp_dcp.engine_info(".")
print(f"fp_dcp._cio built {'with' if _cio.HAVE_IO_URING else 'WITHOUT'} liburing, "
      f"{'with' if hasattr(_cio, 'Hash128') else 'WITHOUT'} libxxhash; engine here: {info['engine']}"
      + (f" (fallback: {info['fallback_reason']})" if info["fallback_reason"] else "")
      + f", O_DIRECT: {info['direct_io']}")
print(f"torch {torch.__version__}, CUDA available: {torch.cuda.is_available()}"
      + (f", {torch.cuda.get_device_name()}" if torch.cuda.is_available() else ""))
PY

echo "== tests (in file order: staging, page-locking, GPU loads, device CRC, kernels, overlap)"
set +e
timeout 300 "$PYTHON" -m pytest -q -p no:cacheprovider tests/test_staging.py tests/test_page_locking.py \
  tests/test_gpu_loads.py tests/test_device_crc.py tests/test_cuda_sources.py tests/test_overlap.py 2>&1 | tee "$OUT/tests.log" | tail -n 25
TESTS=${PIPESTATUS[0]}
set -e
echo "tests exit status: $TESTS; build and tests took $(( SECONDS - START )) s"

echo "== measurements"
"$PYTHON" benchmarks/gpu_check.py "$OUT" --device cuda --dir "${CHECK_DIR:-.}" --budget-s "${BUDGET_S:-270}" \
  --skip "${SKIP:-}" --tests-status "$TESTS" 2>&1 | tee "$OUT/measure.log"

case ",${SKIP:-}," in
  *,node,*) ;;
  *)
    echo "== 8 ranks on the one GPU into 8 tmpfs directories against fio --numjobs=8 (node_bench.py)"
    NODE_DIR=$(mktemp -d /dev/shm/fp-dcp-node.XXXXXX)
    mkdir "$NODE_DIR"/{0..7}
    set +e
    timeout 300 "$PYTHON" benchmarks/node_bench.py --device cuda --ranks 8 --gb "${NODE_GB:-8}" \
      --rounds "${NODE_ROUNDS:-1}" --dirs "$(echo "$NODE_DIR"/{0..7} | tr ' ' ,)" --json "$OUT/node_bench.json" \
      2>&1 | tee "$OUT/node_bench.log"
    echo "node_bench.py exit status: ${PIPESTATUS[0]}"
    set -e
    rm -rf "$NODE_DIR"
    ;;
esac
exit "$TESTS"
