"""One process group for the whole pytest session: torchrun's (several ranks) or a 1-process one."""
import pytest
import torch

import train_grpo


@pytest.fixture(scope="session")
def dist_env():
    """(rank, world, device) with the default process group initialised."""
    return train_grpo.init_distributed()


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
