"""Data and rewards: local jsonl / parquet prompts, the tokenizer, the reward (built in: gsm8k.py, tiny.py; a user's).

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

import gsm8k


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


def check_format(path: str, option: str):
    """A file read as JSON lines that is another format (a parquet file under another name, a table) is one line
    saying what to write, not a JSON error about its first line."""
    with open(path, "rb") as f:
        head = f.read(4)
    if head == b"PAR1" and not path.endswith(".parquet") or path.endswith((".csv", ".tsv", ".arrow", ".xlsx")):
        raise ValueError(f"{option} {path}: read as .jsonl or .parquet only; "
                         + ("it is a parquet file: name it *.parquet" if head == b"PAR1" else
                            "convert it to .jsonl (one JSON object a line) or .parquet"))


def read_rows(path: str, option: str = "--data") -> list[dict]:
    """Every row of a .jsonl or .parquet file; `option`: how errors name it (--data, --val_data)."""
    if os.path.isdir(path):                # a dataset's folder: name the files a run can read in it
        found = sorted(n for n in os.listdir(path) if n.endswith((".jsonl", ".parquet")))
        raise ValueError(f"{option} {path} is a folder; pass one .jsonl or .parquet file"
                         + (f" (it holds {', '.join(found[:3])}{', ...' if len(found) > 3 else ''})" if found else ""))
    if not os.path.isfile(path):
        raise FileNotFoundError(f"{option} {path}: no such file")
    check_format(path, option)
    if path.endswith(".parquet"):
        import pyarrow.parquet as pq
        try:
            rows = pq.read_table(path).to_pylist()
        except Exception as e:             # pyarrow raises its own kinds for a damaged file
            raise ValueError(f"{option} {path}: not a readable parquet file ({str(e).splitlines()[0]})") from None
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
                    whole = " (a JSON array or object over several lines? write one object a line: .jsonl)" \
                        if i == 1 and line.strip() in ("[", "{") else ""
                    raise ValueError(f"{path} line {i} is not valid JSON ({e.msg}){whole}; "
                                     f"fix or remove that line") from None
                if not isinstance(row, dict):
                    raise ValueError(f"{path} line {i} is not a JSON object" + (
                        " (the file is one JSON array? write one object a line: .jsonl)" if i == 1 and
                        isinstance(row, list) else ""))
                rows.append(row)
    if not rows:
        raise ValueError(f"{option} {path}: the file holds no rows")
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


PROMPT_KEYS = ("prompt", "question")   # tried in order when --prompt_key is left at its default:
                                       # published GSM8K names its prompt `question` (its answer is `answer`)


def prompt_key_of(row: dict, key: str) -> str:
    """The field a row's prompt is in: `key`, or at the default (PROMPT_KEYS[0]) the first of PROMPT_KEYS
    the row has."""
    if key != PROMPT_KEYS[0] or key in row:
        return key
    return next((k for k in PROMPT_KEYS if k in row), key)


def with_instruction(p, instruction: str):
    """The prompt with `instruction` appended (after a space, as verl's GSM8K preprocessing does): to a
    string, or to the last user message of a chat."""
    if not instruction or not isinstance(p, (str, list)) or not p:
        return p
    if isinstance(p, str):
        return f"{p} {instruction}"
    last = max((k for k, m in enumerate(p) if isinstance(m, dict) and m.get("role") == "user"), default=None)
    if last is None or not isinstance(p[last].get("content"), str):
        return p                           # prompt_text names the malformed message
    return [*p[:last], {**p[last], "content": f"{p[last]['content']} {instruction}"}, *p[last + 1:]]


CHARS_PER_TOKEN = 64                       # more than any tokenizer's token holds, but for runs of one character


def tokens(tokenizer, text: str, limit: int) -> list[int] | None:
    """The prompt's token ids, or None when it has more than `limit`. A prefix of (limit + 2) x CHARS_PER_TOKEN
    characters is tokenized first: a huge line (one of 50 MB cost 15 GB of RAM and minutes whole) is dropped
    in bounded time and memory; a prefix that is short of the limit (runs of one character) means the whole."""
    head = text[:(limit + 2) * CHARS_PER_TOKEN]
    ids = tokenizer(head, add_special_tokens=False)["input_ids"]
    if len(ids) > limit + 1:               # the cut can merge or split one token at most
        return None
    if len(head) < len(text):
        ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    return None if len(ids) > limit else ids


def load_data(path, tokenizer, prompt_key=PROMPT_KEYS[0], answer_key="answer", max_prompt_length=1024, seed=0, *,
              instruction="", held_out=False, option="--data") -> tuple[list[list[int]], list[str], list[list[dict]]]:
    """Prompt token ids, answers, and each prompt's chat messages (a string prompt becomes one
    user message; a reward model with a chat template of its own re-renders them). `path` None:
    the tiny copy task (`held_out`: its held-out items). `instruction` is appended to every prompt;
    chat prompts get the tokenizer's chat template; prompts longer than max_prompt_length are
    dropped and counted. `option`: how errors name the file (--data, --val_data)."""
    if path is None:
        import tiny
        rows = tiny.held_out() if held_out else tiny.copy_task(seed=seed)
    else:
        rows = read_rows(path, option)
    prompts, answers, chats, dropped = [], [], [], 0
    for i, row in enumerate(rows, 1):
        key = row_fields(row, i, path, prompt_key, answer_key, option)
        where = f"{path} row {i}"
        raw = with_instruction(row[key], instruction)
        p, answer = prompt_text(raw, tokenizer, where), answer_text(row[answer_key], where)
        msgs = raw if isinstance(raw, list) else [{"role": "user", "content": raw}]   # for a reward model's template
        ids = tokens(tokenizer, p, max_prompt_length)
        if ids == []:
            raise ValueError(f"{where}: the prompt tokenizes to nothing")
        if ids is None:
            dropped += 1
            continue
        prompts.append(ids)
        answers.append(answer)
        chats.append(msgs)
    if not prompts:
        raise ValueError(none_fit(len(rows), path, tokenizer, instruction, max_prompt_length))
    if dropped and int(os.environ.get("RANK", 0)) == 0:   # every rank loads the data: said once
        print(f"[data] dropped {dropped} {'held-out ' if held_out else ''}prompts of "
              f"{path or 'the built-in task'} longer than max_prompt_length={max_prompt_length}")
    return prompts, answers, chats


def row_fields(row: dict, i: int, path, prompt_key: str, answer_key: str, option: str) -> str:
    """Row i's prompt field (`prompt_key`; at its default, the first of PROMPT_KEYS the row has, said once
    at row 1), or one line naming the options to set when the row lacks it or `answer_key`."""
    key = prompt_key_of(row, prompt_key)
    for k in (key, answer_key):
        if k not in row:
            raise ValueError(f"{option} {path} row {i} has no {k!r} field (it has {sorted(row)}); set "
                             f"--prompt_key / --answer_key" + (", which name the fields of --data and "
                                                               "--val_data alike" if option != "--data" else ""))
    if i == 1 and key != prompt_key and int(os.environ.get("RANK", 0)) == 0:
        print(f"[data] {path}: no {prompt_key!r} field: the prompts are its {key!r} field "
              f"(--prompt_key names another)", flush=True)
    return key


def none_fit(rows: int, path, tokenizer, instruction: str, limit: int) -> str:
    """Why no prompt of `path` fits `limit` tokens: the instruction alone (said with the limit, not the data's
    fault), or the prompts with it appended, or the prompts."""
    if instruction and tokens(tokenizer, instruction, limit) is None:
        return (f"--instruction ({len(instruction):,} characters) is longer than max_prompt_length={limit} tokens "
                f"by itself, before any prompt; shorten it (prompt and instruction together must fit {limit} tokens) "
                f"or raise --max_prompt_length")
    return (f"none of the {rows} prompts of {path or 'the built-in task'} fits max_prompt_length={limit}"
            + (f" with --instruction ({len(instruction):,} characters) appended; shorten it or raise"
               if instruction else "; raise it"))


def data_seed(cfg) -> int:
    """The seed of the data a run trains on: the built-in task's items and the prompt order (a torch.randperm of
    the prompts, as TRL's sampler makes its own). --data_seed, else the run's --seed."""
    return cfg.seed if cfg.data_seed < 0 else cfg.data_seed


def run_data(cfg, tokenizer) -> tuple[tuple, tuple | None]:
    """The run's training data (--data) and its held-out data (`held_out_data`; None: no validation): each
    (prompt ids, answers, chats), the same instruction appended to both. A held-out file that the built-in
    GSM8K rule would score (`held_out_reward_data`) while the run trains on the built-in task, scored by its
    copy reward, is refused: one run has one reward."""
    data = load_data(cfg.data, tokenizer, cfg.prompt_key, cfg.answer_key, cfg.max_prompt_length, data_seed(cfg),
                     instruction=cfg.instruction)
    if builtin_gsm8k(cfg.reward, cfg.data):
        numeric_answers(data[1], cfg.data, "--data")
    val = held_out_data(cfg, tokenizer)
    if val is not None and cfg.data is None and builtin_gsm8k(cfg.reward, held_out_reward_data(cfg, val[1])):
        raise ValueError(f"--val_data {cfg.val_data}: its answers are numbers, which the built-in GSM8K rule scores, "
                         f"but without --data the run trains on the built-in copy task, scored by its copy reward; "
                         f"give the training file with --data (or one reward for both: --reward=module:function)")
    return data, val


def held_out_data(cfg, tokenizer) -> tuple | None:
    """The held-out (prompt ids, answers, chats) that validation (and evaluate.py) answers: --val_data, at most
    --val_max_prompts of it, with --instruction appended and the chat template applied as for --data; with
    neither --data nor --val_data the built-in task's held-out items; None: --data without --val_data."""
    if cfg.val_data is None and cfg.data is not None:
        return None
    val = load_data(cfg.val_data, tokenizer, cfg.prompt_key, cfg.answer_key, cfg.max_prompt_length, data_seed(cfg),
                    instruction=cfg.instruction, held_out=cfg.val_data is None, option="--val_data")
    if cfg.val_data is not None and builtin_gsm8k(cfg.reward, held_out_reward_data(cfg, val[1])):
        numeric_answers(val[1], cfg.val_data, "--val_data")
    cap = cfg.val_max_prompts or len(val[0])
    return tuple(x[:cap] for x in val)


