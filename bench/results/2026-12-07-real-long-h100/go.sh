# device side: the real model's longer curves, three GRPO runs side by side on one H100 (each step's times are
# shared-GPU times), all with the both-forms reward, each resumed across two calls of L seconds: the recipe (lr 2e-6),
# PPO (a critic, offloaded to the host between its uses) and LoRA (rank 32, lr 2e-5). PART=1 also runs the
# embeddings-apart GPU test beside them; EVAL=1 (the last call) stops the recipe at a validation step sized to the
# call (its pace so far: PREV_S seconds of earlier calls) and scores its final/ and the base model with evaluate.py
# in the same call (the engine of the run's batch shape).
set -u
bash .realmodel/s/install.sh >/dev/null && source .vllm/env.sh || exit 1
PART=${PART:-1}; L=${L:-540}; R=/tmp/real_runs
VAL=/tmp/gsm8k_val.jsonl; INSTRUCTION='Let'"'"'s think step by step and output the final answer after "####".'
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv > "$OUT/gpu.txt" 2>&1
nvidia-smi --query-gpu=timestamp,memory.used --format=csv,noheader,nounits -l 2 > "$OUT/smi$PART.csv" 2>&1 & smi=$!
git log -1 --format=%H > "$OUT/commit$PART.txt" 2>/dev/null
E="--save_freq=1000 --keep_checkpoints=1 --gsm8k_format=both"   # a checkpoint on SIGTERM only (the resume's)
STEPS=""
if [ "${EVAL:-0}" = 1 ]; then   # the recipe's pace so far; it ends on a multiple of 10, ~150 s before the call's end
  STEPS=$(python3 - "$R/grpo_both/metrics.jsonl" "$L" "${PREV_S:-480}" <<'PY'
import json, sys
steps = [json.loads(l)["step"] for l in open(sys.argv[1]) if '"time/step"' in l]
done, limit, before = max(steps) + 1, int(sys.argv[2]), int(sys.argv[3])
more = int(0.85 * done / before * (limit - 210)) // 10 * 10
print(f"--steps={(done + more) // 10 * 10}" if more >= 10 else "")
PY
)
  echo "part $PART: the recipe runs to $STEPS" | tee -a "$OUT/summary.txt"
fi
NAME=both EXTRA="$E $STEPS" bash bench/real_model.sh grpo "$L" & a=$!
sleep 20; NAME=both_ppo EXTRA="$E --algorithm.adv_estimator=gae --critic.lr=1e-5 --critic.param_offload=true
  --critic.optimizer_offload=true" bash bench/real_model.sh grpo $((L - 20)) & b=$!
sleep 20; NAME=both_lora_gc EXTRA="$E --actor.lora_rank=32 --actor.lr=2e-5 --actor.gradient_checkpointing=true" bash bench/real_model.sh grpo $((L - 40)) & c=$!
if [ "$PART" = 1 ]; then
  timeout 200 python -m pytest -q -x -s test_memory.py -k embeddings_apart > "$OUT/gpu_test.log" 2>&1
  echo "[gpu_test] exit $?" | tee -a "$OUT/summary.txt"
elif [ "${EVAL:-0}" = 1 ]; then
  wait $a
  EV=(--val_data="$VAL" --instruction="$INSTRUCTION" --rollout.response_length=512 --gsm8k_format=both)
  if [ -d "$R/grpo_both/final" ]; then
    timeout 150 python evaluate.py --model="$R/grpo_both/final" "${EV[@]}" --out="$OUT/eval_final.jsonl" \
      > "$OUT/eval_final.log" 2>&1; echo "[eval_final] exit $?" | tee -a "$OUT/summary.txt"
  fi
  timeout 120 python evaluate.py --model=/tmp/qwen-coder-0.5b "${EV[@]}" --train_batch_size=32 \
    --out="$OUT/eval_base.jsonl" > "$OUT/eval_base.log" 2>&1; echo "[eval_base] exit $?" | tee -a "$OUT/summary.txt"
fi
wait $a $b $c
kill $smi
for d in "$R"/grpo*/; do echo "== $d"; python3 - "$d/metrics.jsonl" <<'PY'
import json, sys
for line in open(sys.argv[1]):
    j = json.loads(line)
    if "val/strict" in j:
        print(j.get("step"), round(j["val/strict"], 4), round(j["val/flexible"], 4), round(j.get("time/total_s", 0), 1))
PY
done | tee "$OUT/val_summary$PART.txt"
