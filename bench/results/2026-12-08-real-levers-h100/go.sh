# device side: what moves the real model's arithmetic under the bonus reward (the README's recipe), three runs side
# by side on one GPU (each step's times are shared-GPU times), each stopped by SIGTERM at L seconds (it checkpoints;
# the next call with the same PART-less command resumes it):
#   n16: 16 samples per prompt (the recipe's 8): fewer groups whose samples all score the same, which carry no signal
#   lr3e6: the actor's learning rate 3e-6 (the recipe's 2e-6)
#   n16_lr3e6: both (ONLY="n16 lr3e6" runs the two named)
# PART names the call's raw files; bench/real_model.sh packs each run's small files into $OUT every 30 s.
set -u
bash .realmodel/s/install.sh >/dev/null && source .vllm/env.sh || exit 1
PART=${PART:-1}; L=${L:-520}; R=/tmp/real_runs
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv > "$OUT/gpu.txt" 2>&1
nvidia-smi --query-gpu=timestamp,memory.used --format=csv,noheader,nounits -l 2 > "$OUT/smi$PART.csv" 2>&1 & smi=$!
# a checkpoint on SIGTERM only (the resume's); each run's relaxed defaults planned to leave half of what the others
# leave (the first starts alone)
E="--save_freq=1000 --keep_checkpoints=1 --plan_margin=0.5 --gsm8k_format=bonus"
declare -A X=([n16]="--rollout.n=16" [lr3e6]="--actor.lr=3e-6" [n16_lr3e6]="--rollout.n=16 --actor.lr=3e-6")
jobs=(); late=0
for v in ${ONLY:-n16 n16_lr3e6 lr3e6}; do   # ONLY="n16 lr3e6": two of them (each gets more of the GPU)
  NAME=bonus_$v EXTRA="$E ${X[$v]}" bash bench/real_model.sh grpo $((L - late)) & jobs+=($!)
  sleep 20; late=$((late + 20))
done
wait "${jobs[@]}"
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
