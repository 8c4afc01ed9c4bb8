#!/usr/bin/env bash
# On the lent H200 (after `source .device/b/setup.sh`): run the named steps, append their
# output to $OUT/log.txt and leave benchmark tables in $OUT/*.md. Measured step times on a
# fresh machine (first use of each kernel instance included): kda_tests more than
# 240 s (give it a call of its own; kda_tests_par runs it as 4 processes: 109 s), mxfp4_tests 170-263 s, model_cuda 210 s, bench_kda_final
# 186 s, bench_mxfp4 112 s, bench_mxfp4_decode 47 s, mxfp4_mma_tests 80-115 s, bench_streaming
# 149 s; mxfp4_sweep 100-120 s (7-12 shapes, with the probes); kda_state 80-92 s, bench_kda_state
# 114-125 s, bench_kda_prefill 201 s, profile_kda / profile_kda_stalls 17-18 s, cuda_tests_par 260 s,
# bench_kda_final 232 s, kda_prep_probes 35-133 s, profile_prep 41 s, prep_tests 169 s,
# bench_kda_recurrence 98-109 s (193 s with the fla fp32 rows, as now), prep_variants 18-34 s, kda_fixes 31 s, pre_tests 69 s, mma_layout 6 s,
# profile_mma_stalls 16 s, mxfp4_hints 45 s, mxfp4_ac 139 s, bench_mxfp4 184-208 s (with every row it has now),
# profile_ac_stalls 9 s, profile_prefill_mma 27 s, mxfp4_tests_par 253 s (67 tests; 70 now), mxfp4_lb 45 s,
# mxfp4_new_tests 146 s, model_cuda 260 s, mxfp4_lb_down 33 s, mxfp4_fused 71-74 s, fused_tests 85 s,
# mxfp4_tests_par 317 s (89 tests), bulk_smoke 12 s, mxfp4_bulk 52 s, mxfp4_tiled 94 s, mxfp4_tiled_bulk 99 s,
# fused_tests_par 158 s (35 tests), mxfp4_prmt 90 s, mxfp4_tests_par 303 s (106 tests),
# bench_mxfp4 130 s, bench_e2e 155 s, cuda_tests_par 137 s, bench_mxfp4_decode 137 s (three
# interleaved rounds), profile_mma_stalls 9 s, mxfp4_waves 203 s, mxfp4_gate_rows 79 s, gpu_time 51 s,
# gate_rows_ncu 82 s, bench_mxfp4_decode 172 s (chain timing), mxfp4_occupancy 250 s, mlx_graphs 100 s,
# read_limit 190 s (before its 512-threads-per-SM rows; 164 s with them, session 24), stream_tests 115-120 s,
# stream_bench 250 s, read_limit_inflight 81 s, stream_stalls 192 s (its first 12 launches),
# mxfp4_gate_up 85 s (session 25; run as mxfp4_layout 68-132 s), mxfp4_gate_up_chain 24 s, mxfp4_mma_tests 190 s, mxfp4_fused_params 64 s, mxfp4_one 245-285 s, mxfp4_tiled_mma 181 s,
# read_limit 200 s with its ncu pass, bench_e2e more than 200 s (cut off by the session's device time), tiled_runs 73-103 s,
# tiled_store 365 s (its tests 295 s), bench_e2e 138-295 s, decode_split 69-83 s, issue5_decode 56 s, issue5_tests 422 s,
# issue5_prefill 198 + 68 s (two processes, the first building every kernel), prefill_scales 159 + 82 s after its tests
# (more than 150 s; the tiled prefill's 6 alone: 55 s in three processes). A fresh machine's first call costs about 90 s
# of device time before the command runs.
#   bash benchmarks/h200.sh kda_tests mxfp4_tests bench_kda bench_mxfp4 bench_e2e
set -u
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
log="$OUT/log.txt"
# Run from a copy of tests/ and benchmarks/ so the installed package (with kimi_k3.kernels and
# kimi_k3.convert at their package-dir places) is imported, not the source folder kimi_k3/.
# One copy per invocation: two invocations at once must not delete each other's.
SRC=$(pwd)
RUN=/tmp/kimi_k3_run.$$
rm -rf "$RUN" && mkdir -p "$RUN" && cp -r tests benchmarks "$RUN"/ && cd "$RUN" || exit 1
python3 -c "import kimi_k3.kernels, kimi_k3.convert" || exit 1
run() {
  local name=$1 limit=$2
  shift 2
  echo "=== $name: $*" | tee -a "$log"
  local t0=$(date +%s)
  timeout "$limit" "$@" >>"$log" 2>&1
  echo "=== $name: rc=$? in $(( $(date +%s) - t0 ))s" | tee -a "$log"
}
# ncu_times NAME LIMIT CMD...: CMD under Nsight Compute, each kernel's duration alone
# (serialized; --cache-control none: L2 as the kernel before left it), then the median per
# kernel (benchmarks/gpu_time.py --summarize).
ncu_times() {
  local name=$1 limit=$2
  shift 2
  run "$name" "$limit" ncu --cache-control none --clock-control none --metrics \
    gpu__time_duration.sum --csv --log-file "$OUT/$name.csv" "$@"
  python3 -m benchmarks.gpu_time --summarize "$OUT/$name.csv" 2>&1 | tee -a "$log"
}
# prefill_runs NAME LIMIT: bench_mxfp4's prefill table (one K3 layer, 512 and 4096 tokens, three
# interleaved rounds) in two processes, written to $OUT/NAME_1.md and NAME_2.md
prefill_runs() {
  for r in 1 2; do
    run "$1_$r" "$2" python3 -m benchmarks.bench_mxfp4 --decode-tokens 1 --no-lut --rounds 3 --out "$OUT/$1_$r.md"
  done
}
# tiled_runs: the one launch on tiles against it on MLX's layout and the three launches, at
# one token, in three processes of five rounds each (chain_length's slopes)
tiled_runs() {
  for r in 1 2 3; do
    MLX_ENABLE_TF32=0 run "tiled_runs_$r" 200 python3 -m benchmarks.chain_length --tokens 1 --read-limit --tiled --rounds 5 \
      --only "mxfp4_mma (three launches)" "mxfp4_one (one launch, counters in its output (one fill))" \
      "mxfp4_mma (three launches) on the tiled layout" "mxfp4_one (counters in its output) on the tiled layout" \
      "read limit, one launch" --out "$OUT/tiled_runs.md"
  done
}
for step in "$@"; do
  case $step in
    kda_tests) MLX_ENABLE_TF32=0 run kda_tests 580 python3 -m pytest -q -x tests/cuda/test_kda_cuda.py ;;
    mxfp4_tests) MLX_ENABLE_TF32=0 run mxfp4_tests 400 python3 -m pytest -q -x tests/cuda/test_mxfp4_cuda.py ;;
    mxfp4_tests_par) run mxfp4_tests_par 560 bash benchmarks/pytest_split.sh 4 tests/cuda/test_mxfp4_cuda.py ;;
    model_tests) MLX_ENABLE_TF32=0 run model_tests 300 python3 -m pytest -q tests/cuda/test_model_cuda.py tests/test_model.py ;;
    kda_tests_par) run kda_tests_par 560 bash benchmarks/pytest_split.sh 4 tests/cuda/test_kda_cuda.py ;;
    cuda_tests_par)
      # the KDA, whole-model and async-copy CUDA test modules at once (their time is mostly
      # CPU references); the MXFP4 module (104 tests) no longer fits beside them in one
      # 600 s call (2026-12-02: it and the model module ran out of time): mxfp4_tests_par
      run kda_tests_par 400 bash benchmarks/pytest_split.sh 3 tests/cuda/test_kda_cuda.py &
      MLX_ENABLE_TF32=0 run model_cuda 450 python3 -m pytest -q tests/cuda/test_model_cuda.py &
      run async_copy 120 python3 -m pytest -q tests/cuda/test_async_copy_cuda.py &
      wait ;;
    mxfp4_model_par)
      # the MXFP4 and whole-model CUDA test modules at once (for a change that leaves KDA alone)
      MLX_ENABLE_TF32=0 run mxfp4_tests 300 python3 -m pytest -q tests/cuda/test_mxfp4_cuda.py &
      MLX_ENABLE_TF32=0 run model_cuda 300 python3 -m pytest -q tests/cuda/test_model_cuda.py &
      wait ;;
    mxfp4_mma_tests) MLX_ENABLE_TF32=0 run mxfp4_mma_tests 300 python3 -m pytest -q tests/cuda/test_mxfp4_cuda.py -k "mma or agree or k3_layer" ;;
    kda_state) MLX_ENABLE_TF32=0 run kda_state 300 python3 -m pytest -q tests/cuda/test_kda_cuda.py -k "state_pass" ;;
    bench_kda_prefill) run bench_kda_prefill 300 python3 -m benchmarks.bench_kda --no-decode --skip-slow --repeats 10 --out "$OUT/bench_kda_prefill.md" ;;
    bench_kda_state) run bench_kda_state 200 python3 -m benchmarks.bench_kda --no-decode --skip-slow --repeats 10 --cases "state pass" "fla chunk_kda (Triton, bf16" --out "$OUT/bench_kda_state.md" ;;
    async_copy) run async_copy 120 python3 -m pytest -q tests/cuda/test_async_copy_cuda.py ;;
    mma_layout) MLX_ENABLE_TF32=0 run mma_layout 120 python3 -m pytest -q tests/cuda/test_kda_cuda.py -k "mma_tf32_layout" ;;
    profile_prep)
      # ncu on kda_chunk_prep and the kernel before its async copies at T = 8192, one launch each
      for k in "kda_chunk_prep_9" "kda_chunk_prep_var_before"; do
        run profile_prep 150 ncu --clock-control none --section SpeedOfLight --section MemoryWorkloadAnalysis \
          --section MemoryWorkloadAnalysis_Tables --section WarpStateStats --section SchedulerStats \
          --section Occupancy --section InstructionStats \
          --metrics "regex:smsp__average_warps_issue_stalled_.*_per_issue_active\.ratio" -k "regex:$k" -c 1 \
          python3 -m benchmarks.kda_prep_probes --lengths 8192 --repeats 1 \
          --only kda_chunk_prep "variant: before async copy"
      done ;;
    prep_variants) MLX_ENABLE_TF32=0 run prep_variants 200 python3 -m pytest -q tests/cuda/test_kda_cuda.py tests/cuda/test_async_copy_cuda.py -k "prep_variants or post_variant or rotate" ;;
    pre_tests) MLX_ENABLE_TF32=0 run pre_tests 200 python3 -m pytest -q tests/cuda/test_kda_cuda.py -k "(test_prefill and (1000 or 65) and not 96) or mix_uses or state_pass_k3" ;;
    prep_tests) MLX_ENABLE_TF32=0 run prep_tests 200 python3 -m pytest -q tests/cuda/test_kda_cuda.py -k "test_prefill and 1000" ;;
    bench_kda_recurrence) run bench_kda_recurrence 250 python3 -m benchmarks.bench_kda --no-decode --skip-slow --repeats 10 --cases "ours: chunk" "whole mixer" "alone: kda_pre" "alone: kda_chunk_prep" "state pass (mma)" "state pass (mma, tf32" "alone: kda_post" "fla chunk_kda" --out "$OUT/bench_kda_recurrence.md" ;;
    kda_fixes) run kda_fixes 200 python3 -m benchmarks.kda_prep_probes --out "$OUT/kda_fixes.md" --only kda_chunk_prep "variant: before async copy" kda_pre "kda_pre before (loads in their token)" kda_post "kda_post before (gate loaded per column)" ;;
    kda_prep_probes) run kda_prep_probes 200 python3 -m benchmarks.kda_prep_probes --out "$OUT/kda_prep_probes.md" ;;
    kda_tests_quick) MLX_ENABLE_TF32=0 run kda_tests_quick 120 python3 -m pytest -q tests/cuda/test_kda_cuda.py -k "decode or state_pass or uses_the_cuda" ;;
    mxfp4_tests_quick) MLX_ENABLE_TF32=0 run mxfp4_tests_quick 150 python3 -m pytest -q tests/cuda/test_mxfp4_cuda.py -k "k3_layer or dispatcher or slots or agree" ;;
    model_cuda) MLX_ENABLE_TF32=0 run model_cuda 300 python3 -m pytest -q tests/cuda/test_model_cuda.py ;;
    bench_kda_final) run bench_kda 320 python3 -m benchmarks.bench_kda --skip-slow --repeats 10 --out "$OUT/bench_kda.md" ;;
    bench_kda) run bench_kda 300 python3 -m benchmarks.bench_kda --out "$OUT/bench_kda.md" ;;
    bench_mxfp4) run bench_mxfp4 500 python3 -m benchmarks.bench_mxfp4 --out "$OUT/bench_mxfp4.md" ;;
    bench_mxfp4_decode) run bench_mxfp4_decode 400 python3 -m benchmarks.bench_mxfp4 --skip-prefill --out "$OUT/bench_mxfp4_decode.md" ;;
    bench_e2e) run bench_e2e 400 python3 benchmarks/bench_e2e.py --preset k3-layers --set vocab_size=32768 --set intermediate_size=4096 --prompt-tokens 512 --decode-tokens 16 --dtypes bfloat16 --expert-cache-gb 0.6 --out "$OUT/bench_e2e_h200.md" ;;
    decode_split)
      # a decode step's build (Python) against its eval wait, this project and mlx-lm on
      # bench_e2e's checkpoint, with the builds' profile; then, where the working tree has
      # an old/ (an older commit's tree: mkdir old && git archive <commit> | tar -x -C old), that tree's
      # model on the same checkpoint (laid out as installed, first on PYTHONPATH)
      run decode_split 300 python3 -m benchmarks.decode_split --preset k3-layers --set vocab_size=32768 --set intermediate_size=4096 --checkpoint /tmp/e2e_ckpt --profile 40 --out "$OUT/decode_split.md"
      if [ -d "$SRC/old/kimi_k3" ]; then
        rm -rf /tmp/old_site && mkdir -p /tmp/old_site && cp -r "$SRC/old/kimi_k3" /tmp/old_site/ \
          && cp -r "$SRC/old/kernels" /tmp/old_site/kimi_k3/kernels && cp -r "$SRC/old/convert" /tmp/old_site/kimi_k3/convert
        PYTHONPATH=/tmp/old_site:/tmp/site run decode_split_old 200 python3 -m benchmarks.decode_split --checkpoint /tmp/e2e_ckpt --no-mlx-lm --profile 40 --out "$OUT/decode_split.md"
      fi ;;
    chain_length)
      # a decode call's time against the length of its chain (benchmarks/chain_length.py):
      # slope (one more call) and intercept (one evaluation), at 1, 2 and 8 tokens; fp32
      # matmuls without TF32 for the check against gather_qmm in fp32
      for n in 1 2 8; do
        MLX_ENABLE_TF32=0 run "chain_length_$n" 300 python3 -m benchmarks.chain_length --tokens $n --read-limit --tiled --rounds 5 --out "$OUT/chain_length.md"
      done ;;
    one_dispatch)
      # the decode dispatch by pair count (dispatch.expert_decode_choice): mxfp4_one's CUDA
      # tests and the dispatcher's at K3 size, then chains at 1 and 4 tokens (16 and 64
      # pairs), with both launches on the tiled layout
      MLX_ENABLE_TF32=0 run one_dispatch_tests 300 python3 -m pytest -q -x tests/cuda/test_mxfp4_cuda.py -k "one_launch or dispatched_decode"
      for n in 1 4; do
        MLX_ENABLE_TF32=0 run "chain_length_$n" 200 python3 -m benchmarks.chain_length --tokens $n --read-limit --tiled --out "$OUT/chain_length.md"
      done ;;
    tiled_runs)
      # the function above (is the one launch's 60% of session 29's run 5 steady?)
      tiled_runs ;;
    one_sweep)
      # mxfp4_one on tiles at launch settings other than mxfp4_mma's (benchmarks/one_sweep.py:
      # rt,sk,gw1,gw2,pp,bound,cs1,cs2[,early]), chains, one token; d5ade91 also had the steps
      # one_sweep2 and one_ring for two probes since gone (packed scale words, a ring)
      MLX_ENABLE_TF32=0 run one_sweep 560 python3 -m benchmarks.one_sweep --read-limit --rounds 5 --out "$OUT/one_sweep.md" --settings \
        8,1,8,8,1,2,1,0 8,1,8,8,1,2,1,1 8,1,8,8,1,2,0,0 4,1,8,8,1,4,1,0 4,1,8,8,1,3,1,0 \
        8,1,8,8,0,2,1,0 8,1,8,8,0,3,1,0 4,2,8,8,1,2,1,0 16,1,8,8,1,1,1,0 8,1,8,4,1,2,1,0 2,1,8,8,1,8,1,0 \
        8,1,8,8,1,2,1,0,1 ;;
    one_persist)
      # (prepared in session 31, not yet run) one_sweep's persistent grid: 264 threadgroups
      # (two per SM of the H200's 132), 132, 396, each taking its next ticket while it works,
      # and at 264 with its staging kept for the next ticket of the same token, beside the
      # dispatched grid (one threadgroup per ticket); two processes of seven rounds
      for r in 1 2; do
        MLX_ENABLE_TF32=0 run "one_persist_$r" 280 python3 -m benchmarks.one_sweep --rounds 7 --out "$OUT/one_persist.md" --settings \
          8,1,8,8,1,2,1,0,0,264 8,1,8,8,1,2,1,0,0,264,1 8,1,8,8,1,2,1,0,0,132 8,1,8,8,1,2,1,0,0,396 8,1,8,8,1,2,1,1,0,264
      done ;;
    issue5_tests)
      # (prepared in session 32, not yet run) every CUDA test of the MXFP4 module (split over
      # three processes: its time is mostly CPU references) and the model module beside it:
      # the dispatched one launch since its pair count became a parameter (c6ecdd3) and the
      # persistent grids KIMI_K3_ONE_GRID dispatches were not yet run on CUDA
      run issue5_mxfp4_tests 560 bash benchmarks/pytest_split.sh 3 tests/cuda/test_mxfp4_cuda.py &
      MLX_ENABLE_TF32=0 run issue5_model_tests 560 python3 -m pytest -q tests/cuda/test_model_cuda.py &
      wait ;;
    prefill_scales)
      # session 34: the tiled prefill's scale loads (mxfp4_prefill_mma.SCALES): their CUDA
      # tests at K3 size, then issue5_prefill's two processes with a row for each
      run prefill_scales_tests 200 bash benchmarks/pytest_split.sh 3 tests/cuda/test_mxfp4_cuda.py -k "prefill_mma_tiled or dispatched_on_tiled"
      prefill_runs prefill_scales 200 ;;
    issue5_decode)
      # (prepared in session 32) issue 5's decode table in one run: gather_qmm, the dispatched
      # one launch on tiles and the read limit, beside the persistent grids (264: two
      # threadgroups per SM of the H200's 132; the same with the staging kept; 608, a
      # threadgroup per ticket at one token, which isolates the loop's cost from the grid's),
      # three processes
      for r in 1 2 3; do
        MLX_ENABLE_TF32=0 run "issue5_decode_$r" 190 python3 -m benchmarks.one_sweep --gather-qmm --read-limit --rounds 5 --out "$OUT/issue5_decode.md" --settings \
          8,1,8,8,1,2,1,0,0,264 8,1,8,8,1,2,1,0,0,264,1 8,1,8,8,1,2,1,0,0,608
      done ;;
    issue5_prefill)
      # issue 5's prefill table: one K3 MoE layer (896 experts) at 512 and 4096 tokens,
      # gather_qmm beside the tensor-core GEMM on MLX's layout and on tiles, in interleaved
      # rounds (session 34), two processes
      prefill_runs issue5_prefill 280 ;;
    scale_words)
      # session 31: the store's tiles with a scale word per lane and step: every CUDA test that
      # reads tiles (decode, one launch, prefill, fused on its own layout, the model), then
      # tiled_runs' three processes
      MLX_ENABLE_TF32=0 run scale_words_tests 330 python3 -m pytest -q tests/cuda/test_model_cuda.py tests/cuda/test_mxfp4_cuda.py -k "tiled or dispatched"
      tiled_runs ;;
    tiled_store)
      # the expert store on tiles (kernels/expert_layout.py): its CUDA tests (the tiled prefill
      # and dispatch at K3 size, the model resident and streamed), then the prefill on tiles
      # beside MLX's layout and gather_qmm (bench_mxfp4, 896 experts, 512 and 4096 tokens)
      MLX_ENABLE_TF32=0 run tiled_store_tests 300 python3 -m pytest -q tests/cuda/test_model_cuda.py tests/cuda/test_mxfp4_cuda.py -k "tiled or dispatched"
      run tiled_prefill 250 python3 -m benchmarks.bench_mxfp4 --decode-tokens 1 --no-lut --out "$OUT/tiled_prefill.md" ;;
    bench_e2e_cpu) run bench_e2e_cpu 300 python3 benchmarks/bench_e2e.py --preset small --device cpu --repeats 3 --out "$OUT/bench_e2e_cpu.md" ;;
    bench_streaming) run bench_streaming 400 python3 -m benchmarks.bench_streaming --quick --out "$OUT/bench_streaming_h200.md" ;;
    ptxas) run ptxas 200 python3 -m benchmarks.profile_kernels --ptxas ;;
    profile) run profile 300 ncu --metrics gpu__time_duration.sum,dram__bytes.sum,launch__registers_per_thread,sm__warps_active.avg.pct_of_peak_sustained_active python3 -m benchmarks.profile_kernels ;;
    profile_full) run profile_full 300 ncu --section SpeedOfLight --section MemoryWorkloadAnalysis --section WarpStateStats --section Occupancy --section LaunchStats --section SchedulerStats -k "regex:kda_|mxfp4_gate|mxfp4_down|mxfp4_sum" python3 -m benchmarks.profile_kernels --rounds 1 ;;
    profile_mma) run profile_mma 300 ncu --section SpeedOfLight --section MemoryWorkloadAnalysis --section MemoryWorkloadAnalysis_Tables --section WarpStateStats --section Occupancy --section LaunchStats --section SchedulerStats -k "regex:mxfp4_mma|mxfp4_gate|mxfp4_down" python3 -m benchmarks.profile_kernels --rounds 1 --only mxfp4_decode,mxfp4_mma ;;
    profile_kda) run profile_kda 300 ncu --clock-control none --section SpeedOfLight --section ComputeWorkloadAnalysis --section InstructionStats --section WarpStateStats --section Occupancy --section LaunchStats --section SchedulerStats --section MemoryWorkloadAnalysis -k "regex:kda_chunk" python3 -m benchmarks.profile_kernels --rounds 1 --only kda_prefill ;;
    profile_kda_stalls) run profile_kda_stalls 300 ncu --clock-control none --metrics "gpu__time_duration.sum,smsp__inst_executed.sum,launch__registers_per_thread,regex:smsp__average_warps_issue_stalled_.*_per_issue_active\.ratio" -k "regex:kda_chunk" python3 -m benchmarks.profile_kernels --rounds 1 --only kda_prefill ;;
    profile_mma2) run profile_mma2 300 ncu --clock-control none --section SpeedOfLight --section ComputeWorkloadAnalysis --section InstructionStats --section WarpStateStats --section Occupancy --section LaunchStats --section SchedulerStats --section MemoryWorkloadAnalysis -k "regex:mxfp4_mma" python3 -m benchmarks.profile_kernels --rounds 1 --only mxfp4_mma ;;
    kda_decode_diag) run kda_decode_diag 200 python3 -m benchmarks.kda_decode_diag ;;
    bench_mxfp4_variants) run bench_mxfp4_variants 300 python3 -m benchmarks.bench_mxfp4 --variants --skip-prefill --decode-tokens 1 4 --out "$OUT/bench_mxfp4_variants.md" ;;
    mxfp4_sweep) run mxfp4_sweep 300 python3 -m benchmarks.mxfp4_sweep --probe ;;
    mxfp4_hints) run mxfp4_hints 200 python3 -m benchmarks.mxfp4_sweep --probe --hints --shapes 8,1,8,1 ;;
    mxfp4_ac) run mxfp4_ac 300 python3 -m benchmarks.mxfp4_sweep --hints --shapes 8,1,8,1 --ac-shapes 2,1,8,2 2,1,8,3 1,1,8,3 1,1,8,4 1,1,8,5 4,1,4,2 4,1,4,3 2,1,4,4 1,2,8,3 ;;
    profile_prefill_mma) run profile_prefill_mma 200 ncu --clock-control none --metrics "gpu__time_duration.sum,smsp__inst_executed.sum,launch__registers_per_thread,dram__throughput.avg.pct_of_peak_sustained_elapsed,smsp__warps_active.avg.per_cycle_active,smsp__issue_active.avg.pct_of_peak_sustained_active,sm__pipe_tensor_cycles_active.avg.pct_of_peak_sustained_active,regex:smsp__average_warps_issue_stalled_.*_per_issue_active\.ratio" -k "regex:mxfp4_grouped|mxfp4_bfrag" python3 -m benchmarks.profile_kernels --rounds 1 --only mxfp4_prefill,mxfp4_prefill_mma ;;
    profile_ac_stalls) run profile_ac_stalls 200 ncu --clock-control none --metrics "gpu__time_duration.sum,smsp__inst_executed.sum,launch__registers_per_thread,dram__throughput.avg.pct_of_peak_sustained_elapsed,smsp__warps_active.avg.per_cycle_active,smsp__issue_active.avg.pct_of_peak_sustained_active,regex:smsp__average_warps_issue_stalled_.*_per_issue_active\.ratio" -k "regex:mxfp4_mma_ac" python3 -m benchmarks.profile_kernels --rounds 1 --only mxfp4_mma_ac ;;
    profile_fused) run profile_fused 200 ncu --clock-control none --metrics "gpu__time_duration.sum,smsp__inst_executed.sum,launch__registers_per_thread,dram__throughput.avg.pct_of_peak_sustained_elapsed,smsp__warps_active.avg.per_cycle_active,smsp__issue_active.avg.pct_of_peak_sustained_active,regex:smsp__average_warps_issue_stalled_.*_per_issue_active\.ratio" -k "regex:mxfp4_fused|mxfp4_mma" -c 12 python3 -m benchmarks.mxfp4_fused_sweep --tokens 1 --launches 256,8,8,8 --min-blocks 2 --bulk-launches --rounds 1 --repeats 1 --calls 2 ;;
    profile_mma_stalls) run profile_mma_stalls 200 ncu --clock-control none --metrics "gpu__time_duration.sum,smsp__inst_executed.sum,launch__registers_per_thread,dram__throughput.avg.pct_of_peak_sustained_elapsed,smsp__warps_active.avg.per_cycle_active,smsp__issue_active.avg.pct_of_peak_sustained_active,sm__cycles_active.avg.pct_of_peak_sustained_elapsed,gpc__cycles_elapsed.avg.per_second,regex:smsp__average_warps_issue_stalled_.*_per_issue_active\.ratio" -k "regex:mxfp4_mma" python3 -m benchmarks.profile_kernels --rounds 1 --only mxfp4_mma ;;
    mxfp4_fused) run mxfp4_fused 300 python3 -m benchmarks.mxfp4_fused_sweep --tokens 1 8 --min-blocks 1 2 --decodes shift "byte permute" --timing batch --rounds 3 ;;
    mxfp4_fused_params)
      # the fused kernel with its unit ends' parameters staged (session 26) as chains beside
      # the dispatched decode, at five launches and two bounds, and as it was before
      run mxfp4_fused_params 400 python3 -m benchmarks.mxfp4_fused_sweep --tokens 1 2 8 --launches 256,8,8,8 128,4,8,4 384,8,8,4 512,8,8,8 256,4,8,8 --min-blocks 2 1 --bulk-launches --params-at-end --rounds 3 ;;
    bulk_smoke) run bulk_smoke 90 python3 -c "
