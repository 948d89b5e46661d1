#!/usr/bin/env bash
# A real instruct model learning GSM8K on one GPU, with held-out validation: the runs behind bench/README.md's
# "What GRPO does to a real model". Each part fits one 10-minute call of a lent machine; every run's small
# files (metrics.jsonl, val_samples.jsonl, run_config.json, its log) are packed into $OUT/<part>.tgz every
# 30 s and at the end, so a call cut short still brings back what it did.
#   MODEL=/models/Qwen2.5-Coder-0.5B-Instruct TRAIN=gsm8k_train.jsonl VAL=gsm8k_val.jsonl bash bench/real_model.sh grpo
#   bash bench/real_model.sh grpo 540      # the same, stopped by SIGTERM after 540 s; run again: it resumes
#   bash bench/real_model.sh grpo_async 540   # the same with --rollout.mode=async (one GPU: the engine beside)
#   VAL_FREQ=5 (validations and TRL's checkpoints every 5 steps), EXTRA="--save_freq=0 ..." (more of our options)
#   bash bench/real_model.sh rows          # PPO, LoRA, FP8 KV, FP8 weights + KV side by side on the GPU (short)
#   bash bench/real_model.sh trl_speed [0.5b|1.5b]   # TRL's workload, ours (bench/bench_step.py) and TRL, per size
#   bash bench/real_model.sh trl_task [seconds]   # TRL on this task with our GRPO's settings, a checkpoint every 10
#                                                 # steps, then trl_eval in the same call (~90 s more): the checkpoints
#                                                 # are in the machine's /tmp, lost if it goes back between calls,
#                                                 # and removed once scored (KEEP=1 keeps them)
#   bash bench/real_model.sh trl_eval     # the base model and TRL's checkpoints through one greedy evaluator
# TRL's parts want TRL's wheels installed first (no registry on the GPU machine):
#   python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/peersite .peers/*.whl
# val.png: each run folder has it (the run draws it); bench/vs_trl.py report draws TRL's against ours; bench/curves.py
# draws several runs' held-out accuracy against minutes of training (bench/README.md's picture).
# The data: GSM8K rows as published ({"question": ..., "answer": "... #### 72"}); the model: a local folder.
set -u
OUT=${OUT:-out/real}; mkdir -p "$OUT"
MODEL=${MODEL:-/tmp/qwen-coder-0.5b}; TRAIN=${TRAIN:-/tmp/gsm8k_train.jsonl}; VAL=${VAL:-/tmp/gsm8k_val.jsonl}
RUNS=${RUNS:-/tmp/real_runs}; mkdir -p "$RUNS"
SEED=${SEED:-0}; S=$([ "$SEED" = 0 ] || echo "_s$SEED")   # SEED=1: a second run of grpo / trl_task beside the first
# DATA_SEED=0 SEED=k: seed 0's prompts in seed 0's order, the k-th draw of samples (ours: --data_seed; TRL: its data
# seed and its engine's seed): a run's spread on one task. Without it TRL's engine seed is its own (0) on every seed
DATA_SEED=${DATA_SEED:-}; S=$S${DATA_SEED:+_d$DATA_SEED}
S=$S${NAME:+_$NAME}   # NAME=lr1e5 EXTRA="--actor.lr=1e-5": a variant of grpo beside the recipe, in its own folder
export PYTHONUNBUFFERED=1
# TRL's colocated vLLM wants a one-process group; torchrun would read the bench's --n=8 as its own --nnodes
TRL=(env PYTHONPATH=/tmp/peersite:${PYTHONPATH:-} RANK=0 LOCAL_RANK=0 WORLD_SIZE=1
     MASTER_ADDR=localhost MASTER_PORT=29517)