def held_out_reward_data(cfg, answers: list) -> str | None:
    """The data whose form picks the held-out answers' built-in reward (what builtin_gsm8k, load_reward and
    reward_name take as `data_path`): --data, as for training; without it a --val_data whose answers are numbers
    (GSM8K's `... #### 18`, or bare: `18`) is scored as --data would be, by the built-in GSM8K rule; one whose
    answers hold no number, and the built-in task's items, by the copy task's reward (a string compare)."""
    if cfg.data is not None or cfg.val_data is None:
        return cfg.data
    return cfg.val_data if any(gsm8k.gsm8k_truth(str(a)) is not None for a in answers) else None


def numeric_answers(answers: list, path: str, option: str):
    """The built-in GSM8K reward compares the number a response gives with the number an answer ends with: data
    whose answers hold none could never score (one line), and those that do not are said once."""
    bad = [a for a in answers if gsm8k.gsm8k_truth(str(a)) is None]
    if len(bad) == len(answers):
        raise ValueError(f"{option} {path}: none of its {len(answers)} answers is a number (the first: "
                         f"{str(answers[0])[:60]!r}), which the built-in GSM8K reward needs; pass "
                         f"--reward=module:function, called as f(response, answer) -> float")
    if bad and int(os.environ.get("RANK", 0)) == 0:
        print(f"[data] warning: {len(bad)} of {len(answers)} answers of {path} hold no number (e.g. "
              f"{str(bad[0])[:60]!r}): the built-in GSM8K reward scores their samples 0")


