#!/usr/bin/env bash
# Run the tests pytest selects as N processes on disjoint sets of them (round-robin over the
# collected ids), for GPU tests whose time goes mostly into CPU references:
#   bash benchmarks/pytest_split.sh 4 -m cuda tests/test_kda_kernels.py
# Prints each part's summary; fails if any part fails.
set -u
n=$1
shift
dir=$(mktemp -d)
python3 -m pytest -q --co "$@" | grep "::" >"$dir/ids"
echo "$(wc -l <"$dir/ids") tests in $n parts"
split -n "r/$n" "$dir/ids" "$dir/part_"
for f in "$dir"/part_*; do
  # one id per line (ids may hold spaces: parametrize values with spaces in them)
  (mapfile -t ids <"$f"
   MLX_ENABLE_TF32=0 python3 -m pytest -q -p no:cacheprovider "${ids[@]}" >"$f.log" 2>&1
   echo "rc=$?" >>"$f.log") &
done
wait
rc=0
for f in "$dir"/part_*.log; do
  echo "--- $(basename "$f")"
  grep -E "passed|failed|error|rc=" "$f" | tail -3
  grep -q "^rc=0$" "$f" || { rc=1; grep -E "^(FAILED|ERROR)" "$f"; }
done
exit $rc
