#!/usr/bin/env bash
# The GPU steps: run the named steps on a CUDA machine (an H100 or H200) from the project root,
# append their output to $OUT/log.txt (default /tmp/out) and leave the tables in $OUT/*.md.
#   bash benchmarks/h200.sh tests          # the CUDA tests, -m cuda (kda_tests, mxfp4_tests)
#   bash benchmarks/h200.sh mxfp4 kda      # benchmark tables
# The GPU host has Python 3.12 and CUDA 13 but not MLX, mlx-lm, fla-core or the server's stack:
# `bash ../shared/device/prepare-wheels.sh` (run here, once) puts their wheels in parts of at
# most 24 MiB under .device/1 ... .device/N, since a call carries the tracked tree (about
# 23 MB) and at most 64 MiB in all. Calls 1 to N-1 copy their part to /tmp/wa on the
# machine (each within 30 s of the last, while it is warm), and call N runs
#   source .device/N/setup.sh && bash benchmarks/h200.sh STEP...
# which installs the wheels and the project into /tmp/site first.
# Every test and doctor step runs in MLX's default environment (TF32 allowed for fp32
# matmuls on CUDA: what users get); each has a twin, STEP_fp32, with MLX_ENABLE_TF32=0.
# Steps, each under its own time limit (seconds):
#   kda_tests    -m cuda of tests/test_kda_kernels.py (three processes),
#                test_model_kernels.py and test_async_copy.py, side by side          (450)
#   mxfp4_tests  -m cuda of the MXFP4 test modules in four processes                (560)
#   tests        kda_tests, then mxfp4_tests
#   kda          bench_kda: decode and prefill (1024, 8192) against fla              (320)
#   mxfp4        bench_mxfp4: decode at 1 and 8 tokens, prefill at 512 and 4096      (500)
#   e2e          bench_e2e on two K3-width layers, resident and streamed             (400)
#   streaming    bench_streaming, one repetition                                      (500)
#   prefetch     bench_prefetch: prediction off and on, the trained default and a K3-width
#                slice of four MoE layers (written under $OUT, 4.5 GB)                   (550)
#   reads        bench_streaming's reads (against raw at the same depth), the path into
#                MLX, and prefetch on the trained default, three repetitions           (500)
#   ptxas        profile_kernels --ptxas and --sass (registers, spills, loop costs)   (300)
#   profile      profile_kernels under ncu: every dispatched kernel's time and bytes  (300)
#   doctor       python -m kimi_k3.doctor over the CUDA kernels, then --model on a
#                synthetic k3-layers checkpoint (written to /tmp)                      (500)
#   bench_train  bench_train at the preset, eager against compiled, batch $BATCH (32; 128 ran
#                out of the H100's 80 GB)                                               (400)
#   formats      the lower-bit experts (--expert-bits 3, 2): -m cuda of their kernel and
#                model tests, then bench_mxfp4 --formats 3 2 (decode at 1 and 8 tokens,
#                prefill at 512 and 4096) beside MXFP4                                 (500)
#   formats_streaming  bench_streaming's formats section: bytes read a decode token per
#                format at the same cache size, one repetition                         (500)
#   all          every step above, in that order (longer than one 600 s call)
set -u
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
log="$OUT/log.txt"
# Run from a copy of tests/ and benchmarks/ so that the installed package (with
# kimi_k3.kernels and kimi_k3.convert at their package-dir places) is imported, not the
# source folder kimi_k3/. One copy per invocation: two at once must not delete each other's.
RUN=/tmp/kimi_k3_run.$$
rm -rf "$RUN" && mkdir -p "$RUN" && cp -r tests benchmarks "$RUN"/ && cd "$RUN" || exit 1
python3 -c "import kimi_k3.kernels, kimi_k3.convert" || exit 1
run() {
  local name=$1 limit=$2
  shift 2
  echo "=== $name: $*" | tee -a "$log"
  local t0
  t0=$(date +%s)
  timeout "$limit" "$@" >>"$log" 2>&1
  echo "=== $name: rc=$? in $(($(date +%s) - t0))s" | tee -a "$log"
}
steps=()
for s in "$@"; do
  case $s in
    all) steps+=(kda_tests mxfp4_tests kda mxfp4 e2e streaming prefetch ptxas profile doctor formats formats_streaming) ;;
    tests) steps+=(kda_tests mxfp4_tests) ;;
    tests_fp32) steps+=(kda_tests_fp32 mxfp4_tests_fp32) ;;
    *) steps+=("$s") ;;
  esac