def builtin_gsm8k(spec: str | None, data_path: str | None) -> bool:
    """The run scores with the built-in GSM8K rule (no --reward, and data of its own)."""
    return spec is None and data_path is not None


def load_reward(spec: str | None, data_path: str | None, gsm8k_format: str = "strict"):
    """`module:function`, or the default: the copy-task reward for the tiny task, GSM8K (in
    `gsm8k_format`'s form) for data."""
    if builtin_gsm8k(spec, data_path):
        return gsm8k.REWARDS[gsm8k_format][0]
    if spec is None:                       # no data either: the built-in copy task's
        import tiny
        return tiny.copy_reward
    module, colon, name = spec.partition(":")
    if not colon or not module or not name:
        mod, fn = spec.rsplit(".", 1) if not colon and "." in spec.strip(".") else (module, name)   # a.fn: a:fn
        raise ValueError(f"--reward {spec}: give module:function (e.g. --reward={mod or 'mymod'}:"
                         f"{fn or 'reward'}), the function called as f(response, answer) -> float")
    try:
        mod = importlib.import_module(module)
    except SystemExit as e:                # sys.exit at import would end the run without a word
        raise ValueError(f"--reward {spec}: importing {module} called sys.exit({e.code!r}); a reward module must not "
                         f"exit: remove the call (or guard it with if __name__ == '__main__')") from None
    except Exception as e:                 # noqa: BLE001 - the module's own code runs here: NameError, SyntaxError, ...
        if isinstance(e, ModuleNotFoundError) and f"{module}.".startswith(f"{e.name}."):
            raise ValueError(f"--reward {spec}: cannot load it ({e}); "
                             f"give module:function with the module on PYTHONPATH") from None
        raise ValueError(f"--reward {spec}: importing {module} failed with {type(e).__name__}: "   # a SyntaxError's
                         f"{(str(e).splitlines() or [''])[0][:200]}; fix {module} "       # text names file and line
                         f"(python -c 'import {module}' shows the traceback)") from None
    fn = getattr(mod, name, None)
    if fn is None:
        raise ValueError(f"--reward {spec}: cannot load it (module {module} has no {name!r}); "
                         f"name a function that {module} defines")
    if not callable(fn):
        raise ValueError(f"--reward {spec}: {name} is a {type(fn).__name__}, not a function")
    return fn


