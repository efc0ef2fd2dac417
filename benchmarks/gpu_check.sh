#!/usr/bin/env bash
# GPU check for fp-dcp (docs/gpu.md), for a single-GPU machine without network access, in one device call.
#
#   benchmarks/gpu_check.sh OUT_DIR            # at most TOTAL_S (default 540) seconds
#
# Uses .dep (headers and libraries of liburing and libxxhash, and a static fio: see
# ../shared/gpu/prepare-deps.sh) where the machine lacks them, and the wheels in .wheels (the
# safetensors peers, see docs/gpu.md), unpacked onto PYTHONPATH after the machine's own packages.
# The figures first, then the tests, in the time left, so a call cut short still brings the figures back:
# builds the C extension in place and says which I/O engine runs; benchmarks/gpu_check.py (its table
# is printed at the end even when a section fails); benchmarks/node_bench.py: 8 ranks on the one GPU
# (gloo) saving and loading their FSDP2 shards in 8 tmpfs directories against fio --numjobs=8;
# benchmarks/safetensors_bench.py into CUDA targets against the other loaders, fio and the H2D peak;
# last the GPU tests in file order on CUDA and on the CPU route (the CUDA runtime double).
# OUT_DIR gets gpu_check.json, node_bench.json, the logs.
# Environment: PYTHON (default python3), CHECK_DIR (where checkpoints are written; default: the
# repository, i.e. the local disk), TOTAL_S, BUDGET_S (gpu_check.py's time budget, default 200), SKIP
# (gpu_check.py sections to skip, comma-separated, default "demo"; "node" skips node_bench.py,
# "safetensors" safetensors_bench.py), NODE_GB and NODE_ROUNDS (node_bench.py's --gb and --rounds,
# default 4 and 1), ST_GB (safetensors_bench.py's --gb, default 2).
set -euo pipefail
cd "$(dirname "$0")/.."
OUT=${1:?usage: benchmarks/gpu_check.sh OUT_DIR}
mkdir -p "$OUT"
OUT=$(cd "$OUT" && pwd)
PYTHON=${PYTHON:-python3}
TOTAL_S=${TOTAL_S:-540}
SKIP=${SKIP:-demo}
if [ -d .dep ]; then
  export CPATH=$PWD/.dep/include LIBRARY_PATH=$PWD/.dep/lib LD_LIBRARY_PATH=$PWD/.dep/lib PATH=$PWD/.dep/bin:$PATH
fi
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
if compgen -G ".wheels/*.whl" >/dev/null; then
  WHEELS=$(mktemp -d)
  for w in .wheels/*.whl; do "$PYTHON" -m zipfile -e "$w" "$WHEELS"; done
  export PYTHONPATH="$PYTHONPATH:$WHEELS"  # after the machine's own packages: its torch and numpy win
fi
START=$SECONDS
left() { echo $(( TOTAL_S - (SECONDS - START) )); }
skipped() { case ",$SKIP," in *,"$1",*) return 0 ;; *) return 1 ;; esac; }

echo "== build"
"$PYTHON" setup.py -q build_ext --inplace >"$OUT/build.log" 2>&1 || { tail -20 "$OUT/build.log"; exit 1; }
"$PYTHON" - <<'PY'
import fp_dcp, torch
from fp_dcp._native import _cio
info = fp_dcp.engine_info(".")
print(f"fp_dcp._native._cio built {'with' if _cio.HAVE_IO_URING else 'WITHOUT'} liburing, "
      f"{'with' if hasattr(_cio, 'Hash128') else 'WITHOUT'} libxxhash, CRC-32C {_cio.CRC32C_ENGINE}, "
      f"copies {_cio.COPY_CRC32C_ENGINE}; engine here: {info['engine']}"
      + (f" (fallback: {info['fallback_reason']})" if info["fallback_reason"] else "")
      + f", O_DIRECT: {info['direct_io']}")
print(f"torch {torch.__version__}, CUDA available: {torch.cuda.is_available()}"
      + (f", {torch.cuda.get_device_name()}" if torch.cuda.is_available() else ""))
PY

echo "== measurements ($(left) s left)"
"$PYTHON" benchmarks/gpu_check.py "$OUT" --device cuda --dir "${CHECK_DIR:-.}" --budget-s "${BUDGET_S:-200}" \
  --skip "$SKIP" 2>&1 | tee "$OUT/measure.log"

set +e
if ! skipped node; then
  echo "== 8 ranks on the one GPU into 8 tmpfs directories against fio --numjobs=8 ($(left) s left)"
  NODE_DIR=$(mktemp -d /dev/shm/fp-dcp-node.XXXXXX)
  mkdir "$NODE_DIR"/{0..7}
  timeout 150 "$PYTHON" benchmarks/node_bench.py --device cuda --ranks 8 --gb "${NODE_GB:-4}" \
    --rounds "${NODE_ROUNDS:-1}" --dirs "$(echo "$NODE_DIR"/{0..7} | tr ' ' ,)" --json "$OUT/node_bench.json" \
    >"$OUT/node_bench.log" 2>&1
  echo "node_bench.py exit status: $?"
  tail -n 20 "$OUT/node_bench.log"
  rm -rf "$NODE_DIR"
fi
if ! skipped safetensors; then
  echo "== safetensors into CUDA targets against the other loaders, fio and the H2D peak ($(left) s left)"
  timeout 150 "$PYTHON" benchmarks/safetensors_bench.py --device cuda --gb "${ST_GB:-2}" --rounds 1 --no-ranks \
    --dir "${CHECK_DIR:-.}" >"$OUT/safetensors.log" 2>&1
  echo "safetensors_bench.py exit status: $?"
  grep -v "^round" "$OUT/safetensors.log" | tail -n 30
fi

echo "== tests in file order: staging, page-locking, GPU loads, device CRC, kernels, overlap ($(left) s left)"
timeout $(( $(left) > 40 ? $(left) - 10 : 30 )) "$PYTHON" -m pytest -q -p no:cacheprovider tests/test_staging.py \
  tests/test_page_locking.py tests/test_gpu_loads.py tests/test_device_crc.py tests/test_cuda_sources.py \
  tests/test_overlap.py >"$OUT/tests.log" 2>&1
TESTS=$?
tail -n 25 "$OUT/tests.log"
echo "tests exit status: $TESTS; $(( SECONDS - START )) s in all"
exit "$TESTS"
