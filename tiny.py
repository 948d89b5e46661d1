"""The embedded default: a tiny Qwen2 policy, a character tokenizer and a copy task, all built in code.

Nothing here reads a file or touches a hub, so `python train_grpo.py` runs on a fresh machine.
    python tiny.py          # prints the model size, a few task items and a random policy's reward

The task: the prompt is a few digits and '=', the answer is the same digits ("3914=" -> "3914").
The reward is the fraction of answer positions the response gets right, so a random policy
over the 16-token vocabulary earns about 1/16 per position and learning shows as a rising mean.
"""
import random

import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, Regex
from transformers import PreTrainedTokenizerFast, Qwen2Config, Qwen2ForCausalLM

PAD, EOS = "<pad>", "<eos>"
VOCAB = [PAD, EOS] + list("0123456789") + list("=+# ")  # 16 tokens; pad id 0, eos id 1


def build_tokenizer() -> PreTrainedTokenizerFast:
    """One token per character; decode joins characters with nothing in between."""
    tok = Tokenizer(models.WordLevel({t: i for i, t in enumerate(VOCAB)}, unk_token=PAD))
    tok.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")
    tok.decoder = decoders.Fuse()
    return PreTrainedTokenizerFast(tokenizer_object=tok, pad_token=PAD, eos_token=EOS,
                                   padding_side="left")


def tiny_config() -> Qwen2Config:
    """About 3.2M parameters: 4 layers, hidden 256, grouped-query attention (4 heads, 2 KV heads)."""
    return Qwen2Config(vocab_size=len(VOCAB), hidden_size=256, intermediate_size=768,
                       num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
                       max_position_embeddings=64, tie_word_embeddings=True,
                       pad_token_id=0, eos_token_id=1, bos_token_id=1, torch_dtype="float32",
                       architectures=["Qwen2ForCausalLM"])


def build_tiny_model(seed: int = 0) -> Qwen2ForCausalLM:
    """Random init from `seed`, so every rank (and the reference policy) builds the same weights."""
    torch.manual_seed(seed)
    return Qwen2ForCausalLM(tiny_config())


# Public Qwen2.5 sizes, for benchmarks with random weights (`--model=random:qwen2.5-1.5b`): the
# memory and speed of a real checkpoint of that size, with nothing to download.
QWEN25 = {  # hidden, intermediate, layers, heads, kv heads, tied embeddings
    "qwen2.5-0.5b": (896, 4864, 24, 14, 2, True),
    "qwen2.5-1.5b": (1536, 8960, 28, 12, 2, True),
    "qwen2.5-3b": (2048, 11008, 36, 16, 2, True),
    "qwen2.5-7b": (3584, 18944, 28, 28, 4, False),
    "qwen2.5-72b": (8192, 29568, 80, 64, 8, False),   # its vocabulary is 152,064; 151,936 here (0.01 % of it)
}


def qwen25_config(name: str) -> Qwen2Config:
    if name not in QWEN25:
        raise ValueError(f"--model=random:{name}: known sizes are {', '.join(QWEN25)}")
    h, i, n, heads, kv, tied = QWEN25[name]
    return Qwen2Config(vocab_size=151936, hidden_size=h, intermediate_size=i, num_hidden_layers=n,
                       num_attention_heads=heads, num_key_value_heads=kv, max_position_embeddings=32768,
                       tie_word_embeddings=tied, eos_token_id=1, pad_token_id=0, torch_dtype="bfloat16",
                       architectures=["Qwen2ForCausalLM"])


def build_random_model(name: str, seed: int = 0) -> Qwen2ForCausalLM:
    torch.manual_seed(seed)
    return Qwen2ForCausalLM(qwen25_config(name)).float()     # fp32 master weights whatever the config says


def copy_task(num_items: int = 4096, digits: int = 3, seed: int = 0) -> list[dict]:
    rng = random.Random(seed)
    items = []
    for _ in range(num_items):
        s = "".join(rng.choice("0123456789") for _ in range(digits))
        items.append({"prompt": s + "=", "answer": s})
    return items


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