def reward_name(spec: str | None, data_path: str | None, gsm8k_format: str = "strict") -> str:
    """How errors and the set-up name the reward: the --reward spec, or which built-in one."""
    if spec or data_path is None:
        return spec or "tiny.copy_reward (built in: the copy task)"
    return gsm8k.REWARDS[gsm8k_format][1]


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
        except SystemExit as e:            # sys.exit inside it: a failed reward, not the run's silent end
            value, bad = 0.0, f"called sys.exit({e.code!r})"
        if bad is not None:
            errors.append(f"reward {name} {bad} for the response {_short(response)} (answer "
                          f"{_short(answer)}); a reward must return a finite number")
            value = 0.0
        scores.append(float(value))
    return scores, errors


def score_rollout(reward_fn, name: str, tokenizer, batch: dict, answers: list[str]) -> tuple[list, list, list]:
    """The reward stage: each response decoded up to its mask (its EOS) and scored against its
    answer (`score`: the scores, and a message per sample whose reward failed), and the texts."""
    lengths = batch["response_mask"].sum(-1).tolist()
    texts = tokenizer.batch_decode([r[:int(k)] for r, k in zip(batch["responses"].tolist(), lengths)],
                                   skip_special_tokens=True)
    return (*score(reward_fn, name, texts, answers), texts)


class EveryRank(ValueError):
    """An error every rank raises at the same point (after an all-reduce): the run keeps its weights (a
    collective save) before it stops."""


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
            raise EveryRank(f"{message} (--reward_error=zero scores such samples 0 and counts them instead)")
        warned.add("reward")
        if not dist.is_initialized() or dist.get_rank() == 0:
            print(f"[warn] {n} rewards failed this step and scored 0 (reward/errors counts them; shown once): "
                  f"{message}", flush=True)
    return n


def fingerprint(prompts: list[list[int]], answers: list[str]) -> str:
    """A short hash of the prompt ids and answers: a resume checks it walks the same data."""
    return hashlib.sha256(json.dumps([prompts, answers]).encode()).hexdigest()[:16]
