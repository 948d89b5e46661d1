"""The reward model on the CPU: its scores equal a plain forward of the same checkpoint, do not
depend on the micro-batch, the offload round trip or the number of ranks, and it reads text
through its own tokenizer when that differs from the policy's; a run with one logs its stage.

    python -m pytest tests/test_reward_model.py -q        # launches 1- and 2-process gloo runs itself
"""
import sys

import pytest
import torch
from transformers import AutoModelForSequenceClassification, Qwen2ForCausalLM, Qwen2ForSequenceClassification

import options
import reward_model
import rollout
import tiny
import launch
from model import build_mesh
from launch import init_distributed
from conftest import launches, metrics, run, tiny_batch
# the policy's characters under other ids, two role tokens, and a chat template that uses them
# ' '=4 '#'=5 '+'=6 '='=7 '9'=8 '8'=9 ... '1'=16 '0'=17
OTHER_VOCAB = ["<pad>", "<eos>", "<u>", "<a>"] + list("0123456789=+# ")[::-1]
OTHER_TEMPLATE = ("{% for m in messages %}{{ '<u>' if m['role'] == 'user' else '<a>' }}{{ m['content'] }}"
                  "{% endfor %}{{ eos_token }}")


def other_tokenizer():
    """A character tokenizer unlike the policy's (tiny.build_tokenizer): other ids, a chat template."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast
    tok = Tokenizer(models.WordLevel({t: i for i, t in enumerate(OTHER_VOCAB)}, unk_token="<pad>"))
    tok.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")
    tok.decoder = decoders.Fuse()
    t = PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", eos_token="<eos>",
                                additional_special_tokens=["<u>", "<a>"])
    t.chat_template = OTHER_TEMPLATE
    return t


def save_rm(path, tokenizer, seed: int = 0) -> str:
    """A tiny one-label Qwen2ForSequenceClassification (random weights) saved with `tokenizer`."""
    config = tiny.tiny_config()
    config.num_labels, config.vocab_size = 1, len(tokenizer)
    torch.manual_seed(seed)
    Qwen2ForSequenceClassification(config).save_pretrained(path)
    tokenizer.save_pretrained(path)
    return str(path)


@pytest.fixture(scope="module")
def rm_dirs(tmp_path_factory):
    """Two reward-model checkpoints: one with the policy's tokenizer, one with another."""
    root = tmp_path_factory.mktemp("rm")
    return {"same": save_rm(root / "same", tiny.build_tokenizer()), "other": save_rm(root / "other", other_tokenizer())}


def _build(dist_env, path, micro=16, param_offload=False, policy_tokenizer=None):
    _, world, device = dist_env
    cfg = reward_model.RewardModelConfig(path=path, micro_batch_size_per_gpu=micro, param_offload=param_offload)
    return reward_model.build(cfg, mesh=build_mesh(device, world, -1), device=device, param_dtype="float32",
                              policy_tokenizer=policy_tokenizer or tiny.build_tokenizer())


@torch.no_grad()
def _plain(path, seqs) -> tuple[torch.Tensor, torch.Tensor]:
    """The checkpoint with no FSDP, each sequence alone (no padding): (the head applied by hand to the
    trunk's output at the last token, HF's own pooled logit)."""
    plain = AutoModelForSequenceClassification.from_pretrained(path, dtype=torch.float32, local_files_only=True).eval()
    by_hand = [plain.score(plain.model(torch.tensor([s])).last_hidden_state[0, -1])[0] for s in seqs]
    hf = [plain(torch.tensor([s])).logits[0, 0] for s in seqs]
    return torch.stack(by_hand), torch.stack(hf)


def _rollout(device):
    """Two samples, "12=" -> "12<eos>" and "7=" -> "7+" (cut at the response length, no EOS)."""
    pol = tiny.build_tokenizer()
    ids = [pol(x, add_special_tokens=False)["input_ids"] for x in ("12=", "7=", "12", "7+")]
    return rollout.make_batch(ids[:2], [ids[2] + [pol.eos_token_id], ids[3]], 4, 0, 1, device)