done
for step in "${steps[@]}"; do
  case $step in
    kda_tests | kda_tests_fp32)
      ( [ "$step" = kda_tests_fp32 ] && export MLX_ENABLE_TF32=0
        run "$step" 450 bash benchmarks/pytest_split.sh 3 -m cuda tests/test_kda_kernels.py &
        run "model_${step#kda_}" 450 python3 -m pytest -q -m cuda tests/test_model_kernels.py &
        run "async_copy_${step#kda_}" 200 python3 -m pytest -q -m cuda tests/test_async_copy.py &
        wait ) ;;
    mxfp4_tests | mxfp4_tests_fp32)
      ( [ "$step" = mxfp4_tests_fp32 ] && export MLX_ENABLE_TF32=0
        run "$step" 560 bash benchmarks/pytest_split.sh 4 -m cuda tests/test_mxfp4_kernels.py \
          tests/test_mxfp4_one.py tests/test_expert_layout.py tests/test_read_limit.py ) ;;
    kda) run kda 320 python3 -m benchmarks.bench_kda --skip-slow --repeats 10 --out "$OUT/bench_kda.md" ;;
    mxfp4)
      # TF32 off: the decode rows' errors are against gather_qmm in fp32
      MLX_ENABLE_TF32=0 run mxfp4 500 python3 -m benchmarks.bench_mxfp4 --decode-tokens 1 8 --out "$OUT/bench_mxfp4.md" ;;
    e2e)
      run e2e 400 python3 -m benchmarks.bench_e2e --preset k3-layers --set vocab_size=32768 \
        --set intermediate_size=4096 --prompt-tokens 512 --decode-tokens 16 --dtypes bfloat16 \
        --expert-cache-gb 0.6 --out "$OUT/bench_e2e.md" ;;
    reads) run reads 500 python3 -m benchmarks.bench_streaming --sections reads,mlx,trained --reps 3 --tokens 64 --out "$OUT/bench_reads.md" ;;
    streaming) run streaming 500 python3 -m benchmarks.bench_streaming --reps 1 --tokens 32 --out "$OUT/bench_streaming.md" ;;
    prefetch) run prefetch 550 python3 -m benchmarks.bench_prefetch --rounds 3 --slice "$OUT/k3slice" --slice-steps 32 --slice-rounds 3 --out "$OUT/bench_prefetch.md" ;;
    ptxas)
      run ptxas 200 python3 -m benchmarks.profile_kernels --ptxas
      run sass 100 python3 -m benchmarks.profile_kernels --sass ;;
    profile)
      run profile 300 ncu --metrics gpu__time_duration.sum,dram__bytes.sum,launch__registers_per_thread,sm__warps_active.avg.pct_of_peak_sustained_active \
        python3 -m benchmarks.profile_kernels --rounds 1 ;;
    doctor | doctor_fp32)
      ( [ "$step" = doctor_fp32 ] && export MLX_ENABLE_TF32=0
        run "$step" 400 python3 -m kimi_k3.doctor
        [ -d /tmp/k3-layers ] || python3 -m kimi_k3.convert synth /tmp/k3-layers --preset k3-layers >>"$log" 2>&1
        run "${step}_model" 100 python3 -m kimi_k3.doctor --small --model /tmp/k3-layers ) ;;
    bench_train)
      run bench_train 400 python3 -m benchmarks.bench_train --batch "${BATCH:-32}" --rounds 5 \
        --peak-tflops 67 --out "$OUT/bench_train.md" ;;
    formats)
      run formats_tests 200 python3 -m pytest -q -m cuda tests/test_affine_kernels.py \
        tests/test_model_kernels.py -k "test_affine_kernels or lower_bit"
      # TF32 off: the decode rows' errors are against gather_qmm in fp32
      MLX_ENABLE_TF32=0 run formats_bench 300 python3 -m benchmarks.bench_mxfp4 --formats 3 2 \
        --decode-tokens 1 8 --out "$OUT/bench_formats.md" ;;
    formats_streaming)
      run formats_streaming 500 python3 -m benchmarks.bench_streaming --sections formats --reps 1 \
        --tokens 32 --work "$OUT/bs" --out "$OUT/bench_streaming_formats.md" ;;
    *) echo "unknown step $step" | tee -a "$log" ;;
  esac
done
