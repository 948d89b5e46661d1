"""The pre-flight's checks of a model folder, before any process group or weight is loaded: a config, weights
that are all there (every shard an index names, each safetensors file as long as its header says, every tensor
of the model in them with the config's shape), and the layout this code shards. One line each, naming the file
and what is wrong.

    python -m pytest -q tests/test_checkpoint.py -k bad_model      # truncated weights, a missing shard, no tokenizer
"""
import json
import os

import torch

from model import check_model_path, hf_config, is_dir

WEIGHT_FILES = ("model.safetensors", "model.safetensors.index.json", "pytorch_model.bin",
                "pytorch_model.bin.index.json")
SUPPORTED = ("decoder-only causal LMs laid out as model.model.layers + model.model.norm "
             "(Qwen2/2.5/3, Llama, Mistral, Gemma and the like)")


def check_model(path: str | None, response_length: int = 0, *, weights: bool = True):
    """Before any process group or weight is loaded: a known random size, or a local directory with
    a config, weights, and the layout `shard` walks (`model.model.layers`, and `model.model.norm` for
    the shared critic head), read from a model built on the meta device (no memory), then each
    weight file whole (`check_weight_files`: their headers only); and room in its positions for
    `response_length` new tokens after a prompt. `weights` False (the planner, which predicts from
    config.json alone): the weight files are not looked for."""
    if not is_dir(path):
        check_positions(path, hf_config(path), response_length)   # an unknown size is one line
        return
    what_it_is(path)
    check_model_path(path)
    if weights and not any(os.path.isfile(os.path.join(path, f)) for f in WEIGHT_FILES):
        raise FileNotFoundError(f"--model {path}: no weights there (looked for {', '.join(WEIGHT_FILES)})")
    from transformers import AutoConfig, AutoModelForCausalLM
    from transformers.utils import logging as hf_logging
    verbosity = hf_logging.get_verbosity()
    hf_logging.set_verbosity_error()       # a BERT config's "add is_decoder=True" note is not the error
    try:
        with torch.device("meta"):
            built = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(path, local_files_only=True))
    except Exception as e:                  # noqa: BLE001 (what transformers' config checks raise varies by version)
        raise ValueError(f"--model {path}: transformers builds no causal LM from its config.json "
                         f"({type(e).__name__}: {' '.join(str(e).split())[:200]}); supported: {SUPPORTED}") from None
    finally:
        hf_logging.set_verbosity(verbosity)
    inner = getattr(built, "model", None)
    if not (hasattr(inner, "layers") and hasattr(inner, "norm")):
        raise ValueError(f"--model {path}: {type(built).__name__} has no model.model.layers / "
                         f"model.model.norm; supported: {SUPPORTED}")
    if weights:
        check_weight_files(path)           # after the layout: a GPT-2 folder is told it is one first
        check_weight_names(path, built)
    check_positions(path, built.config, response_length)


def check_positions(path: str | None, config, response_length: int):
    """A response of `response_length` tokens and a prompt of one fit the model's positions (vLLM refuses a
    longer max_model_len at its build; HF generate runs past them, with a warning)."""
    positions = getattr(config, "max_position_embeddings", None)
    if positions and response_length >= positions:
        raise ValueError(f"--rollout.response_length={response_length} leaves no room for a prompt in the "
                         f"{positions} positions of {path or 'the embedded model'} (max_position_embeddings); "
                         f"use at most {positions - 1} less the longest prompt")


def check_weight_names(path: str, built):
    """Every parameter of the model the config builds (`built`, on the meta device; tied ones once) is in the
    safetensors files with the config's shape: transformers starts a missing one at random and trains it with
    only a load report to say so, and a shape the config does not have is a traceback after the pre-flight.
    Headers only; pytorch_model.bin and quantized checkpoints are not read."""
    shards, have = _shards(path), {}
    if not shards or getattr(built.config, "quantization_config", None):
        return
    for name in shards:
        have.update({k: t["shape"] for k, t in _header(os.path.join(path, name)).items() if k != "__metadata__"})
    prefix, missing, wrong = built.base_model_prefix + ".", [], []
    for name, p in built.named_parameters():
        if ".experts." in name:            # MoE experts: transformers fuses the checkpoint's per-expert tensors
            continue
        key = name if name in have else name.removeprefix(prefix)
        if key not in have:
            missing.append(name)
        elif list(have[key]) != list(p.shape):
            wrong.append(f"{key} is {list(have[key])}, the config's {list(p.shape)}")
    if missing:
        named = ", ".join(missing[:3]) + (", ..." if len(missing) > 3 else "")
        raise ValueError(f"--model {path}: its weights lack {len(missing)} of the model's tensors ({named}), which "
                         f"transformers would start at random; copy the folder again, or use the config.json these "
                         f"weights came with")
    if wrong:
        raise ValueError(f"--model {path}: config.json does not describe these weights ({len(wrong)} shapes differ: "
                         f"{'; '.join(wrong[:2])}); use the config.json they came with")


