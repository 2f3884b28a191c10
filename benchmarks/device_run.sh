#!/usr/bin/env bash
# One device call: build, GPU + CPU tests, optional sanitizer, SASS and the benchmark.
# Usage (on the lent GPU machine): bash benchmarks/device_run.sh [tests|sanitize|bench|sass]...
# Writes logs and results under $OUT (or ./device-out).
set -uo pipefail
OUT=${OUT:-$PWD/device-out}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
steps=${*:-"tests bench"}
log() { echo "== $(date +%T) $*"; }

log build
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem --format=csv | tee "$OUT/gpu.txt"
python3 -c "import nanobind, scikit_build_core; print('nanobind', nanobind.__version__, 'skbuild', scikit_build_core.__version__)"
python3 -m pip install --no-build-isolation --no-deps -q ${NVFP4KV_PIP_ARGS:-} . > "$OUT/build.log" 2>&1 || { tail -40 "$OUT/build.log"; exit 1; }
cd /tmp  # import the installed package, not the source tree
python3 -c "import nvfp4kv, json; print(json.dumps(nvfp4kv.build_info()))" | tee "$OUT/build_info.json"
cd - > /dev/null

for step in $steps; do
  case $step in
    tests)
      log tests
      python3 -m pytest tests/python -q -p no:cacheprovider -x --durations=5 2>&1 | tee "$OUT/tests.log" | tail -25 ;;
    gputests)
      log gpu tests
      python3 -m pytest tests/python/test_gpu.py -q -p no:cacheprovider 2>&1 | tee "$OUT/gputests.log" | tail -25 ;;
    sanitize)
      log memcheck
      timeout 240 compute-sanitizer --tool memcheck --print-limit 20 python3 -m pytest tests/python/test_gpu.py -q -p no:cacheprovider -k "not large and not graph and not stream" 2>&1 | tee "$OUT/memcheck.log" | tail -8
      log racecheck
      timeout 120 compute-sanitizer --tool racecheck --print-limit 20 python3 -m pytest tests/python/test_gpu.py -q -p no:cacheprovider -k "equals_cpu and 5d" 2>&1 | tee "$OUT/racecheck.log" | tail -8 ;;
    sass)
      log sass
      so=$(python3 -c "import nvfp4kv, pathlib; print(next(pathlib.Path(nvfp4kv.__file__).parent.glob('lib/libnvfp4kv.so')))")
      cuobjdump --dump-resource-usage "$so" 2>&1 | grep -A1 'DTypeE2ELNS_6RecipeE0ELb1ELi2' | tail -1
      cuobjdump --dump-sass -arch sm_90 "$so" > /tmp/sass.txt 2>&1
      python3 benchmarks/sass_stats.py "DTypeE2ELNS_6RecipeE0ELb1ELi2" "$OUT/sass_store_bf16.txt" < /tmp/sass.txt ;;
    bench)
      log bench
      python3 benchmarks/bench_store.py ${BENCH_ARGS:-} --json "$OUT/bench.json" 2>&1 | tee "$OUT/bench.txt" | tail -40 ;;
  esac
done
log done
