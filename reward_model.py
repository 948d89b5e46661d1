"""The reward model: a frozen sequence classifier that scores every response beside (or instead of)
the rule reward, micro-batched, in the compute dtype, FSDP2-sharded, with its own offload.

    python train_grpo.py --reward_model.path=random:tiny --steps=5      # CPU: a random tiny scorer
    torchrun --nproc_per_node=8 train_grpo.py --model=/models/Qwen2.5-1.5B-Instruct --data=gsm8k_train.parquet \
        --reward_model.path=/models/my-reward-model --reward_model.param_offload=true
    python -m pytest tests/test_reward_model.py -q               # CPU: parity, micro-batches, 2 ranks, tokenizers
    python -m pytest test_memory.py -q -k reward_model     # GPU: its offload frees its bytes

What it reads: each sample's prompt and response as the reward model's own tokenizer writes them.
When its tokenizer gives every policy token the same id and its chat template is the policy's,
the rollout's ids are reused as they are (prompt + response up to its EOS); otherwise the
response is decoded with the policy's tokenizer and the conversation (the prompt's chat
messages, the response as the assistant's turn) is rendered with the reward model's chat
template and encoded with its tokenizer.
What it returns: the classification head's value at each sequence's last token, one float per
sample, mixed with the rule reward as  weight * model + (1 - weight) * rule  (weight 1, the
default: the model alone; weight 0: the model's score is logged, not trained on).
What it holds and moves: its parameters in the compute dtype (bf16 on a GPU, fp32 on CPU),
sharded like the reference: params x 2 / world bytes per GPU in bf16. With param_offload they
live in pinned host memory and come in for its stage only (`resident`); they never change, so
they are freed after it without a copy back. Its head has one output, so its forward makes no
(B, T, vocab) logits: its activations are the trunk's alone.
"""
import os
from dataclasses import dataclass

import torch

import offload
from model import all_sum, hf_config, in_use, is_dir, load_model, shapes, shard, state


@dataclass
class RewardModelConfig:
    path: str | None = None                # local HF *ForSequenceClassification dir (one label), or random:tiny /
                                           # random:qwen2.5-<size> (random weights, benchmarks); None: rule reward only
    weight: float = 1.0                    # score = weight * model + (1 - weight) * rule reward
    micro_batch_size_per_gpu: int = 16     # sequences per forward: bounds its activations
    param_offload: bool = False            # shards to pinned host except during its stage


@dataclass
class RewardModel:
    """The reward model's state (made by `build`)."""
    cfg: RewardModelConfig
    model: torch.nn.Module
    params: offload.Stash                  # its local shards, in the compute dtype
    policy_tokenizer: object               # decodes the rollout when the reward model writes text differently
    tokenizer: object = None               # its own tokenizer when that differs; None: the rollout ids are reused


# checked when the command line is parsed (options.sections)
RANGES = {"weight": "[0, 1]", "micro_batch_size_per_gpu": ">= 1"}
SEARCH = {"param_offload": (False, True)}    # what --offload=auto may turn (plan.py)
RELIEF = {"reward_model_params": "--reward_model.param_offload=true"}


def check_model(cfg: RewardModelConfig):
    """Before anything is built: the path holds a one-label sequence classifier (reads config.json
    only), or names a known random size."""
    if not is_dir(cfg.path):
        if cfg.path is not None:
            hf_config(cfg.path, "--reward_model.path")   # an unknown size is one line
        return
    if not os.path.isfile(os.path.join(cfg.path, "config.json")):
        raise FileNotFoundError(f"--reward_model.path={cfg.path}: no config.json there; pass a local Hugging Face "
                                f"sequence-classification model directory (nothing is downloaded)")
    config = hf_config(cfg.path, "--reward_model.path")
    archs = config.architectures or []
    if not any(a.endswith("ForSequenceClassification") for a in archs) or config.num_labels != 1:
        raise ValueError(f"--reward_model.path={cfg.path}: its config names {archs} with {config.num_labels} "
                         f"labels; a reward model is a *ForSequenceClassification checkpoint with one label")


def own_tokenizer(path: str, policy_tokenizer):
    """The reward model's tokenizer when it writes text differently from the policy's (a token with
    another id, or another chat template); None when the rollout's ids can be read as they are
    (random: models have no tokenizer of their own: they read the policy's ids)."""
    if not is_dir(path):
        return None
    from transformers import AutoTokenizer
    try:
        tok = AutoTokenizer.from_pretrained(path, local_files_only=True)
    except (OSError, ValueError) as e:
        raise ValueError(f"--reward_model.path={path}: cannot load its tokenizer ({str(e).splitlines()[0]}); "
                         f"save the reward model's tokenizer in that directory") from None
    ids = tok.get_vocab()                  # the policy's ids mean the same tokens to it (extra ones allowed)
    same = all(ids.get(t) == i for t, i in policy_tokenizer.get_vocab().items()) and \
        getattr(tok, "chat_template", None) == getattr(policy_tokenizer, "chat_template", None)
    return None if same else tok


