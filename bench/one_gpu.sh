#!/usr/bin/env bash
# The one-H200 runs, in parts that each fit one command of at most 10 minutes; every part writes
# its raw output under $OUT (the device tool brings it back) and never stops the next one.
#   source .vllm/env.sh && bash bench/one_gpu.sh tests       # GPU tests: a third of test_memory.py (one call);
#   bash bench/one_gpu.sh tests_b; bash bench/one_gpu.sh tests_c  # its other two thirds, a call each
#   bash bench/one_gpu.sh tests2                               # tests/test_vllm.py, tests/test_packing.py's GPU tests
#   bash bench/one_gpu.sh fp8tests; bash bench/one_gpu.sh fp8long   # test_defaults' KV bytes, tests/test_fp8.py
#   bash bench/one_gpu.sh profile                              # the step profiled at 0.5B, 1.5B, checkpointing on/off
#   bash bench/one_gpu.sh fp8bench                             # bf16 / FP8 KV / FP8 weights + KV at 1.5B and 7B
#   bash bench/one_gpu.sh kernels [0.5b|1.5b]                  # --kernels torch / liger / compile: the step
#   bash bench/one_gpu.sh rest; bash bench/one_gpu.sh rest2    # the other GPU tests; the kernels' accuracy
#   bash bench/one_gpu.sh stream                               # Adam whole vs streamed: the update at 1.5B and 7B
#   bash bench/one_gpu.sh stream80                             # 7B full fine-tuning with the 1 x 80 GB template's flags
#   bash bench/one_gpu.sh stream80e                            # ... with the cache emptied before the streamed step
#   bash bench/one_gpu.sh stream80_levers                      # ... as train_grpo.py with the reserve's levers; a
#   bash bench/one_gpu.sh stream80_resume                      # checkpoint without Adam, then its resume
#   MICRO=4 SAVE=0 bash bench/one_gpu.sh stream80_levers       # ... micro-batch 4, no checkpoint
#   bash bench/one_gpu.sh long80                               # the same with 4,096-token answers, micro-batch 1
#   bash bench/one_gpu.sh corpus                               # eight short runs, two at a time: corpus rows
#   bash bench/one_gpu.sh leak                                 # a run set up and dropped twice; what stays allocated
#   bash bench/one_gpu.sh sampler                              # the sampling call's seeds and log-probs: decode step
#   bash bench/one_gpu.sh decode                               # the decode step profiled: GPU busy vs wall, kernels
#   bash bench/one_gpu.sh decode_core [0.5b|1.5b]              # the async engine's decode: vLLM's core inline / apart
#   bash bench/one_gpu.sh logprobs [0.5b|1.5b]                 # the step with and without the sampled tokens' log-probs
#   bash bench/one_gpu.sh gc                                   # the collector's time a step; the heap frozen at set-up
#   bash bench/one_gpu.sh awake [0.5b|1.5b]                    # the engine awake all run against asleep after each
#   bash bench/one_gpu.sh awake_why [1.5b|0.5b]                # ... and awake with the trainer's reserve given back
#   bash bench/one_gpu.sh head [0.5b|1.5b]                     # the LM head compiled vs eager: alone, in the step
set -u
OUT=${OUT:-out/one_gpu}; mkdir -p "$OUT"
part() {  # part <name> <seconds> <command...>: the command's output to $OUT/<name>.txt, its time and exit code after
  local name=$1 limit=$2; shift 2
  local t0=$SECONDS
  timeout "$limit" "$@" > "$OUT/$name.txt" 2>&1
  echo "[$name] exit $? in $((SECONDS - t0)) s" | tee -a "$OUT/$name.txt" "$OUT/summary.txt"
}
case "${1:-}" in
  stream)     # the same steps with Adam brought in whole for the step and streamed a layer at a time, one process
    part stream_1p5b 240 python bench/bench_offload.py --model=random:qwen2.5-1.5b \
      --configs=optim,optim_stream,all,all_stream --steps=3 --out="$OUT/stream_1p5b.json"
    part stream_7b 340 python bench/bench_offload.py --model=random:qwen2.5-7b --configs=ref_optim,ref_optim_stream \
      --steps=3 --prompts=8 --n=8 --micro=4 --engine=hf --actor.gradient_checkpointing=true --save_freq=0 \
      --out="$OUT/stream_7b.json" ;;
  stream80)   # plan.py's template row "qwen2.5-7b | 1 x 80": every stage's device level against 80 GB and the plan
    part stream_7b_80 560 python bench/bench_offload.py --model=random:qwen2.5-7b --configs=ref_optim_stream --steps=3 \
      --save_freq=0 --prompts=8 --n=8 --prompt_len=512 --response_len=1024 --micro=4 \
      --actor.gradient_checkpointing=true --out="$OUT/stream_7b_80.json"
    # measured at 7B: 65.1 GB allocated, 85.7 GB reserved at the update: the same with expandable segments
    part stream_7b_80x 560 python bench/bench_offload.py --model=random:qwen2.5-7b --configs=ref_optim_stream \
      --steps=3 \
      --save_freq=0 --prompts=8 --n=8 --prompt_len=512 --response_len=1024 --micro=4 \
      --actor.gradient_checkpointing=true --expandable --out="$OUT/stream_7b_80x.json" ;;
  stream80e)  # the update reserved one embeddings' Adam window beyond its slack (7B): does emptying free it?
    part stream_7b_80e 560 python bench/bench_offload.py --model=random:qwen2.5-7b --configs=ref_optim_stream \
      --steps=3 \
      --save_freq=0 --prompts=8 --n=8 --prompt_len=512 --response_len=1024 --micro=4 \
      --actor.gradient_checkpointing=true --empty_before_step --out="$OUT/stream_7b_80e.json" ;;
  stream80_levers|stream80_resume|long80)   # the template row with the reserve's levers as a user runs it
        # (train_grpo.py, 512-token prompts), nvidia-smi sampled every 200 ms; a checkpoint after step 3 without
        # Adam (--save_optimizer=false: 30 GB; with Adam 91 GB, more than a 64 GB disk); stream80_resume, a call after
        # it on the same machine: the same command resumed from that checkpoint into a new out_dir for one step
    python -c "import json, random; r = random.Random(0); print('\n'.join(json.dumps({'prompt': ''.join(
      r.choice('0123456789+=') for _ in range(512)), 'answer': '#### 0'}) for _ in range(64)))" > /tmp/p512.jsonl
    nvidia-smi --query-gpu=timestamp,memory.used,memory.total --format=csv,noheader,nounits -lms 200 \
      > "$OUT/smi_$1.csv" 2>&1 & smi=$!
    long=$([ "$1" = long80 ] && echo 4096 || echo 1024)   # long80: 4,096-token answers at micro-batch 1
    t7b=(--model=random:qwen2.5-7b --data=/tmp/p512.jsonl --train_batch_size=8 --rollout.n=8
         --actor.ppo_mini_batch_size=8 --rollout.response_length="$long"
         --actor.ppo_micro_batch_size_per_gpu="$([ "$1" = long80 ] && echo 1 || echo "${MICRO:-2}")"
         --actor.optimizer_offload=true --actor.optimizer_stream=true --ref.param_offload=true
         --expandable_segments=true --actor.optimizer_row_windows=true --save=false --save_optimizer=false
         --keep_checkpoints=1 --logger=none)
    if [ "$1" = long80 ]; then
      part long_7b 560 python train_grpo.py "${t7b[@]}" --steps=3 --save_freq=0 --out_dir=/tmp/r7b_long
      run=r7b_long
    elif [ "$1" = stream80_levers ]; then
      part levers_7b 560 python train_grpo.py "${t7b[@]}" --steps=3 --save_freq="${SAVE:-3}" --out_dir=/tmp/r7b
      (du -sb /tmp/r7b/checkpoints/step_*; df -B1 /tmp) > "$OUT/levers_7b_checkpoint_bytes.txt" 2>&1
      run=r7b
    else
      part levers_7b_resume 560 python train_grpo.py "${t7b[@]}" --steps=4 --save_freq=0 \
        --out_dir=/tmp/r7b_resumed --resume=/tmp/r7b/checkpoints/step_000003
      run=r7b_resumed
    fi
    kill $smi   # a corpus row: python bench/corpus.py add <folder> --gpu=... --commit=... --log=...
    mkdir -p "$OUT/$run" && cp /tmp/$run/metrics.jsonl /tmp/$run/run_config.json "$OUT/$run/" 2>/dev/null ;;
  corpus)    # short runs, PAR at a time (2), small batches and --plan_margin=0.8 so each stays near 16 GB beside
             # whatever shares the GPU: their allocator peaks are each process's own; the device levels are the
             # shared GPU's, left out of their rows (bench/corpus.py add <folder> --shared --log=<folder>/log.txt);
             # the runs' files in $OUT/corpus.tgz
    c="--steps=4 --save_freq=0 --save=false --logger=none --train_batch_size=4 --rollout.n=4"
    c="$c --actor.ppo_mini_batch_size=4 --plan_margin=0.8"
    declare -A runs=(
      [ppo_0p5b]="--model=random:qwen2.5-0.5b --algorithm.adv_estimator=gae --rollout.response_length=256"
      [lora_1p5b]="--model=random:qwen2.5-1.5b --actor.lora_rank=32 --rollout.response_length=256"
      [levers_1p5b]="--model=random:qwen2.5-1.5b --actor.optimizer_offload=true --actor.optimizer_stream=true \
        --actor.optimizer_row_windows=true --expandable_segments=true --rollout.response_length=256"
      [offload_0p5b]="--model=random:qwen2.5-0.5b --actor.param_offload=true --actor.optimizer_offload=true \
        --ref.param_offload=true --rollout.response_length=256"
      [long_0p5b]="--model=random:qwen2.5-0.5b --rollout.response_length=2048"
      [fp8kv_0p5b]="--model=random:qwen2.5-0.5b --rollout.kv_cache_dtype=fp8 --rollout.response_length=512"
      [async_0p5b]="--model=random:qwen2.5-0.5b --rollout.mode=async --rollout.response_length=512"
      [hf_0p5b]="--model=random:qwen2.5-0.5b --rollout.engine=hf --rollout.response_length=128")
    pack() {   # a call brings back a few files by name: every run's small files in one archive, kept current
      (cd /tmp && tar czf "$OUT/corpus.tgz.tmp" corpus/*/log.txt corpus/*/metrics.jsonl corpus/*/run_config.json \
        2>/dev/null && mv "$OUT/corpus.tgz.tmp" "$OUT/corpus.tgz")
    }
    for name in ${NAMES:-"${!runs[@]}"}; do
      while [ "$(jobs -rp | wc -l)" -ge "${PAR:-2}" ]; do sleep 2; pack; done
      mkdir -p "/tmp/corpus/$name"
      # shellcheck disable=SC2086
      (timeout "${LIMIT:-240}" python train_grpo.py $c ${runs[$name]} --out_dir="/tmp/corpus/$name" \
         > "/tmp/corpus/$name/log.txt" 2>&1; echo "[$name] exit $?" >> "$OUT/summary.txt") &
      sleep 5
    done
    while [ "$(jobs -rp | wc -l)" -gt 0 ]; do sleep 2; pack; done
    pack ;;
  sampler)    # the decode step: a seed a request against one a call, with and without log-probs, one engine
    part sampler_0p5b 200 python bench/bench_engine.py auto none "$OUT/sampler_0p5b.json" --model=qwen2.5-0.5b --sampler
    part sampler_1p5b 240 python bench/bench_engine.py auto none "$OUT/sampler_1p5b.json" --model=qwen2.5-1.5b \
      --sampler ;;
  decode)     # where a decode step goes: the step at 64 and 256 sequences, profiled with and without log-probs;
              # vLLM's async scheduling off against on (0.5B)
    part decode_0p5b 200 python bench/bench_engine.py auto none "$OUT/decode_0p5b.json" --model=qwen2.5-0.5b --decode
    part decode_1p5b 240 python bench/bench_engine.py auto none "$OUT/decode_1p5b.json" --model=qwen2.5-1.5b --decode
    part decode_0p5b_sync 200 python bench/bench_engine.py auto none "$OUT/decode_0p5b_sync.json" --model=qwen2.5-0.5b \
      --decode --async_scheduling=0
    (cd "$OUT" && tar czf decode_traces.tgz decode_trace_* && rm -f decode_trace_*) ;;   # a call brings back 8 files
  decode_core)   # the async engine's build (awake, no sleep pool), vLLM's engine core in this process against in a
                 # process of its own (its output processing beside the GPU's work): the decode step, in alternation
    for size in ${2:-0.5b 1.5b}; do for core in inline process; do
      part "decode_${core}_${size/./p}" 180 python bench/bench_engine.py auto none \
        "$OUT/decode_${core}_${size/./p}.json" --model=qwen2.5-$size --decode --engine_core=$core
    done; done ;;
  logprobs)   # the loop's step with the sampled tokens' log-probs every step against none after step 0
    for size in ${2:-0.5b 1.5b}; do
      part "logprobs_$size" 280 python bench/bench_step.py --model=random:qwen2.5-$size --warmup=1 --steps=4 \
        --variants="--rollout.logprobs_every=1;--rollout.logprobs_every=1000;--rollout.logprobs_every=1" \
        --out="$OUT/logprobs_$size.json"
    done ;;
  gc)         # vLLM's sleep runs a full collection each step; the collector's time a step with the
              # set-up's objects frozen (as the loop runs) and without (gc_thawed, the heap thawed)
    m32="--actor.ppo_micro_batch_size_per_gpu=32 --actor.log_prob_micro_batch_size_per_gpu=32"
    m32="$m32 --ref.log_prob_micro_batch_size_per_gpu=32"
    part gc_1p5b 400 python bench/bench_step.py --model=random:qwen2.5-1.5b --micro=0 --steps=6 --warmup=2 \
      --variants="${VARIANTS:-gc_thawed;$m32 gc_thawed;$m32;default;gc_thawed}" --out="$OUT/gc_1p5b.json" ;;
  awake)      # rollout.sleep_level=0 against the engine asleep after each generation (the default), one engine
              # shared by the variants, the first again for the process's drift
    for size in ${2:-0.5b}; do
      part "awake_$size" 300 python bench/bench_step.py --model=random:qwen2.5-$size --micro=0 --steps=6 --warmup=2 \
        --variants="--rollout.sleep_level=0;default;--rollout.sleep_level=0" --out="$OUT/awake_$size.json"
    done ;;
  awake_why)  # whether the awake engine generates slower at 1.5B: asleep, awake, awake with the trainer's
              # reserve given back after the sync, awake with generation's tensors in a pool of their own, then the
              # first two again (the drift); each variant's last step profiled (the host's CUDA calls by name)
    part "awake_why_${2:-1.5b}" 560 python bench/bench_step.py --model=random:qwen2.5-${2:-1.5b} --micro=0 --steps=3 \
      --warmup=2 --profile --out="$OUT/awake_why_${2:-1.5b}.json" --variants="default;--rollout.sleep_level=0;\
--rollout.sleep_level=0 empty_after_sync;--rollout.sleep_level=0 generate_pool;default;--rollout.sleep_level=0" ;;
  head)       # the compiled head (--head_kernel=auto, the default on a GPU): alone (bench_head.py, no vLLM needed),
              # then the step beside --head_kernel=eager, the default again last (the process's drift); TRL's workload
    for size in ${2:-0.5b 1.5b}; do
      hidden=$([ "$size" = 0.5b ] && echo 896 || echo 1536)
      part "head_alone_$size" 120 python bench/bench_head.py --hidden="$hidden" --out="$OUT/head_alone_$size.json"
      part "head_step_$size" 300 python bench/bench_step.py --model=random:qwen2.5-$size --micro=0 --steps=6 \
        --warmup=2 --variants="default;--head_kernel=eager;default" --out="$OUT/head_step_$size.json"
    done ;;
  leak)       # issue 44's set-up leak: the GPU test, then three variants sharing an engine and what each left
    part test_twice 240 python -m pytest -q -rf -s test_memory.py -k twice
    part leak_0p5b 300 python bench/bench_step.py --model=random:qwen2.5-0.5b \
      --variants="--memory_history=true;--memory_history=true;--memory_history=true" \
      --steps=2 --warmup=1 --out="$OUT/leak_0p5b.json" ;;
  tests|tests_b|tests_c)   # test_memory.py's collected tests, every third from the first, second or third: the
                           # whole file (26 tests) takes longer than one 560 s call
    nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv > "$OUT/gpu.txt" 2>&1
    k=$(case $1 in tests) echo 1;; tests_b) echo 2;; *) echo 0;; esac)
    ids=$(python -m pytest -q --collect-only test_memory.py | grep '::' | awk -v k="$k" 'NR % 3 == k')
    part "${1/tests/test_memory}" 560 python -m pytest -q -rf $ids ;;
  tests2)
    part test_vllm 380 python -m pytest -q -rf -s tests/test_vllm.py
    part test_packing_gpu 180 python -m pytest -q -rf -m gpu tests/test_packing.py ;;
  fp8tests)
    part test_defaults_kv 80 python -m pytest -q -rf -s tests/test_defaults.py -k kv_bytes
    part test_fp8_bytes 200 python -m pytest -q -rf -s tests/test_fp8.py -k fresh
    part test_fp8_learns 280 python -m pytest -q -rf -s tests/test_fp8.py -k embedded ;;
  fp8long)     # each FP8 run builds a bf16 and an FP8 engine and trains both: a call of its own
    part test_fp8_0p5b 540 python -m pytest -q -rf -s tests/test_fp8.py -k 0p5b ;;
  profile)
    part profile_0p5b 270 python bench/bench_step.py --model=random:qwen2.5-0.5b --profile --out="$OUT/step_0p5b.json" \
        --variants="--actor.gradient_checkpointing=true;--actor.gradient_checkpointing=false"
    part profile_1p5b 300 python bench/bench_step.py --model=random:qwen2.5-1.5b --profile --out="$OUT/step_1p5b.json" \
        --variants="--actor.gradient_checkpointing=true;--actor.gradient_checkpointing=false" ;;
  fp8bench)
    for mode in bf16 fp8kv fp8; do
      part "fp8_1p5b_$mode" 110 python bench/bench_step.py --model=random:qwen2.5-1.5b --modes=$mode --steps=3 \
          --out="$OUT/fp8_1p5b_$mode.json"
    done
    for mode in bf16 fp8; do
      part "fp8_7b_$mode" 150 python bench/bench_step.py --model=random:qwen2.5-7b --modes=$mode --steps=2 --warmup=1 \
          --variants="--actor.lora_rank=16 --actor.lr=1e-5" --out="$OUT/fp8_7b_$mode.json"
    done ;;
  kernels)   # liger-kernel from a wheel carried beside the vLLM bundle (.vllm/liger/, no registry there)
    ls .vllm/liger/*.whl > /dev/null 2>&1 \
      && python3 -m pip install -q --no-index --no-deps --target /tmp/site .vllm/liger/*.whl
    # the timing pass, no profiler (CUPTI left on by a profiled step slows every later launch of the
    # process); torch again last: the drift of the process over the variants, beside the ratios
    for size in ${2:-0.5b 1.5b}; do
      part "kernels_$size" 330 python bench/bench_step.py --model=random:qwen2.5-$size --warmup=2 --steps=3 \
          --variants="--kernels=torch;--kernels=liger;--kernels=compile;--kernels=torch" --out="$OUT/kernels_$size.json"
    done ;;
  rest)      # the GPU tests the calls above leave out
    part test_memory_rest 300 python -m pytest -q -rf test_memory.py \
        -k "reward_model_stage or oom or plan_predicts or checkpoint_leaves"
    part test_defaults_kv 100 python -m pytest -q -rf -s tests/test_defaults.py -k kv_bytes ;;
  rest2)
    part test_kernels 150 python -m pytest -q -rf -s -m gpu tests/test_packing.py -k kernels_are
    part test_vllm_async 150 python -m pytest -q -rf -s tests/test_vllm.py -k async
    part test_fp8_learns 280 python -m pytest -q -rf -s tests/test_fp8.py -k embedded ;;
  *) parts="tests|tests_b|tests_c|tests2|fp8tests|fp8long|profile|fp8bench|kernels|rest|rest2|stream|stream80"
     parts="$parts|stream80e|stream80_levers|stream80_resume|corpus|leak|sampler|decode|decode_core|logprobs|gc"
     parts="$parts|awake|awake_why|head"
     echo "usage: bash bench/one_gpu.sh $parts" >&2
     exit 2 ;;
esac