def test_scores_equal_an_unsharded_forward(dist_env, rm_dirs):
    """Scores of a padded rollout batch (left-padded prompts, right-padded responses of varied
    lengths) through the FSDP2 reward model equal, within fp32 tolerance, the same checkpoint's
    plain forward of each sequence alone: the head at the last token, applied by hand; and HF's own
    pooled logit wherever HF pools there. Sample 0's response ends in the pad id (0), where HF's
    rule (rightmost non-pad id) reads the token before: ours still reads the last one."""
    device = dist_env[2]
    rm = _build(dist_env, rm_dirs["same"], micro=5)
    batch = tiny_batch(12, 6, device, seed=1)
    P = batch["input_ids"].shape[1] - 6
    last = int(batch["response_mask"][0].sum()) - 1
    batch["input_ids"][0, P + last] = batch["responses"][0, last] = 0   # a real token equal to the pad id
    seqs = reward_model.sequences(rm, batch)
    got = reward_model.compute_scores(rm, batch)
    by_hand, hf = _plain(rm_dirs["same"], seqs)
    assert seqs[0][-1] == 0 and len({len(s) for s in seqs}) > 2        # the pad-id case, and real padding
    assert torch.allclose(got, by_hand, rtol=1e-5, atol=1e-5), (got, by_hand)
    assert by_hand.std() > 1e-3                                          # the scores tell the samples apart
    assert abs(hf[0] - by_hand[0]) > 1e-4                                # HF's rule would read another token
    assert torch.allclose(hf[1:], by_hand[1:], rtol=1e-5, atol=1e-5)


def test_scores_do_not_depend_on_the_micro_batch(dist_env, rm_dirs):
    """1, 5 and 16 sequences per forward (each micro-batch padded to its own longest) give the same
    scores within fp32 tolerance."""
    batch = tiny_batch(12, 6, dist_env[2], seed=2)
    runs = [reward_model.compute_scores(_build(dist_env, rm_dirs["same"], micro=k), batch) for k in (1, 5, 16)]
    for other in runs[1:]:
        assert torch.allclose(runs[0], other, rtol=1e-5, atol=1e-6)


def test_offload_round_trip_changes_no_score(dist_env, rm_dirs):
    """With param_offload the shards leave at build (storages of 0 bytes), come in for the bracket,
    which gives the same scores bit for bit as a twin that never left, and leave again after it
    without a copy back (a drop, not an offload)."""
    batch = tiny_batch(8, 5, dist_env[2], seed=3)
    off = _build(dist_env, rm_dirs["same"], param_offload=True)
    assert not off.params.on_device and all(st.nbytes() == 0 for st in off.params.storages)
    m = {}
    with reward_model.resident(off, m):
        got = reward_model.compute_scores(off, batch)
    assert torch.equal(got, reward_model.compute_scores(_build(dist_env, rm_dirs["same"]), batch))
    assert not off.params.on_device and m["offload/reward_model_params/reload_gb"] > 0
    assert "offload/reward_model_params/drop_s" in m and "offload/reward_model_params/offload_gb" not in m


def test_same_tokenizer_reuses_the_rollout_ids(dist_env, rm_dirs):
    """A reward model saved with the policy's tokenizer (and a random: one, which has none) gets the
    rollout's ids as they are: each prompt without its left pads, then the response up to its EOS."""
    batch = _rollout(dist_env[2])
    for path in (rm_dirs["same"], "random:tiny"):
        rm = _build(dist_env, path)
        assert rm.tokenizer is None
        assert reward_model.sequences(rm, batch) == [[3, 4, 12, 3, 4, 1], [9, 12, 9, 13]]


def test_other_tokenizer_decodes_and_re_encodes(dist_env, rm_dirs):
    """A reward model with its own tokenizer (other ids, role tokens, a chat template) reads each
    sample as its template writes the conversation, in its own ids (written out by hand here): from
    the prompt's chat messages when given, else from the prompt decoded with the policy's tokenizer;
    the response decoded without its EOS. Its scores equal a plain forward of those ids."""
    rm = _build(dist_env, rm_dirs["other"])
    assert rm.tokenizer is not None
    batch = _rollout(dist_env[2])
    # <u> 1 2 = <a> 1 2 <eos>   and   <u> 7 = <a> 7 + <eos>
    assert reward_model.sequences(rm, batch) == [[2, 16, 15, 7, 3, 16, 15, 1], [2, 10, 7, 3, 10, 6, 1]]
    chats = [[{"role": "user", "content": "99="}], [{"role": "user", "content": "7="}]]
    seqs = reward_model.sequences(rm, batch, chats)
    assert seqs == [[2, 8, 8, 7, 3, 16, 15, 1], [2, 10, 7, 3, 10, 6, 1]]
    by_hand, _ = _plain(rm_dirs["other"], seqs)
    assert torch.allclose(reward_model.compute_scores(rm, batch, chats), by_hand, rtol=1e-5, atol=1e-5)


def test_mix_weights_the_two_rewards(dist_env):
    """weight * model + (1 - weight) * rule, by hand; both means logged."""
    rule, model = torch.tensor([1.0, 0.0]), torch.tensor([2.0, -2.0])
    m = {}
    assert reward_model.mix(rule, model, 0.25, m).tolist() == [1.25, -0.5]
    assert m == {"reward_model/score_mean": 0.0, "reward/rule_mean": 0.5}
    assert reward_model.mix(rule, model, 1.0, {}).tolist() == [2.0, -2.0]
    assert reward_model.mix(rule, model, 0.0, {}).tolist() == [1.0, 0.0]