def build(cfg: RewardModelConfig, *, mesh, device, param_dtype: str, policy_tokenizer, seed: int = 0,
          model: torch.nn.Module | None = None) -> RewardModel:
    """Load (or take `model`, an HF sequence classifier already built, fp32), cast to the compute
    dtype on a GPU, shard like the reference; with param_offload the shards leave the GPU at once."""
    model = model if model is not None else load_model(cfg.path, seed, head="score")
    if not hasattr(getattr(model, "model", None), "layers"):   # shard wraps model.model.layers
        raise ValueError(f"--reward_model.path={cfg.path}: {type(model).__name__} has no model.layers to shard; "
                         f"use a Llama/Qwen-style sequence classifier")
    model.requires_grad_(False).eval()     # no grads, no optimizer: params are all it holds
    # Pooling: HF's sequence classifiers read the head at the rightmost token whose id is not
    # config.pad_token_id, which skips a last token equal to the pad id (an EOS where eos == pad, as
    # in Qwen2.5 base tokenizers). Our micro-batches are left-padded (`left_pad`: the attention mask
    # hides the pads), so every sequence's last token sits at the last position; an id that matches
    # no token makes HF read exactly there. Set after construction: the embedding's padding_idx is
    # fixed at init and nothing else in the forward reads this id.
    model.config.get_text_config().pad_token_id = -1     # (the config itself for Qwen2 / Llama)
    tokenizer = own_tokenizer(cfg.path, policy_tokenizer) if cfg.path is not None else None
    if tokenizer is None and model.config.vocab_size < len(policy_tokenizer):
        raise ValueError(f"--reward_model.path={cfg.path}: it reads the policy's token ids, but its vocabulary "
                         f"({model.config.vocab_size}) is smaller than the policy tokenizer's "
                         f"({len(policy_tokenizer)}); use a reward model with its own tokenizer or a larger vocabulary")
    if device.type == "cuda":
        model.to(getattr(torch, param_dtype))   # frozen: kept in the compute dtype (bf16: half of fp32)
    model = shard(model, mesh, device, False, param_dtype)
    rm = RewardModel(cfg, model, offload.param_stash("reward_model_params", model, enabled=cfg.param_offload),
                     policy_tokenizer, tokenizer)
    offload.offload(rm.params)             # param_offload: frees params x 2 / world bytes until its first stage
    return rm


def describe(rm: RewardModel) -> list[str]:
    """The run's set-up report: size, what it reads, how its score is mixed, its offload flag."""
    n = sum(p.numel() for p in rm.model.parameters())
    reads = "the rollout's token ids as they are" if rm.tokenizer is None else \
        "its own tokenization (response decoded, conversation re-rendered with its chat template)"
    w = rm.cfg.weight
    unused = " (the model's score is logged, not trained on)" if w == 0 else ""
    return [f"[reward_model] {rm.cfg.path}: {n / 1e6:.1f}M parameters; reads {reads}; "
            f"score = {w:g} x model + {1 - w:g} x rule{unused}",
            offload.describe("reward_model.param_offload", rm.params.nbytes, rm.cfg.param_offload,
                             rm.params.views[0].device)]


def ignored(cfg: RewardModelConfig) -> list[str]:
    """The set-up report's warning when no reward model is built and its other options were set."""
    return ["[reward_model] warning: no --reward_model.path: the other reward_model options have no effect"] \
        if cfg.param_offload or cfg.weight != 1.0 else []


# --------------------------------------------------------------------------- inputs
def render(tokenizer, chat: list[dict], response: str) -> list[int]:
    """The conversation as the reward model's tokenizer writes it: its chat template over the
    prompt's messages + the response as the assistant's turn; without a template, the prompt's
    text followed by the response (as data.py writes a prompt for a policy without one)."""
    if getattr(tokenizer, "chat_template", None):
        text = tokenizer.apply_chat_template(chat + [{"role": "assistant", "content": response}], tokenize=False)
    else:
        text = "\n".join(m["content"] for m in chat) + response
    return tokenizer(text, add_special_tokens=False)["input_ids"]   # the template wrote any BOS itself