import mlx.core as mx
from benchmarks.bench_mxfp4 import random_experts, routing, rel_err
from kimi_k3.kernels import mxfp4_fused, mxfp4_mma
import numpy as np
w = random_experts(64, 3584, 3072, 0)
inds, wts = routing(1, 64, 16, np.random.default_rng(0))
z = mx.random.normal((1, 3584)).astype(mx.bfloat16)
a = (z, w, inds, wts, 4.0, 25.0)
ref = mxfp4_mma.expert_glu_decode(*a)
got = mxfp4_fused.expert_glu_decode_bulk(*a)
mx.eval(ref, got)
print('bulk vs mma rel diff', rel_err(got, ref))
" ;;
    mxfp4_bulk) run mxfp4_bulk 300 python3 -m benchmarks.mxfp4_fused_sweep --tokens 1 8 --launches 256,8,8,8 --min-blocks 2 --rounds 3 ;;
    mxfp4_tiled) run mxfp4_tiled 300 python3 -m benchmarks.mxfp4_fused_sweep --tokens 1 8 --launches 256,8,8,8 384,8,8,4 128,4,8,4 --min-blocks 1 2 --bulk-launches --tiled --rounds 3 ;;
    mxfp4_tiled_bulk) run mxfp4_tiled_bulk 300 python3 -m benchmarks.mxfp4_fused_sweep --tokens 1 8 --launches 256,8,8,8 --min-blocks 2 --bulk-launches 128,2,6 128,4,3 128,1,12 128,2,4 --tiled --rounds 3 ;;
    fused_tests_par) run fused_tests_par 400 bash benchmarks/pytest_split.sh 3 tests/cuda/test_mxfp4_cuda.py -k "fused or bulk or tiled or agree" ;;
    bulk_tests) MLX_ENABLE_TF32=0 run bulk_tests 300 python3 -m pytest -q -x tests/cuda/test_mxfp4_cuda.py -k "bulk" ;;
    fused_tests) MLX_ENABLE_TF32=0 run fused_tests 300 python3 -m pytest -q tests/cuda/test_mxfp4_cuda.py -k "fused" ;;
    mxfp4_prmt)
      # shift against byte-permute decode in mxfp4_mma, without and with 2 threadgroups per SM
      MLX_ENABLE_TF32=0 run prmt_tests 200 python3 -m pytest -q tests/cuda/test_mxfp4_cuda.py -k "byte_permute"
      for n in 1 8; do
        run mxfp4_prmt 200 python3 -m benchmarks.mxfp4_sweep --tokens $n --shapes 8,1,8,1 --min-blocks 2 --prmt --rounds 5
      done ;;
    mxfp4_waves)
      # gate/up's grid (384 threadgroups, 264 fit at two per SM: 1.45 waves) against the same
      # rows split over two warps each (768: 2.9 waves), and 11 pairs (264: one wave)
      run waves_gu 200 python3 -m benchmarks.mxfp4_sweep --projections gate_up --shapes 8,1,8,1 4,2,8,1 --min-blocks 2 --prmt --rounds 4
      run waves_k11 150 python3 -m benchmarks.mxfp4_sweep --projections gate_up --topk 11 --shapes 8,1,8,1 --min-blocks 2 --prmt --rounds 3
      MLX_ENABLE_TF32=0 run shape_tests 200 python3 -m pytest -q tests/cuda/test_mxfp4_cuda.py -k "mma_launch_shapes"
      run bench_variants 300 python3 -m benchmarks.bench_mxfp4 --variants --skip-prefill --decode-tokens 1 8 --out "$OUT/bench_mxfp4_variants.md" ;;
    mxfp4_gate_rows)
      # gate/up streams 2.3-2.66 TB/s, down 2.8-2.96 with the same body: the gate matrix read
      # as down is read, and gate/up without its streaming (CS) loads
      run gate_rows 200 python3 -m benchmarks.mxfp4_sweep --projections gate_up down gate_rows --shapes 8,1,8,1 --min-blocks 2 --prmt --hints --rounds 4 ;;
    gpu_time)
      # a decode call's wall time split into building the graph and evaluating it, then each
      # kernel's own GPU time (ncu, serialized, L2 as left by the kernel before)
      run gpu_time 200 python3 -m benchmarks.gpu_time
      ncu_times gpu_time_ncu 250 python3 -m benchmarks.gpu_time --calls 10 --rounds 1 --repeats 1 ;;
    gate_rows_ncu)
      # the mxfp4_gate_rows and mxfp4_waves sweeps' kernels, GPU time alone
      ncu_times gate_rows_ncu 250 python3 -m benchmarks.mxfp4_sweep --projections gate_up down gate_rows --shapes 8,1,8,1 --min-blocks 2 --prmt --calls 10 --repeats 1
      ncu_times waves_ncu 250 python3 -m benchmarks.mxfp4_sweep --projections gate_up --topk 11 --shapes 8,1,8,1 4,2,8,1 --min-blocks 2 --prmt --calls 10 --repeats 1 ;;
    mxfp4_occupancy)
      # every gate/up threadgroup resident at once (no second wave): 4-group steps without
      # double buffering at 3 per SM (384 of 396 slots), 128-thread threadgroups at 6 per SM
      # (768 of 792); their CUDA tests, GPU time alone (ncu), then as a chain beside the
      # one-launch mxfp4_fused decodes (two launches a call, not three)
      MLX_ENABLE_TF32=0 run occ_tests 200 python3 -m pytest -q tests/cuda/test_mxfp4_cuda.py -k "occupancy"
      ncu_times occ_ncu 300 python3 -m benchmarks.mxfp4_sweep --projections gate_up down --shapes 8,1,8,1 8,1,4,0 8,1,8,0 4,1,8,0 --min-blocks 2 3 6 --prmt --calls 10 --repeats 1
      run occ_chain 300 python3 -m benchmarks.bench_mxfp4 --occupancy --fused --skip-prefill --decode-tokens 1 2 8 --out "$OUT/bench_mxfp4_occupancy.md" ;;
    mxfp4_one)
      # the one-launch decode (kernels/mxfp4_one.py): its registers, its CUDA tests, then as a
      # chain beside the dispatched decode and the read limit, then each kernel under ncu
      run one_regs 120 python3 -c "
