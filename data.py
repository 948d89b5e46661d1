"""Data and rewards: local jsonl / parquet prompts, the tokenizer, built-in and user rewards.

    python -m pytest tests/test_train.py -q -k "data or reward"

Nothing is fetched: `--model` and `--data` are local paths; a bad row stops the run with one line
that names the file, the row and what to change.
"""
import hashlib
import importlib
import json
import math
import numbers
import os
import re


# a tokenizer's vocabulary: fast (tokenizer.json), sentencepiece, BPE (vocab.json + merges.txt), WordPiece
TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "spiece.model", "vocab.json", "vocab.txt")


def load_tokenizer(path):
    """The tokenizer of --model (in the pre-flight, before any model). A folder without one, a
    tokenizer that does not load (a damaged tokenizer.json) or holds no vocabulary raise one line
    naming the folder: transformers would otherwise make an empty one, and the data took the blame."""
    import model
    if not model.is_dir(path):             # built-in or random weights: the tiny tokenizer's ids suffice
        import tiny
        return tiny.build_tokenizer()
    if not any(os.path.isfile(os.path.join(path, f)) for f in TOKENIZER_FILES) and \
            not any(n.endswith(".tiktoken") for n in os.listdir(path)):
        raise FileNotFoundError(f"--model {path}: no tokenizer there (none of {', '.join(TOKENIZER_FILES)}; "
                                f"transformers would make an empty one); copy the model's tokenizer files into it")
    from transformers import AutoTokenizer
    try:
        tokenizer = AutoTokenizer.from_pretrained(path, local_files_only=True)
    except Exception as e:                 # noqa: BLE001 - json, tokenizers and sentencepiece raise their own kinds
        raise ValueError(f"--model {path}: its tokenizer does not load ({type(e).__name__}: "
                         f"{str(e).splitlines()[0][:200] if str(e) else ''}); copy its tokenizer files again") from None
    if len(tokenizer) < 2:
        raise ValueError(f"--model {path}: its tokenizer has no vocabulary ({len(tokenizer)} token); copy the "
                         f"model's tokenizer files (tokenizer.json, or vocab.json + merges.txt) into it")
    return tokenizer


def read_rows(path: str) -> list[dict]:
    if not os.path.isfile(path):
        raise FileNotFoundError(f"--data {path}: no such file")
    if path.endswith(".parquet"):
        import pyarrow.parquet as pq
        try:
            rows = pq.read_table(path).to_pylist()
        except Exception as e:             # pyarrow raises its own kinds for a damaged file
            raise ValueError(f"--data {path}: not a readable parquet file ({str(e).splitlines()[0]})") from None
    else:
        rows = []
        with open(path, "rb") as f:        # bytes, so a bad encoding can name its line
            for i, raw in enumerate(f, 1):
                try:
                    line = raw.decode("utf-8")
                except UnicodeDecodeError as e:
                    raise ValueError(f"{path} line {i} is not UTF-8 text ({e.reason} at byte {e.start}); "
                                     f"re-encode the file as UTF-8") from None
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
    if not rows:
        raise ValueError(f"--data {path}: the file holds no rows")
    return rows


def prompt_text(p, tokenizer, where: str) -> str:
    """A row's prompt as the text the model sees: a string, or chat messages through the chat
    template (joined contents without one). Anything else would train on its str() (a null
    prompt on the text "None"): it is refused, naming the row."""
    if isinstance(p, str) and p:
        msgs = [{"role": "user", "content": p}]
    elif isinstance(p, list) and p:
        for k, msg in enumerate(p):
            if not (isinstance(msg, dict) and isinstance(msg.get("content"), str) and "role" in msg):
                raise ValueError(f"{where}: chat message {k} is not {{'role': ..., 'content': '<text>'}} "
                                 f"(got {str(msg)[:80]})")
        msgs = p
    else:
        what = "empty" if p in ("", []) else "null" if p is None else f"a {type(p).__name__}"
        raise ValueError(f"{where}: the prompt is {what}; give a non-empty string or a list of chat messages")
    if getattr(tokenizer, "chat_template", None):
        return tokenizer.apply_chat_template(msgs, add_generation_prompt=True, tokenize=False)
    return p if isinstance(p, str) else "\n".join(m["content"] for m in msgs)


