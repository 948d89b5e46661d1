# the picture and table of bench/README.md's real-model section (every variant on record), from their raw files
python bench/curves.py --out=bench/results/2026-12-08-real-n16-h100/curves.png \
  "strict, H200 alone (12-02)=bench/results/round9/grpo_real_0p5b.jsonl" \
  "strict=bench/results/2026-12-06-real-knobs-h100/grpo_metrics.jsonl" \
  "flexible reward=bench/results/2026-12-06-real-knobs-h100/grpo_flex_metrics.jsonl" \
  "strict, lr 1e-5=bench/results/2026-12-06-real-knobs-h100/grpo_lr1e5_metrics.jsonl" \
  "both forms, draw 1=bench/results/2026-12-06-real-both-h100/grpo_both_metrics.jsonl" \
  "both forms, lr 5e-6=bench/results/2026-12-06-real-both-h100/grpo_both_lr5e6_metrics.jsonl" \
  "both forms, draw 2 (strict from step 60)=bench/results/2026-12-07-real-long-h100/grpo_both_metrics.jsonl" \
  "PPO, both forms=bench/results/2026-12-07-real-long-h100/grpo_both_ppo_metrics.jsonl" \
  "LoRA r32 lr 2e-5, both forms=bench/results/2026-12-07-real-long-h100/grpo_both_lora_gc_metrics.jsonl" \
  "bonus, draw 1=bench/results/2026-12-07-real-draws-h100/grpo_bonus_metrics.jsonl" \
  "bonus, draw 2=bench/results/2026-12-07-real-draws-h100/grpo_s1_d0_bonus_metrics.jsonl" \
  "bonus, 16 samples a prompt, draw 1=bench/results/2026-12-08-real-levers-h100/grpo_bonus_n16_metrics.jsonl" \
  "bonus, 16 samples a prompt, draw 2=bench/results/2026-12-08-real-n16-h100/grpo_s1_d0_bonus_n16_metrics.jsonl" \
  "bonus, 16 samples a prompt, draw 3=bench/results/2026-12-08-real-n16-h100/grpo_s2_d0_bonus_n16_metrics.jsonl" \
  "bonus, lr 3e-6=bench/results/2026-12-08-real-levers-h100/grpo_bonus_lr3e6_metrics.jsonl" > bench/results/2026-12-08-real-n16-h100/curves.txt
