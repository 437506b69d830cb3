#!/usr/bin/env bash
# The README's GPU table: benchmarks/speed.py at 1 GiB on one GPU against plain Orbax in the
# same run, plus device-to-host bandwidth and engine/transfer.py's copies. Logs go to $OUT
# (default: ./gpu_out).
#   bash benchmarks/gpu_speed.sh            # on a machine with a CUDA jax
#   PLAIN_TRANSFER_CONFIGS=lc EXTRA_CONFIGS=adaptive bash benchmarks/gpu_speed.sh
# Optional: wheels in .whl/ (e.g. the orbax-checkpoint this project pins) are installed first,
# and .whl/d2h_bandwidth.py is run when present.
set -u
OUT=${OUT:-gpu_out}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
# fresh-process saves run in a child process beside the parent: no 75% preallocation each
export XLA_PYTHON_CLIENT_PREALLOCATE=false
if ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site:$PYTHONPATH
fi
{
  nvidia-smi -L; nproc
  python3 -c "import jax, orbax.checkpoint as o, flax, numba, numpy; print('jax', jax.__version__, jax.devices(), 'orbax', o.__version__, 'flax', flax.__version__, 'numba', numba.__version__, 'numpy', numpy.__version__)"
} 2>&1 | tee "$OUT/env.txt"
if [ -f .whl/d2h_bandwidth.py ]; then
  timeout 90 python3 .whl/d2h_bandwidth.py 2>&1 | tee "$OUT/d2h.txt"
fi
timeout 120 python3 benchmarks/transfer_bandwidth.py --mb 256 2>&1 | tee "$OUT/transfer.txt"
timeout "${SPEED_TIMEOUT:-420}" python3 benchmarks/speed.py --sizes "${SIZES:-1024}" \
  --configs "${CONFIGS:-default,lc}" --restores "${RESTORES:-2}" 2>&1 | tee "$OUT/speed.txt"
if [ -n "${PLAIN_TRANSFER_CONFIGS:-}" ]; then  # the same, with engine/transfer.py off
  ORBAX_LOSSY_TRANSFER=plain timeout "${PLAIN_TIMEOUT:-150}" python3 benchmarks/speed.py \
    --sizes "${SIZES:-1024}" --configs "$PLAIN_TRANSFER_CONFIGS" --restores 1 --no-fresh \
    2>&1 | tee "$OUT/speed_plain_transfer.txt"
fi
if [ -n "${EXTRA_CONFIGS:-}" ]; then
  timeout "${EXTRA_TIMEOUT:-120}" python3 benchmarks/speed.py --sizes "${EXTRA_SIZES:-256}" \
    --configs "$EXTRA_CONFIGS" --restores 1 --no-fresh 2>&1 | tee "$OUT/speed_extra.txt"
fi
