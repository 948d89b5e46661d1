#!/usr/bin/env bash
# Every 2-GPU check owed, in parts that each fit one device call (at most 10 minutes), then one report:
#   source .vllm/env.sh && bash bench/two_gpus.sh tests      # the GPU tests under torchrun 2 (each file alone)
#   bash bench/two_gpus.sh ulysses      # k=2 against k=1 at 1.5B, one long sequence: peaks per GPU, the plan
#   bash bench/two_gpus.sh async        # 1 engine + 1 trainer GPU against colocated on 2, TRL's workload at 1.5B
#   bash bench/two_gpus.sh scaling      # 1 -> 2 GPUs at 1.5B, the same work per rank; the 2-GPU step profiled
#   bash bench/two_gpus.sh layouts      # TP=2 x 1 engine against TP=1 x 2 engines; HSDP (fsdp_size=1)
#   bash bench/two_gpus.sh report       # $OUT/report.md from the runs' metrics (and the plan beside them)
# DRY=1 runs the same commands on the CPU (gloo, the tiny model, HF generate, 2 steps): the script itself,
# tested before GPUs are spent on it (tests/test_two_gpus.py). Raw files: $OUT/<run>/metrics.jsonl, $OUT/<part>.txt.
set -u
OUT=${OUT:-out/two_gpus}; mkdir -p "$OUT"
DRY=${DRY:-0}
if [ "$DRY" = 1 ]; then
  export CUDA_VISIBLE_DEVICES="" OMP_NUM_THREADS=1
  M15="" STEPS=2 LONG=48 P=4 REST="--rollout.n=4 --rollout.engine=hf"   # LONG: within the tiny model's 64 positions
else                                  # TRL's GRPO workload: 16 prompts x 8 samples, 256-token responses, KL 0.04
  M15="--model=random:qwen2.5-1.5b" STEPS=8 LONG=8192 P=16
  REST="--rollout.n=8 --rollout.response_length=256 --actor.ppo_micro_batch_size_per_gpu=32 \
--actor.log_prob_micro_batch_size_per_gpu=32 --ref.log_prob_micro_batch_size_per_gpu=32 --actor.kl_loss_coef=0.04"
fi
trl() { echo "--train_batch_size=$1 --actor.ppo_mini_batch_size=$1 $REST"; }   # trl <prompts>: the workload, per step
COMMON="--save=false --logger=none --save_freq=0"
part() {  # part <name> <seconds> <command...>: its output to $OUT/<name>.txt, the exit code and time to summary.txt
  local name=$1 limit=$2; shift 2
  local t0=$SECONDS
  timeout "$limit" "$@" > "$OUT/$name.txt" 2>&1
  echo "[$name] exit $? in $((SECONDS - t0)) s" | tee -a "$OUT/$name.txt" "$OUT/summary.txt"
}
train() {  # train <run> <nproc> <options...>: train_grpo.py as users run it, into $OUT/<run>
  local run=$1 n=$2; shift 2
  rm -rf "$OUT/$run"
  if [ "$n" = 1 ]; then python train_grpo.py --out_dir="$OUT/$run" $COMMON "$@"
  else python -m torch.distributed.run --standalone --nproc_per_node="$n" train_grpo.py --out_dir="$OUT/$run" \
    $COMMON "$@"; fi
}
case "${1:-}" in
  _train)                             # (timeout runs a command, not a shell function)
    shift; train "$@" ;;
  tests)
    for f in test_memory.py tests/test_vllm.py; do
      f_name=$(basename "$f" .py)        # test_memory, test_vllm: the part's name
      part "tests_$f_name" 540 python -m torch.distributed.run --standalone --nproc_per_node=2 -m pytest -q -rf "$f"
    done
    part tests_vllm_tp 540 python -m pytest -q -rf -s tests/test_vllm_tp.py
    part tests_lora 300 python -m torch.distributed.run --standalone --nproc_per_node=2 -m pytest -q -rf -k lora \
      test_memory.py tests/test_vllm.py ;;
  ulysses)
    SP="$M15 --train_batch_size=2 --rollout.n=1 --actor.ppo_mini_batch_size=2 --rollout.response_length=$LONG \
--actor.ppo_micro_batch_size_per_gpu=1 --actor.log_prob_micro_batch_size_per_gpu=1 \
--ref.log_prob_micro_batch_size_per_gpu=1 --steps=$STEPS"
    [ "$DRY" = 1 ] && SP="$SP --rollout.engine=hf"
    for k in 1 2; do
      part "ulysses_k$k" 280 bash "$0" _train "ulysses_k$k" 2 $SP --actor.ulysses_sequence_parallel_size=$k
    done ;;
  async)
    part async_colocated 280 bash "$0" _train async_colocated 2 $M15 $(trl $P) --steps=$STEPS
    part async_1plus1 280 bash "$0" _train async_1plus1 2 $M15 $(trl $P) --steps=$STEPS --rollout.mode=async \
      --rollout.gpus=1 ;;
  scaling)
    part scaling_1gpu 280 bash "$0" _train scaling_1gpu 1 $M15 $(trl $P) --steps=$STEPS
    part scaling_2gpu 280 bash "$0" _train scaling_2gpu 2 $M15 $(trl $((2 * P))) --steps=$STEPS \
      --profile_steps=$((STEPS - 1)) ;;
  layouts)
    if [ "$DRY" = 1 ]; then echo "[layouts] TP needs vLLM: HSDP only on the CPU" >> "$OUT/summary.txt"
    else part layouts_tp2 280 bash "$0" _train layouts_tp2 2 $M15 $(trl $((2 * P))) --steps=$STEPS \
      --rollout.tensor_parallel_size=2; fi
    part layouts_tp1 280 bash "$0" _train layouts_tp1 2 $M15 $(trl $((2 * P))) --steps=$STEPS
    part layouts_hsdp 280 bash "$0" _train layouts_hsdp 2 $M15 $(trl $((2 * P))) --steps=$STEPS --fsdp_size=1 ;;
  report)
    python bench/two_gpus_report.py "$OUT" > "$OUT/report.md" && cat "$OUT/report.md" ;;
  all)
    for p in tests ulysses async scaling layouts report; do bash "$0" "$p"; done ;;
  *) echo "usage: [DRY=1] bash bench/two_gpus.sh tests|ulysses|async|scaling|layouts|report|all" >&2; exit 2 ;;
esac