def sequences(rm: RewardModel, batch: dict, chats: list | None = None) -> list[list[int]]:
    """Each sample's prompt + response in the reward model's token ids, no padding. `chats`: the
    prompt's chat messages per sample, or per prompt (each stands for its group's consecutive
    samples); None: the prompt is decoded from the rollout as one user message. Used only when the
    reward model has its own tokenizer."""
    P, B = batch["input_ids"].shape[1] - batch["responses"].shape[1], batch["input_ids"].shape[0]
    out = []
    for i, (ids, keep) in enumerate(zip(batch["input_ids"].tolist(), batch["attention_mask"].tolist())):
        prompt = [t for t, k in zip(ids[:P], keep[:P]) if k]        # left pads out
        response = [t for t, k in zip(ids[P:], keep[P:]) if k]      # up to and including its EOS
        if rm.tokenizer is None:
            out.append(prompt + response)
            continue
        pt = rm.policy_tokenizer
        chat = chats[i * len(chats) // B] if chats else \
            [{"role": "user", "content": pt.decode(prompt, skip_special_tokens=True)}]
        out.append(render(rm.tokenizer, chat, pt.decode(response, skip_special_tokens=True)))
    return out


def left_pad(seqs: list[list[int]], device) -> tuple:
    """(B, T) input ids, attention mask and position ids with every sequence's last token at T-1.
    Position ids count real tokens only, so a padded row sees the positions it would alone."""
    T = max(map(len, seqs))
    ids = torch.zeros(len(seqs), T, dtype=torch.long)   # pad id 0: any id does, the mask hides the pads
    mask = torch.zeros_like(ids)
    for i, s in enumerate(seqs):
        ids[i, T - len(s):] = torch.tensor(s)
        mask[i, T - len(s):] = 1
    pos = (mask.cumsum(-1) - 1).clamp(min=0)
    return ids.to(device), mask.to(device), pos.to(device)


# --------------------------------------------------------------------------- the stage
def resident(rm: RewardModel, metrics: dict):
    """The reward_model stage's bracket: shards in, then freed (no copy back: they never change)."""
    return offload.loaded([rm.params], metrics)


@torch.no_grad()
def forward_scores(model, seqs: list[list[int]], micro_batch_size: int, device) -> torch.Tensor:
    """(B,) fp32 head values at each sequence's last token, `micro_batch_size` sequences per forward.
    Every rank runs the same number of forwards (FSDP2 all-gathers in each): same B per rank."""
    out = []
    for i in range(0, len(seqs), micro_batch_size):
        ids, mask, pos = left_pad(seqs[i:i + micro_batch_size], device)
        logits = model(input_ids=ids, attention_mask=mask, position_ids=pos, use_cache=False).logits  # (b, 1)
        out.append(logits[:, 0].float())
    return torch.cat(out)


def compute_scores(rm: RewardModel, batch: dict, chats: list | None = None) -> torch.Tensor:
    """(B,) reward-model scores of a rollout batch (inside `resident` when the shards are offloaded)."""
    return forward_scores(rm.model, sequences(rm, batch, chats), rm.cfg.micro_batch_size_per_gpu,
                          batch["input_ids"].device)


def mix(rule: torch.Tensor, model: torch.Tensor, weight: float, metrics: dict) -> torch.Tensor:
    """weight * model + (1 - weight) * rule, both (B,) as they come: GRPO's group normalisation takes
    out a scale common to a group, not the two rewards' scale against each other. Logs both means
    over all ranks."""
    s = all_sum(torch.stack([model.sum(), rule.sum(), torch.tensor(float(len(rule)), device=rule.device)])
                      .double()).tolist()
    metrics.update({"reward_model/score_mean": s[0] / s[2], "reward/rule_mean": s[1] / s[2]})
    return weight * model + (1 - weight) * rule


# --------------------------------------------------------------------------- predicted
# Its bytes in the planner's terms (predict.py composes them): per rank, `z` a model.Sizes (the policy's
# rows), `config` its own HF config; its state group as (in use, between uses, pinned host), its stage as moments.
def predicted_states(cfg: RewardModelConfig, z, config) -> dict:
    s = shapes(config)                         # the trunk and a one-label score head (no bias), compute dtype
    return {"reward_model_params": state(z.shard(s.trunk + s.hidden, z.c), cfg.param_offload)}


def predicted_stage(cfg: RewardModelConfig, z, states: dict, config) -> list:
    """Its forward of micro_batch_size_per_gpu sequences: no vocab-sized logits (one output)."""
    s, n = shapes(config), min(cfg.micro_batch_size_per_gpu, z.samples) * z.T
    return [{**in_use(states, "reward_model_params"), "gathered layers + root": s.gather(z.c),
             "forward transient": s.layer_work(n, z.c)}]
