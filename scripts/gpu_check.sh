#!/usr/bin/env bash
# The prepared GPU command: CUDA tests, layer and whole-model benchmarks, one profiled training step
# of each setup that missed its target, A/B runs of fast-path alternatives, and the CAT Fig 2 sweep's cells per GPU-hour (posattn
# bench-throughput) into the results store, then the next unfinished cells of the CAT figure
# recipes, all inside one hard deadline.
#
#   OUT=/path/to/empty/folder bash scripts/gpu_check.sh        # from the repository root
#
# What comes back in $OUT (at most 8 files): results.tar.gz (the new and changed files under
# results/, unpack at the repository root and commit), summary.txt (stages, seconds, what was left
# for lack of time), gpu_check.log, pytest.log, layer_bench.json, layer_bench_compiled.json,
# model_bench.json, throughput.json. Settings (environment): GPU_CHECK_SECONDS (default 480), GPU_CHECK_DEVICE
# (cuda), GPU_CHECK_WORKERS (compare workers, 4), GPU_CHECK_CAT_COMPILE
# (the CAT cells' --compile mode, reduce-overhead; none: eager), GPU_CHECK_REPEATS (3), GPU_CHECK_COMPILE_MODE
# (default), GPU_CHECK_COMPILE_GROUP (1) and GPU_CHECK_EAGER_GROUP (4) (mechanisms per run),
# GPU_CHECK_BOXES ("tests=90 layer_eager=35 layer_compiled=35 models=45 profile=30 ab=40 throughput=30";
# a stage may also use what the stages before it left of their boxes; 0 skips a stage; with every
# CAT figure complete in the store, the time left for its cells goes to these boxes in proportion),
# GPU_CHECK_SHAPES ("4096x16 512x16 ..."), GPU_CHECK_MECHANISMS, GPU_CHECK_RECIPES, GPU_CHECK_RETEST=1
# (run the CUDA tests although results/gpu_tests.json says they passed on this GPU at these sources), GPU_CHECK_TINY=1
# (tiny sizes: the whole command on a CPU in a few minutes, its store in $OUT/results, never the
# repository's); see posattn/bench/gpu_check.py.
set -u
if [ -z "${OUT:-}" ] || [ ! -d "$OUT" ]; then
    echo "gpu_check.sh: set OUT to an existing folder for the results" >&2
    exit 2
fi
cd "$(dirname "$0")/.."
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
export OMP_WAIT_POLICY=PASSIVE
PY="${PYTHON:-python3}"
SECONDS_LIMIT="${GPU_CHECK_SECONDS:-480}"
# the driver keeps its own deadline; this is the backstop should it hang (it then loses only the summary)
timeout --signal=TERM --kill-after=10 "$((${SECONDS_LIMIT%.*} + 20))" \
    "$PY" -m posattn.cli gpu-check --out "$OUT"
rc=$?
echo "gpu_check.sh: exit $rc; $(ls "$OUT" | wc -l) files in $OUT"
cat "$OUT/summary.txt" 2>/dev/null
exit $rc