INSTRUCTION='Let'"'"'s think step by step and output the final answer after "####".'   # verl's GSM8K instruction
# GRPO in the shape of the README's real-model section, on one GPU: 32 problems x 8 samples a step, two optimizer
# steps of 16 problems each, answers up to 512 tokens, the held-out 319 validated every 10 steps; the reward strict
# (TRL's task compares with it) unless EXTRA names another (the README's: EXTRA=--gsm8k_format=bonus)
GRPO=(--model="$MODEL" --data="$TRAIN" --val_data="$VAL" --instruction="$INSTRUCTION" --train_batch_size=32
      --rollout.n=8 --actor.ppo_mini_batch_size=16 --rollout.response_length=512 --actor.lr=2e-6 --steps=300
      --val_freq="${VAL_FREQ:-10}" --logger=none --seed="$SEED" ${DATA_SEED:+--data_seed=$DATA_SEED})

pack() {  # pack <part> <run dirs...>: their small files into $OUT/<part>.tgz (replaced whole)
  local part=$1; shift
  local files=(); for d in "$@"; do for f in metrics.jsonl val_samples.jsonl run_config.json log.txt; do
    [ -f "$d/$f" ] && files+=("$d/$f"); done; done
  [ ${#files[@]} -gt 0 ] && tar czf "$OUT/$part.tgz.tmp" "${files[@]}" 2>/dev/null \
    && mv "$OUT/$part.tgz.tmp" "$OUT/$part.tgz"
}
evaluate() {  # the base model first (its engine is reused), then each checkpoint TRL wrote, then our final/ if any
  timeout 540 python bench/vs_trl.py eval --val="$VAL" --response_len=512 --out="$OUT/trl_eval$S.json" \
    "$MODEL" $(ls -d "$RUNS"/trl$S/checkpoint-* 2>/dev/null | sort -t- -k2 -n) \
    $(ls -d "$RUNS"/grpo$S/final 2>/dev/null) \
    > "$OUT/trl_eval$S.log" 2>&1       # our final/ last: the evaluator against our run's own last validation
  local rc=$?
  echo "[trl_eval$S] exit $rc" | tee -a "$OUT/summary.txt"
  # scored, TRL's checkpoints go (2.5 GB each in fp32; they can fill the disk for a later run); KEEP=1 keeps them
  [ "$rc" != 0 ] || [ -n "${KEEP:-}" ] || rm -rf "$RUNS"/trl$S/checkpoint-*
}
keep_packing() { (while sleep 30; do pack "$@"; done) > /dev/null 2>&1 & echo $!; }

run() {  # run <dir> <seconds> <options...>: one training run, SIGTERM after <seconds> (it checkpoints; rerun resumes)
  local dir=$1 limit=$2; shift 2
  timeout -s TERM "$limit" python train_grpo.py --out_dir="$dir" "$@" >> "$dir.log" 2>&1
  local rc=$?                 # before any other expansion: "$(basename ...)" in the line below would reset $?
  echo "[${dir##*/}] exit $rc after $SECONDS s" | tee -a "$dir.log" "$OUT/summary.txt"
  mkdir -p "$dir"; cp "$dir.log" "$dir/log.txt"
}

case "${1:-}" in
  grpo|grpo_async)   # grpo_async: the same run with async rollout (the engine process beside the trainer's GPU)
    nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv > "$OUT/gpu.txt" 2>&1
    name=$1$S; mode=$([ "$1" = grpo_async ] && echo async || echo colocated)
    packer=$(keep_packing "$name" "$RUNS/$name")
    run "$RUNS/$name" "${2:-540}" "${GRPO[@]}" --rollout.mode="$mode" ${EXTRA:-}
    kill "$packer"; pack "$name" "$RUNS/$name" ;;
  rows)    # side by side on one GPU (each run's times are shared-GPU times: read their curves against steps)
    packer=$(keep_packing rows "$RUNS"/{ppo,lora,fp8kv,fp8})
    jobs=()
    run "$RUNS/ppo" "${2:-500}" "${GRPO[@]}" --algorithm.adv_estimator=gae --critic.lr=1e-5 & jobs+=($!)
    run "$RUNS/lora" "${2:-500}" "${GRPO[@]}" --actor.lora_rank=32 --actor.lr=2e-5 & jobs+=($!)
    fp8=(--val_before_train=false --val_freq=0 --steps=6)    # the engine-vs-trainer log-prob gap only
    run "$RUNS/fp8kv" "${3:-240}" "${GRPO[@]}" "${fp8[@]}" --rollout.kv_cache_dtype=fp8 & jobs+=($!)
    run "$RUNS/fp8" "${3:-240}" "${GRPO[@]}" "${fp8[@]}" --rollout.kv_cache_dtype=fp8 \
      --rollout.quantization=fp8 & jobs+=($!)
    wait "${jobs[@]}"
    kill "$packer"; pack rows "$RUNS"/{ppo,lora,fp8kv,fp8} ;;
  trl_speed)   # per size (0.5b 1.5b, or the one given): ours in one process, then TRL (medians after 2 warm-up steps).
               # Ours: the defaults (plan.relax's micro-batches), TRL's micro-batch of 32, the log-probs after step 0
               # off, compiled layers, 32 again (the process's drift); VARIANTS= others, TRL_ONLY=1 TRL's alone
    m32="--actor.ppo_micro_batch_size_per_gpu=32 --actor.log_prob_micro_batch_size_per_gpu=32"
    m32="$m32 --ref.log_prob_micro_batch_size_per_gpu=32"
    for size in ${2:-0.5b 1.5b}; do
      variants="${VARIANTS:-default;$m32;--rollout.logprobs_every=1000;--kernels=compile;$m32}"
      [ -n "${TRL_ONLY:-}" ] || { timeout 350 python bench/bench_step.py --model=random:qwen2.5-$size --micro=0 \
        --steps=6 --warmup=2 --variants="$variants" \
        --out="$OUT/ours_speed_$size.json" > "$OUT/ours_speed_$size.log" 2>&1
      echo "[ours_speed_$size] exit $? after $SECONDS s" | tee -a "$OUT/summary.txt"; }
      timeout "${TRL_LIMIT:-230}" "${TRL[@]}" python bench/vs_trl.py speed \
        --size=qwen2.5-$size --tokenizer="${TOKENIZER:-$MODEL}" --steps=8 --out="$OUT/trl_speed_$size.json" \
        > "$OUT/trl_speed_$size.log" 2>&1
      echo "[trl_speed_$size] exit $? after $SECONDS s" | tee -a "$OUT/summary.txt"
    done ;;
  trl_task)    # GRPO's settings above (32 x 8, two optimizer steps of 16, 512 tokens, lr 2e-6, KL 0.001)
    timeout -s TERM "${2:-540}" "${TRL[@]}" python bench/vs_trl.py task \
      --model="$MODEL" --train="$TRAIN" --prompts=32 --mini=16 --n=8 --response_len=512 --micro=32 --kl=0.001 \
      --lr=2e-6 --steps=50 --save_steps="${VAL_FREQ:-10}" --seed="${DATA_SEED:-$SEED}" \
      ${DATA_SEED:+--sample_seed=$SEED} --out="$RUNS/trl$S" > "$OUT/trl_task$S.log" 2>&1
    echo "[trl_task$S] exit $?" | tee -a "$OUT/summary.txt"; cp "$RUNS/trl$S/steps.json" "$OUT/trl_steps$S.json"
    [ -n "${NO_EVAL:-}" ] || evaluate ;;   # in the same call: the checkpoints are on this machine's /tmp
  trl_eval) evaluate ;;
  *) echo "usage: bash bench/real_model.sh grpo|grpo_async [seconds] | rows [seconds] [fp8 seconds]" \
          "| trl_speed [size] | trl_task [seconds] | trl_eval" >&2; exit 2 ;;
esac
