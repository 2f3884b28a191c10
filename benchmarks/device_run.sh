#!/usr/bin/env bash
# One device call: build, GPU + CPU tests, optional sanitizer, SASS and the benchmark.
# Usage (on the lent GPU machine): bash benchmarks/device_run.sh [tests|gputests|sanitize|initcheck|decodecheck|sm80|host|bench|decode|ceilings|amax|sass|noimage]...
# Writes logs and results under $OUT (or ./device-out). SKIP_BUILD=1 keeps the package that an
# earlier call of this session installed (a warm machine) instead of building it again.
set -uo pipefail
OUT=${OUT:-$PWD/device-out}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
steps=${*:-"tests bench"}
log() { echo "== $(date +%T) $*"; }

log build
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem --format=csv | tee "$OUT/gpu.txt"
python3 -c "import nanobind, scikit_build_core; print('nanobind', nanobind.__version__, 'skbuild', scikit_build_core.__version__)"
if [ "${SKIP_BUILD:-0}" != 1 ]; then
  python3 -m pip install --no-build-isolation --no-deps -q ${NVFP4KV_PIP_ARGS:-} . > "$OUT/build.log" 2>&1 || { tail -40 "$OUT/build.log"; exit 1; }
fi
cd /tmp  # import the installed package, not the source tree
python3 -c "import nvfp4kv, json; print(json.dumps(nvfp4kv.build_info()))" | tee "$OUT/build_info.json"
cd - > /dev/null

