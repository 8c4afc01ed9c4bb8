#!/usr/bin/env bash
# Train the default model on a lent GPU machine (docs/training.md), in calls of at most
# 10 minutes that each carry at most 64 MiB beside the tracked tree (the device tool's
# limits). The corpus is read, the tokenizer trained and the token streams written here,
# on the CPU (`train.prepare`); the GPU machine gets them in parts and only trains.
#
#   here:  bash benchmarks/gpu_train.sh pack OUT DEST      # OUT prepared; DEST/a, b, c ...
#   there: bash benchmarks/gpu_train.sh unpack SRC OUT     # SRC: the parts, copied to one dir
#   there: bash benchmarks/gpu_train.sh segment OUT MINUTES SEGMENT [train run flags...]
#   there: bash benchmarks/gpu_train.sh export OUT CKPT RESULTS   # checkpoint + log, in parts
#   here:  bash benchmarks/gpu_train.sh join RESULTS CKPT          # the checkpoint again
#
# `segment` starts the run in OUT, or resumes it (`--resume`) when OUT holds its state; every
# segment takes the same MINUTES (the run's training time, over which the learning rate
# decays) and stops after SEGMENT minutes with the state saved. Parts are at most PART_MB
# (default 15) MB, under the 16 MiB a file that comes back from the machine may hold.
set -euo pipefail
PART_MB=${PART_MB:-15}

split_into() {  # split_into FILE DIR: FILE in parts DIR/NAME.part-aa, -ab, ...
  mkdir -p "$2"
  split -b "${PART_MB}M" "$1" "$2/$(basename "$1").part-"
}

case ${1:-} in
  pack)
    out=$2 dest=$3
    rm -rf "$dest" && mkdir -p "$dest/parts"
    split_into "$out/train_ids.npy" "$dest/parts"
    # the small files: tokenizer, held-out ids and texts, licenses, the corpus record
    tar -C "$out" -cf "$dest/parts/small.tar" tokenizer heldout_ids.npy heldout-stdlib.json \
      licenses corpus.json $(cd "$out" && ls heldout-*.txt 2>/dev/null)
    # one folder per call, each under PART_MB MB
    i=0
    for f in "$dest"/parts/*; do
      sub=$(printf '%b' "\\$(printf '%03o' $((97 + i)))")
      mkdir -p "$dest/$sub" && mv "$f" "$dest/$sub/"
      i=$((i + 1))
    done
    rmdir "$dest/parts"
    du -sh "$dest"/* ;;
  unpack)
    src=$2 out=$3
    mkdir -p "$out"
    cat "$src"/train_ids.npy.part-* > "$out/train_ids.npy"
    tar -C "$out" -xf "$src/small.tar"
    python3 -c "import numpy as np, sys; a = np.load(sys.argv[1], mmap_mode='r'); \
print(f'{sys.argv[1]}: {a.size:,} tokens, {a.dtype}')" "$out/train_ids.npy" ;;
  segment)
    out=$2 minutes=$3 segment=$4
    shift 4
    resume=()
    [ -f "$out/train_state.safetensors" ] && resume=(--resume)
    # the corpus is the one OUT records (its archives stay behind: prepare reads OUT alone)
    corpus_dir=$(python3 -c "import json, sys; print(json.load(open(sys.argv[1]))['corpus_dir'] or '')" "$out/corpus.json")
    python3 -m kimi_k3.train run "$out" ${corpus_dir:+--corpus-dir "$corpus_dir"} \
      --minutes "$minutes" --segment-minutes "$segment" "${resume[@]}" "$@" ;;
  export)
    out=$2 ckpt=$3 results=$4
    python3 -m kimi_k3.train export "$out" "$ckpt"
    mkdir -p "$results"
    tar -C "$(dirname "$ckpt")" -cf /tmp/ckpt.tar "$(basename "$ckpt")"
    split_into /tmp/ckpt.tar "$results"
    cp "$out/train_log.jsonl" "$results/" ;;
  join)
    results=$2 ckpt=$3
    mkdir -p "$ckpt"
    cat "$results"/ckpt.tar.part-* | tar -x --strip-components=1 -C "$ckpt" ;;
  *)
    sed -n '2,18p' "$0" >&2
    exit 2 ;;
esac
