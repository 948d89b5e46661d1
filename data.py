"""Data and rewards: local jsonl / parquet prompts, the tokenizer, built-in and user rewards.

    python -m pytest test_train.py -q -k "data or reward"

Nothing is fetched: `--model` and `--data` are local paths; a bad row stops the run with one line
that names the file, the row and what to change.
"""
import importlib
import json
import os
import re


def load_tokenizer(path):
    if path is None or path.startswith("random:"):   # random weights: the tiny tokenizer's ids suffice
        import tiny
        return tiny.build_tokenizer()
    from transformers import AutoTokenizer
    return AutoTokenizer.from_pretrained(path, local_files_only=True)


def read_rows(path: str) -> list[dict]:
    if not os.path.isfile(path):
        raise FileNotFoundError(f"--data {path}: no such file")
    if path.endswith(".parquet"):
        import pyarrow.parquet as pq
        return pq.read_table(path).to_pylist()
    rows = []
    with open(path) as f:
        for i, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError as e:
                raise ValueError(f"{path} line {i} is not valid JSON ({e.msg}); "
                                 f"fix or remove that line") from None
            if not isinstance(row, dict):
                raise ValueError(f"{path} line {i} is not a JSON object")
            rows.append(row)
    return rows


def load_data(path, tokenizer, prompt_key="prompt", answer_key="answer", max_prompt_length=1024,
              seed=0) -> tuple[list[list[int]], list[str], list[list[dict]]]:
    """Prompt token ids, answers, and each prompt's chat messages (a string prompt becomes one
    user message; a reward model with a chat template of its own re-renders them). `path` None:
    the tiny copy task. Chat prompts get the tokenizer's chat template; prompts longer than
    max_prompt_length are dropped and counted."""
    if path is None:
        import tiny
        rows = tiny.copy_task(seed=seed)
    else:
        rows = read_rows(path)
    prompts, answers, chats, dropped = [], [], [], 0
    for i, row in enumerate(rows, 1):
        for key in (prompt_key, answer_key):
            if key not in row:
                raise ValueError(f"{path} row {i} has no {key!r} field (it has "
                                 f"{sorted(row)}); set --prompt_key / --answer_key")
        p = row[prompt_key]
        msgs = p if isinstance(p, list) else [{"role": "user", "content": str(p)}]
        if getattr(tokenizer, "chat_template", None):
            p = tokenizer.apply_chat_template(msgs, add_generation_prompt=True, tokenize=False)
        elif isinstance(p, list):
            p = "\n".join(m["content"] for m in p)
        ids = tokenizer(p, add_special_tokens=False)["input_ids"]
        if len(ids) > max_prompt_length:
            dropped += 1
            continue
        prompts.append(ids)
        answers.append(str(row[answer_key]))
        chats.append(msgs)
    if not prompts:
        raise ValueError(f"no prompt fits max_prompt_length={max_prompt_length}; raise it")
    if dropped:
        print(f"[data] dropped {dropped} prompts longer than max_prompt_length={max_prompt_length}")
    return prompts, answers, chats


def gsm8k_reward(response: str, answer: str) -> float:
    """1.0 when the response's last `#### <number>` equals the answer's number, else 0.0."""
    truth = answer.split("####")[-1].strip().replace(",", "")
    found = re.findall(r"#### *(-?[0-9.,]+)", response)
    return float(bool(found) and found[-1].replace(",", "").rstrip(".") == truth)


def load_reward(spec: str | None, data_path: str | None):
    """`module:function`, or the default: the copy-task reward for the tiny task, GSM8K for data."""
    if spec is None:
        if data_path is None:
            import tiny
            return tiny.copy_reward
        return gsm8k_reward
    module, _, name = spec.partition(":")
    try:
        return getattr(importlib.import_module(module), name)
    except (ImportError, AttributeError) as e:
        raise ValueError(f"--reward {spec}: cannot load it ({e}); "
                         f"give module:function with the module on PYTHONPATH") from None