for step in $steps; do
  case $step in
    sass|host|ceilings)
      # These run the laboratory's scripts, which a git checkout has and the sdist leaves out.
      [ -d tools ] || { echo "step $step needs tools/ (a git checkout of nvfp4kv); skipped"; continue; } ;;
  esac
  case $step in
    tests)
      log tests
      python3 -m pytest tests/python -q -p no:cacheprovider -x -rf --tb=short --durations=5 2>&1 | tee "$OUT/tests.log" | tail -25 ;;
    gputests)
      log gpu tests
      python3 -m pytest tests/python/test_gpu.py -q -p no:cacheprovider 2>&1 | tee "$OUT/gputests.log" | tail -25 ;;
    sanitize)
      log memcheck
      timeout 420 compute-sanitizer --tool memcheck --print-limit 20 python3 -m pytest tests/python/test_gpu.py tests/python/test_gather.py tests/python/test_property.py tests/python/test_ops.py -q -p no:cacheprovider -k "(cuda or gpu or equals_cpu or device) and not large and not graph and not stream" 2>&1 | tee "$OUT/memcheck.log" | tail -8
      log racecheck
      timeout 180 compute-sanitizer --tool racecheck --print-limit 20 python3 -m pytest tests/python/test_gpu.py tests/python/test_gather.py -q -p no:cacheprovider -k "(equals_cpu and 5d) or row_sizes" 2>&1 | tee "$OUT/racecheck.log" | tail -8 ;;
    initcheck)
      # Reads of device memory nothing wrote (memcheck does not see them): the CUDA property tests
      # compare every returned byte with the CPU's.
      log "initcheck over the CUDA property tests and the gather GPU tests"
      timeout 400 compute-sanitizer --tool initcheck --print-limit 20 python3 -m pytest tests/python/test_property.py tests/python/test_gather.py -q -p no:cacheprovider -rf --tb=short -k "cuda" 2>&1 | tee "$OUT/initcheck.log" | tail -8 ;;
    decodecheck)
      # The whole file: 15 s under memcheck and 27 s under racecheck on the H200 (dfde20f).
      log "memcheck over the decode GPU tests (both readers, both merges, NaN groups, graphs)"
      timeout 400 compute-sanitizer --tool memcheck --print-limit 20 python3 -m pytest tests/python/test_decode_gpu.py -q -p no:cacheprovider 2>&1 | tee "$OUT/decodecheck.log" | tail -4
      log "racecheck over the same tests"
      timeout 400 compute-sanitizer --tool racecheck --print-limit 20 python3 -m pytest tests/python/test_decode_gpu.py -q -p no:cacheprovider 2>&1 | tee "$OUT/decoderace.log" | tail -4 ;;
    sass)
      log sass
      so=$(python3 -c "import nvfp4kv; print(nvfp4kv.get_library())")
      cuobjdump --dump-resource-usage "$so" 2>&1 | grep -A1 'DTypeE2ELNS_6RecipeE0ELb1ELi2' | tail -1
      cuobjdump --dump-sass -arch sm_90 "$so" > /tmp/sass.txt 2>&1
      python3 tools/sass_stats.py "DTypeE2ELNS_6RecipeE0ELb1ELi2" "$OUT/sass_store_bf16.txt" < /tmp/sass.txt ;;
    noimage)
      log "build for sm_80 only: a store on this GPU must fail with a clear error"
      python3 -m pip install --no-build-isolation --no-deps -q -C cmake.define.NVFP4KV_CUDA_ARCHS=80-real -C build-dir=/tmp/build-sm80 . > "$OUT/build80.log" 2>&1 || tail -5 "$OUT/build80.log"
      (cd /tmp && python3 -c "
import torch, nvfp4kv
kv = torch.zeros(2, 2, 16, 8, 72, dtype=torch.uint8, device='cuda')
k = torch.randn(3, 8, 128, device='cuda', dtype=torch.bfloat16)
try:
    nvfp4kv.store(k, k, kv, torch.arange(3, device='cuda'), 1.0, 1.0, scale_layout='linear')
    print('NO ERROR (unexpected)')
except Exception as e:
    print(type(e).__name__ + ':', e)
print('cache untouched:', int(kv.sum()) == 0)
nvfp4kv._C._set_store_order('page')  # the sorted store checks too, before touching its workspace
k2 = torch.randn(2000, 8, 128, device='cuda', dtype=torch.bfloat16)
kv2 = nvfp4kv.allocate_kv_cache(nvfp4kv.KVCacheSpec(block_size=16, num_kv_heads=8, head_size=128), 200, device='cuda').zero_()
ws = nvfp4kv.store_workspace(kv2)
try:
    nvfp4kv.store(k2, k2, kv2, torch.arange(2000, device='cuda'), 1.0, 1.0, workspace=ws)
    print('sorted: NO ERROR (unexpected)')
except Exception as e:
    print('sorted:', type(e).__name__ + ':', e)
print('sorted: cache and workspace untouched:', int(kv2.sum()) == 0 and int(ws.sum()) == 0)
out = torch.zeros(3, 8, 128, dtype=torch.bfloat16, device='cuda')
try:  # the gather's fast kernel (bf16, D 128) goes through the same check
    nvfp4kv.gather_dequant(kv, torch.zeros(1, 2, dtype=torch.int32, device='cuda'), torch.tensor([3], dtype=torch.int32, device='cuda'),
                           cu_seqlens=torch.tensor([0, 3], dtype=torch.int32, device='cuda'), k_scale=1.0, v_scale=1.0,
                           scale_layout='linear', key_out=out, value_out=out.clone())
    print('gather: NO ERROR (unexpected)')
except Exception as e:
    print('gather:', type(e).__name__ + ':', e)
q = torch.randn(2, 32, 128, device='cuda', dtype=torch.bfloat16)
o = torch.full_like(q, 7.0)
wide = torch.zeros(2, 12500, dtype=torch.int32, device='cuda')  # page 0 throughout
# The table's width sets the splits: 2 columns, one block per sequence; 12500, split-KV.
for L, bt in ((20, wide[:, :2].contiguous()), (200000, wide)):
    lens = torch.tensor([L, 5], dtype=torch.int32, device='cuda')
    ws = nvfp4kv.decode_workspace(kv2, q, bt)
    try:
        nvfp4kv.decode_attention(q, kv2, bt, lens, 1.0, 1.0, out=o, workspace=ws)
        print('decode', L, ': NO ERROR (unexpected)')
    except Exception as e:
        print('decode', L, ':', type(e).__name__ + ':', e)
    print('decode', L, ': out untouched:', bool((o == 7.0).all()))
")
      python3 -m pip install --no-build-isolation --no-deps -q . > /dev/null 2>&1 ;;
    sm80)
      # The sm_80 code paths on this GPU: compute_80 PTX only (the driver compiles it here with
      # __CUDA_ARCH__ 800; the host then plans for that code, as a user's build for sm_80 alone
      # would run here: no PDL, clusters or bulk copies); the whole suite (or the test paths in
      # SM80_TESTS) against that build, installed apart.
      log "sm_80 paths: compute_80 PTX"
      rm -rf /tmp/pkg80 && python3 -m pip install --no-build-isolation --no-deps -q --target /tmp/pkg80 \
        -C cmake.define.NVFP4KV_CUDA_ARCHS=80-virtual \
        -C build-dir=/tmp/build-ptx80 . > "$OUT/build_ptx80.log" 2>&1 || { tail -20 "$OUT/build_ptx80.log"; continue; }
      (cd /tmp && PYTHONPATH=/tmp/pkg80 python3 -c "import nvfp4kv; i = nvfp4kv.build_info(); print(nvfp4kv.__file__, i.get('cuda_archs'))")
      PYTHONPATH=/tmp/pkg80 CUDA_CACHE_MAXSIZE=4294967296 python3 -m pytest -q -p no:cacheprovider \
        ${SM80_TESTS:-tests/python} 2>&1 | tee "$OUT/sm80.log" | tail -25 ;;
    host)
      log "small calls through each torch import path"
      (cd /tmp && python3 "$OLDPWD/tools/host_overhead.py") 2>&1 | tee "$OUT/host.txt" ;;
    bench)
      log bench
      python3 benchmarks/bench_store.py ${BENCH_ARGS:-} --json "$OUT/bench.json" 2>&1 | tee "$OUT/bench.txt" | tail -40 ;;
    decode)
      log decode
      python3 benchmarks/bench_decode.py ${DECODE_ARGS:-} --json "$OUT/decode.json" 2>&1 | tee "$OUT/decode.txt" | tail -40 ;;
    ceilings)
      # The decode reader's two ceilings at each geometry (tools/decode_hooks.py): without its
      # arithmetic (memory-only) and without its page traffic (compute-only), timed against the
      # installed build round after round (tools/ab_builds.py), all built for sm_90 only.
      # AB_BASE_SRC: a source tree (e.g. an older commit's) built and timed beside them as "base".
      log "decode ceilings: memory-only and compute-only builds"
      for v in MEMONLY COMPUTEONLY; do
        rm -rf "/tmp/src_$v" "/tmp/pkg_$v" && mkdir -p "/tmp/src_$v"
        tar --exclude=./build --exclude=./device-out -cf - . | tar -xf - -C "/tmp/src_$v"
        python3 tools/decode_hooks.py "/tmp/src_$v" > /dev/null
        python3 -m pip install --no-build-isolation --no-deps -q --target "/tmp/pkg_$v" -C build-dir="/tmp/build_$v" \
          -C cmake.define.NVFP4KV_CUDA_ARCHS=90-real -C cmake.define.CMAKE_CUDA_FLAGS=-DNVFP4KV_DECODE_$v \
          "/tmp/src_$v" > "$OUT/build_$v.log" 2>&1 &
      done
      if [ -n "${AB_BASE_SRC:-}" ]; then
        # As an absolute path: pip reads a bare directory name ("ab_base") as a package to fetch.
        base_src=$(cd "$AB_BASE_SRC" && pwd) || exit 1
        rm -rf /tmp/pkg_base
        python3 -m pip install --no-build-isolation --no-deps -q --target /tmp/pkg_base -C build-dir=/tmp/build_base \
          -C cmake.define.NVFP4KV_CUDA_ARCHS=90-real "$base_src" > "$OUT/build_base.log" 2>&1 &
      fi
      wait
      python3 tools/ab_builds.py full=installed ${AB_BASE_SRC:+base=/tmp/pkg_base} memory=/tmp/pkg_MEMONLY compute=/tmp/pkg_COMPUTEONLY \
        --decode "${CEILING_CASES:-16x4096,64x4096,16x32768,64x16384,128x2048,1x131072,4x32768,1x1024g}" 2>&1 \
        | tee "$OUT/ceilings.txt" | tail -12 ;;
    amax)
      log amax
      python3 benchmarks/bench_amax.py ${AMAX_ARGS:-} --json "$OUT/amax.json" 2>&1 | tee "$OUT/amax.txt" | tail -20 ;;
  esac
done
log done
