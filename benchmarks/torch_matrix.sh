#!/usr/bin/env bash
# The test suite on every torch fp-dcp declares, one after the other (run before a release):
#
#   benchmarks/torch_matrix.sh                # every version in fp_dcp.compat.CHECKED_TORCH
#   benchmarks/torch_matrix.sh 2.7.1 2.14.1   # only these
#
# For each version: a venv .venv-torch-VERSION beside .venv (reused while its stamp is newer than
# pyproject.toml and setup.py) with that torch and fp-dcp (editable: the C extension is built in place
# and holds no torch, so every venv of this Python shares it), then three checks: `import fp_dcp`, a
# save/load round trip compared bit for bit, and the suite. The venv is removed afterwards unless
# KEEP=1 (each holds a torch build with its CUDA libraries: 3-5 GB; they import and run on CPU).
# SUITE_ARGS are pytest's arguments (default: the whole suite less tests/test_frameworks.py, whose
# packages pin a torch of their own). The table goes to stdout and to build/torch-matrix.md.
# `make test` runs this for the oldest declared torch (OLDEST_TORCH in the Makefile) with KEEP=1.
set -uo pipefail
cd "$(dirname "$0")/.."

PYTHON=${PYTHON:-python3}
SUITE_ARGS=${SUITE_ARGS:---ignore=tests/test_frameworks.py}
if [ $# -gt 0 ]; then
  versions=("$@")
else
  read -r -a versions <<<"$(sed -n 's/^CHECKED_TORCH = (\(.*\))$/\1/p' fp_dcp/compat.py | tr -d '",')"
fi
[ ${#versions[@]} -gt 0 ] || { echo "no torch versions given or found in fp_dcp/compat.py" >&2; exit 2; }

ROUND_TRIP='
import tempfile, torch, torch.distributed.checkpoint as dcp
from fp_dcp import FastPersistReader, FastPersistWriter
g = torch.Generator().manual_seed(0)
state = {"w": torch.randn(1000, 33, generator=g), "h": torch.randn(77, generator=g).half(), "i": torch.arange(9)}
with tempfile.TemporaryDirectory() as d:
    dcp.save(state, storage_writer=FastPersistWriter(d), no_dist=True)
    got = {k: torch.zeros_like(v) for k, v in state.items()}
    dcp.load(got, storage_reader=FastPersistReader(d), no_dist=True)
assert all(torch.equal(got[k].view(torch.uint8), state[k].view(torch.uint8)) for k in state), "not bit-exact"
'

mkdir -p build
table=build/torch-matrix.md
{
  echo "| torch | import fp_dcp | save/load round trip | suite (${SUITE_ARGS}) | minutes |"
  echo "|---|---|---|---|---|"
} >"$table"
failed=0
for version in "${versions[@]}"; do
  venv=.venv-torch-$version
  started=$SECONDS
  if [ ! -f "$venv/.installed" ] || [ pyproject.toml -nt "$venv/.installed" ] || [ setup.py -nt "$venv/.installed" ]; then
    rm -rf "$venv"
    # setuptools as pyproject.toml's build-system asks: tests/test_packaging.py builds without isolation.
    if ! { "$PYTHON" -m venv "$venv" && "$venv/bin/python" -m pip install -q --upgrade pip "setuptools>=68" \
        && "$venv/bin/python" -m pip install -q "torch==$version" \
        && FP_DCP_WERROR=1 "$venv/bin/python" -m pip install -q -e '.[test]'; }; then
      echo "| $version | not installed | - | - | $(((SECONDS - started) / 60)) |" >>"$table"
      failed=1
      continue
    fi
    touch "$venv/.installed"
  fi
  py=$venv/bin/python
  imported=$("$py" -c 'import fp_dcp, torch; print("ok", torch.__version__)' 2>&1 | tail -1)
  round_trip=$("$py" -c "$ROUND_TRIP" 2>&1 && echo "bit-exact" || echo "FAILED")
  echo "== torch $version: $imported; round trip: ${round_trip##*$'\n'}; the suite:"
  # shellcheck disable=SC2086  # SUITE_ARGS is a list of pytest arguments
  "$py" -m pytest -q -p no:cacheprovider $SUITE_ARGS 2>&1 | tee "build/torch-matrix-$version.log"
  status=${PIPESTATUS[0]}
  suite=$(tail -1 "build/torch-matrix-$version.log")
  [ "$status" = 0 ] && [ "${round_trip##*$'\n'}" = bit-exact ] && [ "${imported%% *}" = ok ] || failed=1
  echo "| $version | ${imported} | ${round_trip##*$'\n'} | ${suite//|/\/} | $(((SECONDS - started) / 60)) |" >>"$table"
  [ "${KEEP:-0}" = 1 ] || rm -rf "$venv"
done
cat "$table"
exit $failed
