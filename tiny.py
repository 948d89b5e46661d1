"""The embedded default: a tiny Qwen2 policy, a character tokenizer and a copy task, all built in code.

Nothing here reads a file or touches a hub, so `python train_grpo.py` runs on a fresh machine.
    python tiny.py          # prints the model size, a few task items and a random policy's reward

The task: the prompt is a few digits and '=', the answer is the same digits ("391=" -> "391"); 100 of
the 1,000 three-digit strings are held out of training (`held_out`): the embedded run validates on them.
The reward is the fraction of answer positions the response gets right, so a random policy
over the 16-token vocabulary earns about 1/16 per position and learning shows as a rising mean.
The tokenizer knows 14 characters: real text given to the embedded model is said at start, with the share that
vanishes, and refused when nearly nothing of the prompts is left (`check_text`).
"""
import os
import random

import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, Regex
from transformers import PreTrainedTokenizerFast, Qwen2ForCausalLM

import model

PAD, EOS = "<pad>", "<eos>"
VOCAB = [PAD, EOS] + list("0123456789") + list("=+# ")  # 16 tokens; pad id 0, eos id 1


def build_tokenizer() -> PreTrainedTokenizerFast:
    """One token per character; decode joins characters with nothing in between."""
    tok = Tokenizer(models.WordLevel({t: i for i, t in enumerate(VOCAB)}, unk_token=PAD))
    tok.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")
    tok.decoder = decoders.Fuse()
    return PreTrainedTokenizerFast(tokenizer_object=tok, pad_token=PAD, eos_token=EOS,
                                   padding_side="left")


# The characters the tokenizer knows; any other becomes the pad token, which the model never sees as text.
KNOWN = frozenset(VOCAB[2:])
# Refused when fewer than this share of the prompts' characters (spaces aside) are known: what is left is numbers
# out of their sentences (a GSM8K file keeps 3-5 %: its digits), nothing a policy can read a task from. The copy
# task keeps all of them; an --instruction in words is said, not refused: the prompts themselves are whole.
MIN_KNOWN = 0.1


def unknown(text: str) -> tuple[int, int]:
    """(characters of `text` the tokenizer does not know, characters), whitespace aside."""
    chars = [c for c in text if not c.isspace()]
    return sum(c not in KNOWN for c in chars), len(chars)


def seen(text: str) -> str:
    """`text` as the model reads it through this tokenizer: the characters it knows, in place."""
    return "".join(c for c in text if c in KNOWN)


def check_text(model_path: str | None, instruction: str, data: tuple):
    """The embedded tokenizer (no --model folder) on real text: a warning, once (rank 0), with the share of the
    prompts' characters and of --instruction's it drops and what to pass; a ValueError when fewer than MIN_KNOWN
    of the prompts' characters are left. `data`: data.run_data's (training, held-out or None), whose chats
    hold each prompt's messages with the instruction appended."""
    import model
    if model.is_dir(model_path):
        return
    chats = data[0][2] + (data[1][2] if data[1] else [])
    texts = [" ".join(m["content"] for m in msgs if isinstance(m.get("content"), str)) for msgs in chats]
    (lost, total), (i_lost, i_total) = map(sum, zip(*map(unknown, texts))), unknown(instruction)
    lost, total = lost - len(texts) * i_lost, total - len(texts) * i_total   # the prompts' own characters
    if not lost and not i_lost:
        return
    said = f"--model={model_path}" if model_path else "the embedded default model"
    if total and lost > (1 - MIN_KNOWN) * total:
        raise ValueError(f"{said} reads text with a tokenizer of 14 characters (digits, '=+#' and space): "
                         f"{lost / total:.0%} of the prompts' characters are none of them and vanish (the first reads "
                         f"{seen(texts[0])[:60]!r}); pass --model=<a Hugging Face model folder> to train on this data")
    parts = ([f"{lost / total:.1%} of the prompts' characters"] if lost else []) + (
        [f"{i_lost} of --instruction's {i_total} characters"] if i_lost else [])
    if int(os.environ.get("RANK", 0)) == 0:
        print(f"[data] warning: {said} has a tokenizer of 14 characters (digits, '=+#' and space): "
              f"{' and '.join(parts)} (spaces aside) are none of them and vanish unseen (the first prompt reads "
              f"{seen(texts[0])[:60]!r}); pass --model=<a Hugging Face model folder> for text", flush=True)


def tiny_config():
    """About 3.2M parameters: 4 layers, hidden 256, grouped-query attention (4 heads, 2 KV heads)."""
    return model.size_config("tiny")


def build_tiny_model(seed: int = 0) -> Qwen2ForCausalLM:
    """Random init from `seed`, so every rank (and the reference policy) builds the same weights."""
    torch.manual_seed(seed)
    return Qwen2ForCausalLM(tiny_config())


# Public Qwen2.5 sizes, for benchmarks with random weights (`--model=random:qwen2.5-1.5b`; model.SIZES)
QWEN25 = {k: v for k, v in model.SIZES.items() if k != "tiny"}


def qwen25_config(name: str):
    if name not in QWEN25:
        raise ValueError(f"--model=random:{name}: known sizes are {', '.join(QWEN25)}")
    return model.size_config(name)


def build_random_model(name: str, seed: int = 0) -> Qwen2ForCausalLM:
    torch.manual_seed(seed)
    return Qwen2ForCausalLM(qwen25_config(name)).float()     # fp32 master weights whatever the config says


HELD_OUT = 100                             # of the 1,000 three-digit strings, never trained on: validation's


def _held_out_strings(digits: int = 3) -> list[str]:
    """A fixed random HELD_OUT of the 10^digits strings (the same whatever the run's seed)."""
    return random.Random(12345).sample([str(i).zfill(digits) for i in range(10 ** digits)], HELD_OUT)


def copy_task(num_items: int = 4096, digits: int = 3, seed: int = 0) -> list[dict]:
    """Training items: random strings of `digits` digits, none of them held out."""
    rng, held = random.Random(seed), set(_held_out_strings(digits))
    items = []
    while len(items) < num_items:
        s = "".join(rng.choice("0123456789") for _ in range(digits))
        if s not in held:
            items.append({"prompt": s + "=", "answer": s})
    return items


def held_out(digits: int = 3) -> list[dict]:
    """The held-out items, each string once: what the embedded default validates on."""
    return [{"prompt": s + "=", "answer": s} for s in _held_out_strings(digits)]


def copy_reward(response: str, answer: str) -> float:
    """Fraction of answer positions matched by the response (extra characters cost nothing)."""
    return sum(a == b for a, b in zip(response, answer)) / len(answer)


if __name__ == "__main__":
    model, tok = build_tiny_model(), build_tokenizer()
    print(f"params: {sum(p.numel() for p in model.parameters()) / 1e6:.2f}M, vocab {len(tok)}")
    for item in copy_task(3):
        print(item, tok(item["prompt"])["input_ids"])
    rng = random.Random(0)
    guesses = ["".join(rng.choice(VOCAB[2:]) for _ in range(3)) for _ in range(4000)]
    print("random-policy reward ~", sum(copy_reward(g, i["answer"])
                                        for g, i in zip(guesses, copy_task(4000))) / 4000)
