#!/bin/bash
# reval's EAGLE-3 acceptance against SafeAILab/EAGLE's own eagenerate, round by round, on the tiny EAGLE-3 fixture
# (CPU fp32, greedy): README.md beside this file says how to set up EAGLE_DIR and its venv (not part of make test).
#   EAGLE_DIR=/path/to/EAGLE EAGLE_PY=/path/to/venv/bin/python [N=10 K=5 TREE=60,7,10] tools/eagle-reference/reproduce.sh
set -euo pipefail
HERE=$(cd "$(dirname "$0")" && pwd); ROOT=$(cd "$HERE/../.." && pwd)
: "${EAGLE_DIR:?set EAGLE_DIR to a SafeAILab/EAGLE checkout}"; : "${EAGLE_PY:?set EAGLE_PY to the python of the venv for it}"
N=${N:-10}; K=${K:-5}; TREE=${TREE:-60,7,10}; FX=$ROOT/.cache/eagle3-fixtures
OUT=$(mktemp -d); trap 'rm -rf "$OUT"' EXIT
"$EAGLE_PY" "$HERE/check_taps.py" | grep -E "layer_ids|worst"
"$EAGLE_PY" "$HERE/run_eagenerate.py" --num-prompts "$N" --chain "$K" --tree "$TREE" --out "$OUT/eagle.json" > /dev/null
for m in chain tree; do
  if [ $m = chain ]; then opt=(--chain "$K"); else opt=(--eagle-tree "$TREE"); fi
  (cd "$ROOT" && PYTHONPATH="$ROOT" OMP_NUM_THREADS=1 .venv/bin/python -m remote_payload eval --drafter "$FX/eagle3" \
     --target "$FX/target" --cache "$FX/cache" --device cpu --dtype fp32 --num-prompts "$N" --max-blocks 64 \
     "${opt[@]}" --run-dir "$OUT/ours-$m" > /dev/null)
done
python3 "$HERE/compare.py" "$OUT/eagle.json" "$OUT/ours-chain/results.json" "$OUT/ours-tree/results.json"
