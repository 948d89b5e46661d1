# device side: three GRPO variants of the real-model recipe side by side (old snapshot), then the base model
# through evaluate.py (the working tree's code) against the runs' step-0 validation
set -u
R=$PWD
bash .realmodel/s/install.sh >/dev/null && source .vllm/env.sh || exit 1
mkdir -p /tmp/snap && tar xzf .snap/code.tgz -C /tmp/snap && cd /tmp/snap
nvidia-smi --query-gpu=name,memory.total --format=csv > $OUT/gpu.txt
E="--save_freq=0"
EXTRA="$E" bash bench/real_model.sh grpo 440 &
sleep 20; NAME=lr1e5 EXTRA="$E --actor.lr=1e-5" bash bench/real_model.sh grpo 420 &
sleep 20; NAME=flex EXTRA="$E --gsm8k_format=flexible" bash bench/real_model.sh grpo 400 &
wait
for d in /tmp/real_runs/grpo*/; do echo "== $d"; python3 - "$d/metrics.jsonl" <<'PY'
import json, sys
for line in open(sys.argv[1]):
    j = json.loads(line)
    if "val/strict" in j:
        print(j.get("step"), round(j["val/strict"], 4), round(j["val/flexible"], 4), round(j.get("time/total_s", 0), 1))
PY
done
cd "$R"
I='Let'"'"'s think step by step and output the final answer after "####".'
timeout 100 python evaluate.py --model=/tmp/qwen-coder-0.5b --val_data=/tmp/gsm8k_val.jsonl --instruction="$I" \
  --rollout.response_length=512 --rollout.engine=vllm --out=$OUT/eval_base.jsonl > $OUT/eval_base.log 2>&1
echo "evaluate exit $?"; tail -5 $OUT/eval_base.log
