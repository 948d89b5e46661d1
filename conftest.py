"""One process group for the whole pytest session: torchrun's (several ranks) or a 1-process one."""
import os

import pytest
import torch

import actor
from model import make_layout
from launch import init_distributed


@pytest.fixture(scope="session")
def dist_env():
    """(rank, world, device) with the default process group initialised."""
    return init_distributed()


@pytest.fixture
def clean_gpu():
    """Models of earlier tests sit in reference cycles until collected: a GPU test whose figures are
    device-level starts empty (the GPU modules use it for every test)."""
    import gc
    gc.collect()
    torch.cuda.empty_cache()


def tiny_batch(B: int, R: int, device, seed: int = 0, vocab: int = 16) -> dict:
    """A random rollout batch with prompts and responses of varied lengths (some end in EOS)."""
    import rollout
    g = torch.Generator().manual_seed(seed)
    prompts = [torch.randint(2, vocab, (int(torch.randint(2, 6, (1,), generator=g)),), generator=g).tolist()
               for _ in range(B)]
    responses = [torch.randint(1, vocab, (int(torch.randint(1, R + 1, (1,), generator=g)),), generator=g).tolist()
                 for _ in range(B)]
    batch = rollout.make_batch(prompts, responses, R, pad_id=0, eos_id=1, device=device)
    mask = batch["response_mask"].float()
    batch["advantages"] = torch.randn(B, 1, generator=g).to(device) * mask
    batch["old_log_probs"] = (-torch.rand(B, R, generator=g) * 3).to(device) * mask
    batch["ref_log_probs"] = (-torch.rand(B, R, generator=g) * 3).to(device) * mask
    return batch


def mid_model(seed: int = 0):
    """The GPU tests' ~430M-parameter Qwen2 (random weights, built in code): large enough that
    allocator rounding stays far below their 5 % tolerances."""
    from transformers import Qwen2Config, Qwen2ForCausalLM
    torch.manual_seed(seed)
    cfg = Qwen2Config(vocab_size=32000, hidden_size=2048, intermediate_size=5632, num_hidden_layers=8,
                      num_attention_heads=16, num_key_value_heads=4, max_position_embeddings=512,
                      tie_word_embeddings=True, eos_token_id=1, pad_token_id=0,
                      architectures=["Qwen2ForCausalLM"])
    return Qwen2ForCausalLM(cfg)


def layout(micro: int, **actor_cfg):
    """How the default actor config runs a batch, with `micro` samples per micro-batch
    (ActorConfig fields such as remove_padding or use_dynamic_bsz overridable)."""
    import actor
    cfg = actor.ActorConfig(**actor_cfg)
    return make_layout(cfg, micro, cfg.log_prob_max_token_len_per_gpu)


# a test that starts its own processes (python or torchrun) runs once, not once per rank of a torchrun
launches = pytest.mark.skipif(int(os.environ.get("WORLD_SIZE", 1)) > 1,
                              reason="launches its own processes: run it without torchrun")