def answer_text(a, where: str) -> str:
    """The answer the reward compares with: a string or a number (not a dict, list or null)."""
    if isinstance(a, bool) or not isinstance(a, (str, int, float)):
        raise ValueError(f"{where}: the answer is {'null' if a is None else f'a {type(a).__name__}'}; "
                         f"give a string or a number")
    return str(a)


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
        where = f"{path} row {i}"
        p, answer = prompt_text(row[prompt_key], tokenizer, where), answer_text(row[answer_key], where)
        raw = row[prompt_key]
        msgs = raw if isinstance(raw, list) else [{"role": "user", "content": raw}]   # for a reward model's template
        ids = tokenizer(p, add_special_tokens=False)["input_ids"]
        if not ids:
            raise ValueError(f"{where}: the prompt tokenizes to nothing")
        if len(ids) > max_prompt_length:
            dropped += 1
            continue
        prompts.append(ids)
        answers.append(answer)
        chats.append(msgs)
    if not prompts:
        raise ValueError(f"none of the {len(rows)} prompts fits max_prompt_length={max_prompt_length}; raise it")
    if dropped and int(os.environ.get("RANK", 0)) == 0:   # every rank loads the data: said once
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
    module, colon, name = spec.partition(":")
    if not colon or not module or not name:
        raise ValueError(f"--reward {spec}: give module:function (e.g. --reward={module or 'mymod'}:"
                         f"{name or 'reward'}), the function called as f(response, answer) -> float")
    try:
        fn = getattr(importlib.import_module(module), name)
    except (ImportError, AttributeError, ValueError) as e:
        raise ValueError(f"--reward {spec}: cannot load it ({e}); "
                         f"give module:function with the module on PYTHONPATH") from None
    if not callable(fn):
        raise ValueError(f"--reward {spec}: {name} is a {type(fn).__name__}, not a function")
    return fn


def reward_name(spec: str | None, data_path: str | None) -> str:
    """How errors name the reward: the --reward spec, or which built-in one."""
    return spec or ("tiny.copy_reward (built in: the copy task)" if data_path is None
                    else "data.gsm8k_reward (built in)")


def _short(text: str, n: int = 120) -> str:
    return repr(text if len(text) <= n else text[:n] + "...")


def score(reward_fn, name: str, responses: list[str], answers: list[str]) -> tuple[list[float], list[str]]:
    """Each response's reward, and one message per sample whose reward raised or returned anything
    but a finite number (that sample scores 0 here; the caller stops the run or counts it,
    --reward_error). A NaN would otherwise void the whole step on every rank."""
    scores, errors = [], []
    for response, answer in zip(responses, answers):
        try:
            value = reward_fn(response, answer)
            bad = None if isinstance(value, numbers.Real) and math.isfinite(value) else f"returned {value!r}"
        except Exception as e:             # a user's reward can raise anything: name it and the sample
            value, bad = 0.0, f"raised {type(e).__name__}: {e}"
        if bad is not None:
            errors.append(f"reward {name} {bad} for the response {_short(response)} (answer "
                          f"{_short(answer)}); a reward must return a finite number")
            value = 0.0
        scores.append(float(value))
    return scores, errors


def score_rollout(reward_fn, name: str, tokenizer, batch: dict, answers: list[str]) -> tuple[list[float], list[str]]:
    """The reward stage: each response decoded up to its mask (its EOS) and scored against its
    answer (`score`: the scores, and a message per sample whose reward failed)."""
    lengths = batch["response_mask"].sum(-1).tolist()
    texts = tokenizer.batch_decode([r[:int(k)] for r, k in zip(batch["responses"].tolist(), lengths)],
                                   skip_special_tokens=True)
    return score(reward_fn, name, texts, answers)


def reward_errors(errors: list, policy: str, warned: set, device, copies: int = 1) -> int:
    """Rewards that raised or returned no finite number, over all ranks (one all-reduce). With
    `policy` (--reward_error) stop every rank raises the first one (so rank 0 can say it); with zero
    those samples scored 0, and the first is shown once (`warned` remembers) as a warning.
    `copies`: ranks that score the same samples (a Ulysses group's k): each failure counts once."""
    import torch
    import torch.distributed as dist
    world = dist.get_world_size() if dist.is_initialized() else 1
    n = torch.tensor([float(len(errors))], device=device)
    if world > 1:
        dist.all_reduce(n)
    n = int(n.item()) // copies
    if n and (policy == "stop" or "reward" not in warned):
        first = [errors[0] if errors else None]
        if world > 1:                      # every rank learns the first rank's message
            first = [None] * world
            dist.all_gather_object(first, errors[0] if errors else None)
        message = next(e for e in first if e)
        if policy == "stop":
            raise ValueError(f"{message} (--reward_error=zero scores such samples 0 and counts them instead)")
        warned.add("reward")
        if not dist.is_initialized() or dist.get_rank() == 0:
            print(f"[warn] {n} rewards failed this step and scored 0 (reward/errors counts them; shown once): "
                  f"{message}", flush=True)
    return n


def fingerprint(prompts: list[list[int]], answers: list[str]) -> str:
    """A short hash of the prompt ids and answers: a resume checks it walks the same data."""
    return hashlib.sha256(json.dumps([prompts, answers]).encode()).hexdigest()[:16]