from benchmarks.profile_kernels import register_count
from kimi_k3.kernels import mxfp4_one
print('mxfp4_one registers (bf16 latent):', register_count(mxfp4_one.dispatched_kernel(8, 1), mxfp4_one.MXFP4_ONE.instances[:1]))"
      MLX_ENABLE_TF32=0 run one_tests 300 python3 -m pytest -q -x tests/cuda/test_mxfp4_cuda.py -k one_launch
      run one_bench 300 python3 -m benchmarks.bench_mxfp4 --one --read-limit --skip-prefill --decode-tokens 1 2 8 --rounds 5 --out "$OUT/bench_one.md"
      ncu_times one_ncu 200 python3 -m benchmarks.bench_mxfp4 --one --skip-prefill --decode-tokens 1 --calls 5 --rounds 1 --repeats 1 ;;
    mxfp4_tiled_mma)
      # the dispatched kernels on mxfp4_fused.tile_experts' layout (a warp load is 512
      # contiguous bytes; mxfp4_mma.tiled_layout): CUDA tests (same bits), chains, ncu
      MLX_ENABLE_TF32=0 run tiled_mma_tests 200 python3 -m pytest -q -x tests/cuda/test_mxfp4_cuda.py -k tiled_layout_same_bits
      run tiled_mma_bench 300 python3 -m benchmarks.bench_mxfp4 --tiled --skip-prefill --decode-tokens 1 2 8 --rounds 5 --out "$OUT/bench_tiled_mma.md"
      ncu_times tiled_mma_ncu 150 python3 -m benchmarks.bench_mxfp4 --tiled --skip-prefill --decode-tokens 1 --calls 5 --rounds 1 --repeats 1 ;;
    mxfp4_gate_up_chain) run mxfp4_gate_up 200 python3 -m benchmarks.mxfp4_gate_up --rounds 7 ;;
    mxfp4_gate_up)
      # gate/up against its variants (benchmarks/mxfp4_gate_up.py: the epilogue's parameters
      # read at the end, literals, one interleaved stack) and down, as chains; then each
      # kernel under ncu (the decode calls in processes of their own: their kernels share names)
      run mxfp4_gate_up 200 python3 -m benchmarks.mxfp4_gate_up --layouts
      for j in "0 1 2 3 4 5 6" 7 8 9; do
        ncu_times "gate_up_ncu_${j// /}" 100 python3 -m benchmarks.mxfp4_gate_up --layouts --calls 10 --repeats 1 --rounds 1 --only $j
      done ;;
    read_limit)
      # the decode call's weight bytes read and nothing else (benchmarks/read_limit.py): its
      # test on CUDA, then as a chain beside the decode kernels, then each kernel under ncu
      run read_limit_tests 120 python3 -m pytest -q tests/test_read_limit.py
      run read_limit 300 python3 -m benchmarks.bench_mxfp4 --read-limit --skip-prefill --decode-tokens 1 2 8 --out "$OUT/bench_read_limit.md"
      ncu_times read_limit_ncu 300 python3 -m benchmarks.bench_mxfp4 --read-limit --skip-prefill --decode-tokens 1 --calls 5 --rounds 1 --repeats 1 ;;
    stream_tests)
      # the streamed-ring decode (kernels/mxfp4_stream.py): its CUDA tests
      MLX_ENABLE_TF32=0 run stream_tests 250 python3 -m pytest -q -x tests/cuda/test_mxfp4_cuda.py -k stream ;;
    stream_bench)
      # the streamed ring as a chain beside the dispatched decode and the read limit, then
      # each kernel under ncu
      run stream_bench 250 python3 -m benchmarks.bench_mxfp4 --stream --read-limit --skip-prefill --decode-tokens 1 8 --out "$OUT/bench_stream.md"
      ncu_times stream_ncu 130 python3 -m benchmarks.bench_mxfp4 --stream --skip-prefill --decode-tokens 1 --calls 3 --rounds 1 --repeats 1 ;;
    read_limit_inflight)
      # the read limit at 512 threads per SM with 4 to 24 loads in flight a thread, five rounds
      run read_limit_inflight 200 python3 -m benchmarks.bench_mxfp4 --read-limit --skip-prefill --decode-tokens 1 --rounds 5 --out "$OUT/bench_read_limit_inflight.md" ;;
    stream_stalls)
      # ncu of the streamed ring's first 12 launches (the first STREAM_ROWS rows at one token):
      # time, DRAM, issue and stall reasons
      run stream_stalls 400 ncu --clock-control none --metrics "gpu__time_duration.sum,smsp__inst_executed.sum,launch__registers_per_thread,dram__throughput.avg.pct_of_peak_sustained_elapsed,smsp__warps_active.avg.per_cycle_active,smsp__issue_active.avg.pct_of_peak_sustained_active,l1tex__data_pipe_lsu_wavefronts_mem_shared.sum,l1tex__data_bank_conflicts_pipe_lsu_mem_shared.sum,regex:smsp__average_warps_issue_stalled_.*_per_issue_active\.ratio" -k "regex:mxfp4_stream" --launch-count 12 --csv --log-file "$OUT/stream_stalls.csv" python3 -m benchmarks.bench_mxfp4 --stream --skip-prefill --decode-tokens 1 --calls 1 --rounds 1 --repeats 1 ;;
    mlx_graphs)
      # the chain's gaps between dependent launches (about 5 us each) against MLX's CUDA graph
      # settings: as is, up to 100 ops a graph, no graphs
      i=0
      for e in "" "MLX_MAX_OPS_PER_BUFFER=100" "MLX_USE_CUDA_GRAPHS=0"; do
        i=$((i + 1))
        run "mlx_graphs_${e:-as_is}" 200 env ${e:+"$e"} python3 -m benchmarks.bench_mxfp4 --skip-prefill --decode-tokens 1 2 --out "$OUT/bench_graphs_$i.md"
      done ;;
    mxfp4_lb) run mxfp4_lb 250 python3 -m benchmarks.mxfp4_sweep --shapes 8,1,8,1 4,1,8,1 --min-blocks 2 4 --ac-shapes 2,1,8,2 --rounds 3 ;;
    mxfp4_lb_down)
      for n in 1 8; do
        run mxfp4_lb_down 120 python3 -m benchmarks.mxfp4_sweep --projections down --tokens $n --shapes 8,1,8,1 4,1,8,1 --min-blocks 2 4 --rounds 4
      done ;;
    mxfp4_new_tests) MLX_ENABLE_TF32=0 run mxfp4_new_tests 300 python3 -m pytest -q tests/cuda/test_mxfp4_cuda.py -k "launch_bounds or past_65535 or dispatcher or k3_layer or prefill_mma" ;;
    mxfp4_diag) run mxfp4_diag 120 python3 -m benchmarks.mxfp4_diag ;;
    *) echo "unknown step $step" | tee -a "$log" ;;
  esac
done