@pytest.mark.parametrize("kw,error,expect", [
    (dict(weight=1.5), ValueError, "--reward_model.weight=1.5: must be [0, 1]"),
    (dict(micro_batch_size_per_gpu=0), ValueError, "--reward_model.micro_batch_size_per_gpu=0: must be >= 1"),
    (dict(path="/nonexistent/rm"), FileNotFoundError, "no config.json"),
    (dict(path="random:qwen9"), ValueError, "known sizes are random:tiny"),
    (dict(path="causal"), ValueError, "*ForSequenceClassification checkpoint with one label"),
])
def test_bad_config_says_what_to_change(tmp_path, kw, error, expect):
    """Each bad option raises before anything is built, with a message that names the fix: a value
    out of its range when the command line is parsed, a bad path in pre-flight."""
    if kw.get("path") == "causal":                       # a causal LM is not a reward model
        Qwen2ForCausalLM(tiny.tiny_config()).save_pretrained(tmp_path)
        kw = dict(path=str(tmp_path))
    with pytest.raises(error) as e:
        if "path" in kw:
            reward_model.check_model(reward_model.RewardModelConfig(**kw))
        else:
            options.parse_args([f"--reward_model.{k}={v}" for k, v in kw.items()])
    assert expect in str(e.value)


def test_policy_ids_beyond_its_vocabulary_are_refused(dist_env):
    """A reward model that would read the policy's ids (random:tiny, 16 ids) behind a policy
    tokenizer with more ids (18) is refused at build, with the fix named."""
    with pytest.raises(ValueError, match="smaller than the policy tokenizer's"):
        _build(dist_env, "random:tiny", policy_tokenizer=other_tokenizer())


@launches
def test_run_with_a_reward_model_logs_its_stage(tmp_path, rm_dirs):
    """train_grpo.py with a reward model of another tokenizer, offloaded, weight 0.25: every step has
    the reward_model stage's time and memory, its offload moves (in, then dropped), both reward means,
    and reward_mean = 0.25 x model mean + 0.75 x rule mean; the set-up report names its offload."""
    out = str(tmp_path / "run")
    r = run([f"--out_dir={out}", "--steps=2", "--save=false", "--train_batch_size=4", "--actor.ppo_mini_batch_size=4",
             f"--reward_model.path={rm_dirs['other']}", "--reward_model.param_offload=true",
             "--reward_model.weight=0.25"])
    assert r.returncode == 0, r.stderr[-3000:]
    for m in metrics(out):
        for k in ("time/reward_model", "mem/reward_model/peak_gb", "mem/reward_model/allocated_gb",
                  "offload/reward_model_params/reload_gb", "offload/reward_model_params/drop_s"):
            assert k in m, k
        mixed = 0.25 * m["reward_model/score_mean"] + 0.75 * m["reward/rule_mean"]
        assert abs(m["reward_mean"] - mixed) < 1e-5 and m["reward_model/score_mean"] != m["reward/rule_mean"]
    assert "[offload] reward_model.param_offload: ON" in r.stdout and "reads its own tokenization" in r.stdout


@launches
def test_two_processes_equal_one(tmp_path, rm_dirs):
    """2 gloo ranks, each holding half the parameters and scoring half the batch (3 per forward,
    re-tokenized for the other tokenizer), give the scores of 1 rank scoring all of it."""
    def launch(nproc):
        out = str(tmp_path / f"n{nproc}.pt")
        r = run([rm_dirs["other"], out], nproc, script="tests/test_reward_model.py")      # gloo on the CPU
        assert r.returncode == 0, r.stderr[-3000:]
        return [torch.load(f"{out}.rank{k}") for k in range(nproc)]
    one, two = launch(1), launch(2)
    assert torch.allclose(one[0]["scores"], torch.cat([x["scores"] for x in two]), rtol=1e-5, atol=1e-6)
    assert one[0]["shard_fraction"] == 1.0 and all(abs(x["shard_fraction"] - 0.5) < 0.01 for x in two)


def _score_my_half(path: str, out_path: str):
    """Under torchrun: this rank's half of a fixed 16-sample batch, scored; saved per rank."""
    rank, world, device = init_distributed()
    rm = _build((rank, world, device), path, micro=3)
    full = tiny_batch(16, 5, device, seed=4)
    n = 16 // world
    scores = reward_model.compute_scores(rm, {k: v[rank * n:(rank + 1) * n] for k, v in full.items()})
    whole = 4 * sum(p.numel() for p in rm.model.parameters())         # fp32 bytes of the full model
    torch.save({"scores": scores, "shard_fraction": rm.params.nbytes / whole}, f"{out_path}.rank{rank}")
    launch.leave()                   # barrier, destroy, exit without the interpreter's teardown


if __name__ == "__main__":
    _score_my_half(sys.argv[1], sys.argv[2])
