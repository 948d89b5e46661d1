# device side: two more draws of the README's bonus recipe with 16 samples per prompt (the first draw is in
# ../2026-12-08-real-levers-h100/), side by side on one GPU (each step's times are shared-GPU times): seed 0's
# prompts in seed 0's order, samples drawn with seeds 1 and 2 (SEEDS="1 2"). Each run is stopped by SIGTERM at L
# seconds (it checkpoints); the next call with the same command and another PART resumes it.
# PART names the call's raw files; bench/real_model.sh packs each run's small files into $OUT every 30 s.
set -u
bash .realmodel/s/install.sh >/dev/null && source .vllm/env.sh || exit 1
PART=${PART:-1}; L=${L:-540}; R=/tmp/real_runs
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv > "$OUT/gpu.txt" 2>&1
nvidia-smi --query-gpu=timestamp,memory.used --format=csv,noheader,nounits -l 2 > "$OUT/smi$PART.csv" 2>&1 & smi=$!
# a checkpoint on SIGTERM only (the resume's); each run's relaxed defaults planned to leave half of what the other
# leaves (the first starts alone)
E="--save_freq=1000 --keep_checkpoints=1 --plan_margin=0.5 --gsm8k_format=bonus --rollout.n=16"
jobs=(); late=0
for s in ${SEEDS:-1 2}; do
  DATA_SEED=0 SEED=$s NAME=bonus_n16 EXTRA="$E" bash bench/real_model.sh grpo $((L - late)) & jobs+=($!)
  sleep 20; late=$((late + 20))
done
wait "${jobs[@]}"
kill $smi
for d in "$R"/grpo*/; do echo "== $d"; python3 - "$d/metrics.jsonl" <<'PY'
import json, sys
for line in open(sys.argv[1]):
    j = json.loads(line)
    if "val/strict" in j:
        print(j.get("step"), round(j["val/strict"], 4), round(j["val/flexible"], 4), round(j["val/found_strict"], 3))
PY
done | tee "$OUT/val_summary$PART.txt"
