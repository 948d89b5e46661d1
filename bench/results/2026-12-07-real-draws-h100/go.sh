# device side: GRPO runs of the real model side by side on one GPU (each step's times are shared-GPU times), each
# stopped by SIGTERM at L seconds (it checkpoints; a next call resumes it):
#   bonus, two draws (seed 0; seed 1 on seed 0's prompts) - the value (0.8) and the form (0.2) paid apart
#   STRICT=1: and the strict reward beside them (does the arithmetic move once the form is learned?)
# PART names the call's raw files; bench/real_model.sh packs each run's small files into $OUT every 30 s.
set -u
bash .realmodel/s/install.sh >/dev/null && source .vllm/env.sh || exit 1
PART=${PART:-1}; L=${L:-500}; R=/tmp/real_runs
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv > "$OUT/gpu.txt" 2>&1
nvidia-smi --query-gpu=timestamp,memory.used --format=csv,noheader,nounits -l 2 > "$OUT/smi$PART.csv" 2>&1 & smi=$!
git log -1 --format=%H > "$OUT/commit$PART.txt" 2>/dev/null
# a checkpoint on SIGTERM only (the resume's); each run's relaxed defaults planned to leave half the card to the
# others (the first starts alone)
E="--save_freq=1000 --keep_checkpoints=1 --plan_margin=0.5"
NAME=bonus EXTRA="$E --gsm8k_format=bonus" bash bench/real_model.sh grpo "$L" & a=$!
sleep 20; SEED=1 DATA_SEED=0 NAME=bonus EXTRA="$E --gsm8k_format=bonus" bash bench/real_model.sh grpo $((L - 20)) & b=$!
c=$b; if [ "${STRICT:-0}" = 1 ]; then
  sleep 20; NAME=strict EXTRA="$E --gsm8k_format=strict" bash bench/real_model.sh grpo $((L - 40)) & c=$!
fi
wait $a $b $c
kill $smi
for d in "$R"/grpo*/; do echo "== $d"; python3 - "$d/metrics.jsonl" <<'PY'
import json, sys
for line in open(sys.argv[1]):
    j = json.loads(line)
    if "val/strict" in j:
        print(j.get("step"), round(j["val/strict"], 4), round(j["val/flexible"], 4), round(j["val/found_strict"], 3),
              round(j.get("time/total_s", 0), 1))
PY
done | tee "$OUT/val_summary$PART.txt"
