# device side (a code snapshot): two GRPO runs of the real model side by side on one H100, the both-forms reward at
# two learning rates, and beside them bench/one_gpu.sh corpus (short random-weight runs, two at a time: rows of the
# planner's corpus)
set -u
bash .realmodel/s/install.sh >/dev/null && source .vllm/env.sh || exit 1
mkdir -p /tmp/snap && tar xzf .snap/code.tgz -C /tmp/snap && cd /tmp/snap
nvidia-smi --query-gpu=name,memory.total --format=csv > "$OUT/gpu.txt"
nvidia-smi --query-gpu=timestamp,memory.used --format=csv,noheader,nounits -l 2 > "$OUT/smi.csv" 2>&1 & smi=$!
E="--save_freq=0"; L=${L:-520}
NAME=both EXTRA="$E --gsm8k_format=both" bash bench/real_model.sh grpo "$L" & a=$!
sleep 20; NAME=both_lr5e6 EXTRA="$E --gsm8k_format=both --actor.lr=5e-6" bash bench/real_model.sh grpo $((L - 20)) & b=$!
sleep 20; (OUT="$OUT/corpus" LIMIT=150 bash bench/one_gpu.sh corpus) & c=$!
wait $a $b $c
kill $smi
for d in /tmp/real_runs/grpo*/; do echo "== $d"; python3 - "$d/metrics.jsonl" <<'PY'
import json, sys
for line in open(sys.argv[1]):
    j = json.loads(line)
    if "val/strict" in j:
        print(j.get("step"), round(j["val/strict"], 4), round(j["val/flexible"], 4), round(j.get("time/total_s", 0), 1))
PY
done | tee "$OUT/val_summary.txt"
