"""The 2-GPU script, dry (CPU): bench/two_gpus.sh's every part with DRY=1 (gloo, the tiny model, HF generate,
2 steps) runs to its end and the report has each table's figures, so a GPU machine's call on two GPUs is spent
measuring.

    python -m pytest -q tests/test_two_gpus.py
"""
import os
import re
import subprocess

import pytest

from conftest import HERE, child_env, launches


@launches
@pytest.mark.timeout(1500)
def test_the_two_gpu_script_runs_dry_and_reports(tmp_path):
    env = child_env(env={"OUT": str(tmp_path), "DRY": "1"})
    for part in ("ulysses", "async", "scaling", "layouts", "report"):
        r = subprocess.run(["bash", os.path.join("bench", "two_gpus.sh"), part], cwd=HERE, env=env, capture_output=True,
                           text=True, timeout=600)
        assert r.returncode == 0, (part, r.stdout[-2000:], r.stderr[-2000:])
    summary = open(tmp_path / "summary.txt").read()
    assert summary.count("exit 0") == 8 and "exit 1" not in summary, summary   # 2 + 2 + 2 + 2 runs (no TP on the CPU)
    report = open(tmp_path / "report.md").read()
    for line in (r"The update's activation peak per GPU .* = \d", r"Step time async / colocated: \d",
                 r"The NCCL push: \d", r"Scaling efficiency \(1-GPU step / 2-GPU step\): \d",
                 "Where the 2-GPU step spends its time", "- layouts_hsdp: generate"):
        assert re.search(line, report), (line, report[-3000:])
    assert "| layouts_tp2 (not run, or failed) |" in report   # TP needs vLLM: a GPU only