def what_it_is(path: str, option: str = "--model"):
    """A folder without a config.json, or no folder: one line saying what `path` is instead (a run's out_dir, a
    LoRA adapter, a training checkpoint, a file, nothing) and what to pass."""
    if os.path.isfile(os.path.join(path, "config.json")):
        return
    look = {"is a file; pass the folder that holds it and its config.json": os.path.isfile(path),
            f"is a run's out_dir (no config.json); its policy is in {os.path.join(path, 'final')}":
                os.path.isfile(os.path.join(path, "final", "config.json")),
            "is a LoRA adapter (no config.json); pass the folder actor.save_merged wrote, or the base model":
                os.path.isfile(os.path.join(path, "adapter_config.json")),
            "is a training checkpoint (no config.json; --resume takes it); pass its run's final/":
                os.path.isfile(os.path.join(path, ".metadata")) or os.path.isfile(os.path.join(path, "meta.json"))}
    what = next((w for w, found in look.items() if found), None)
    if what or not os.path.exists(path):
        raise FileNotFoundError(f"{option} {path} {what}" if what else f"{option} {path}: no such directory; pass "
                                f"a local Hugging Face model directory (nothing is downloaded)")


def check_weight_files(path: str):
    """Each safetensors file of the model directory (model.safetensors, or every shard the index
    names) whole: its length is what its header describes (a truncated copy otherwise loads into a
    traceback after the pre-flight). Reads the headers only. A pytorch_model.bin is a zip archive
    whose directory sits at its end: a truncated one has none."""
    import zipfile
    shards = _shards(path)
    for name in shards:
        err = _safetensors_damage(os.path.join(path, name))
        if err:
            raise ValueError(f"--model {path}: {os.path.join(path, name)} {err}; copy it again")
    bin_ = os.path.join(path, "pytorch_model.bin")
    if not shards and os.path.isfile(bin_) and not zipfile.is_zipfile(bin_):
        with open(bin_, "rb") as f:
            zipped = f.read(2) == b"PK"        # torch.save's format since 1.6; older pickles are not checked
        if zipped:
            raise ValueError(f"--model {path}: {bin_} is truncated (its zip directory is missing); copy it again")


def _shards(path: str) -> list:
    """The safetensors files of a model folder: every shard its index names, or model.safetensors, or none."""
    index = os.path.join(path, "model.safetensors.index.json")
    if not os.path.isfile(index):
        return ["model.safetensors"] if os.path.isfile(os.path.join(path, "model.safetensors")) else []
    try:
        with open(index) as f:
            return sorted(set(json.load(f)["weight_map"].values()))
    except (ValueError, KeyError, TypeError, AttributeError) as e:
        raise ValueError(f"--model {path}: {index} is damaged ({type(e).__name__}: {e})") from None


def _header(file: str) -> dict:
    """A safetensors file's header (its tensors' names, dtypes, shapes and offsets), whole files only."""
    with open(file, "rb") as f:
        return json.loads(f.read(int.from_bytes(f.read(8), "little")))


def _safetensors_damage(file: str) -> str | None:
    """What is wrong with a safetensors file (8-byte header length, JSON header, the tensors' bytes),
    or None when its length is the one its header describes."""
    if not os.path.isfile(file):
        return "is missing (model.safetensors.index.json names it)"
    size = os.path.getsize(file)
    with open(file, "rb") as f:
        n = int.from_bytes(f.read(8), "little") if size >= 8 else -1
        if n < 2 or 8 + n > size:
            return f"is truncated or not a safetensors file ({size} bytes: its header does not fit)"
        try:
            header = json.loads(f.read(n))
            end = max((t["data_offsets"][1] for k, t in header.items() if k != "__metadata__"), default=0)
        except (ValueError, KeyError, TypeError, AttributeError, IndexError):
            return "is damaged (its header is not valid safetensors JSON)"
    if 8 + n + end != size:
        return f"is {size} bytes but its header describes {8 + n + end}: " + ("truncated" if size < 8 + n + end
                                                                             else "damaged")
    return None
