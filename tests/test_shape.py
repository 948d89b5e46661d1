"""The house's shape (CPU): each role's copy set, copied alone into a folder, builds the role on the tiny
model and makes its one call there; the README's tables of who moves what and of the copy sets are the code's;
the copy sets stay within their bounds (the frozen roles carry no optimizer, the critic no actor); and the limits
hold (files up to 500 lines, lines up to 120 characters, functions up to 45 lines and 7 positional parameters,
no import circle).

    python -m pytest -q tests/test_shape.py
"""
import ast
import glob
import os
import shutil

import pytest
import torch

import copy_set
from conftest import run, tiny_batch

HERE = copy_set.HERE
MOVERS = ("offload", "reload", "ready", "loaded", "holding")


def _readme_table(heading: str) -> list[list[str]]:
    """The rows (cells) of the first table after `heading` in README.md."""
    text = open(os.path.join(HERE, "README.md")).read()
    rows = []
    for line in text[text.index(heading):].splitlines()[1:]:
        if line.startswith("|"):
            rows.append([c.strip() for c in line.strip("|").split("|")])
        elif rows:
            break
    return [r for r in rows[2:]]              # past the header and its rule


# What a researcher writes after copying a role's set into a folder of their own: build it on the embedded
# tiny model (`--model` None) on the CPU, in a plain `python` process (no torchrun, no process group made
# by hand: model.build_mesh makes one), and make the role's one call on a tiny batch (conftest.tiny_batch).
BUILD = ("import math, sys, torch, model\n"
         "dev = torch.device('cpu')\n"
         "mesh = model.build_mesh(dev, 1, -1)\n"
         "batch = torch.load(sys.argv[1])\n"
         "mask = batch['response_mask'].bool()\n")
USE = {
    "ref": "import ref\n"
           "r = ref.build(ref.RefConfig(), model_path=None, mesh=mesh, device=dev)\n"
           "logp = ref.compute_log_probs(r, batch, temperature=1.0)\n"
           "assert logp.shape == mask.shape and (logp[mask] < 0).all() and (logp[~mask] == 0).all()\n",
    "actor": "import actor\n"
             "a = actor.build(actor.ActorConfig(), mesh=mesh, device=dev)\n"
             "stats = actor.update(a, batch, 8, 1.0, {})\n"
             "assert stats['optimizer_steps'] == 1 and math.isfinite(stats['pg_loss'])\n"
             "assert stats['delta_w_abs_mean'] > 0\n",
    # the separate critic without the actor: its forward settings default to model.ForwardSettings
    "critic": "import critic\n"
              "c = critic.build(critic.CriticConfig(), model_path=None, mesh=mesh, device=dev)\n"
              "critic.compute_values(c, batch)\n"
              "assert batch['values'].shape == mask.shape and (batch['values'][~mask] == 0).all()\n",
    # the policy's tokenizer: only its length is read when the reward model reads the policy's ids
    "reward_model": "import reward_model\n"
                    "rm = reward_model.build(reward_model.RewardModelConfig(path='random:tiny'), mesh=mesh, "
                    "device=dev, param_dtype='float32', policy_tokenizer=range(16))\n"
                    "scores = reward_model.compute_scores(rm, batch)\n"
                    "assert scores.shape == (8,) and torch.isfinite(scores).all()\n",
    "rollout": "import rollout\n"
               "policy = model.shard(model.load_model(None), mesh, dev)\n"
               "cfg = rollout.RolloutConfig(engine='hf', n=2, response_length=4)\n"
               "req = rollout.request(cfg, prompts=2, prompt_len=3, param_dtype='float32')\n"
               "engine = rollout.build(cfg, device=dev, model_path=None, config=model.hf_config(None), out_dir='.', "
               "req=req, seed=0, pad_id=0, eos_id=1)\n"
               "out = rollout.generate(engine, policy, [[2, 3, 4], [5, 6]], 0, [], {})\n"
               "assert out['responses'].shape == (4, 4) and out['response_mask'][:, 0].all()\n",
    "offload": "import offload, torch\n"   # offload.py alone: no model, no mesh
               "lin = torch.nn.Linear(4, 4)\n"
               "stash = offload.param_stash('p', lin)\n"
               "w = lin.weight.detach().clone()\n"
               "offload.offload(stash)\n"
               "assert lin.weight.untyped_storage().nbytes() == 0\n"
               "offload.reload(stash)\n"
               "assert torch.equal(lin.weight.detach(), w)\n",
}


@pytest.mark.parametrize("role", sorted(USE))
@pytest.mark.timeout(300)
def test_each_role_works_from_its_copy_set_alone(role, tmp_path):
    """The files copy_set names are all a role needs: copied alone into a folder (the working directory
    and PYTHONPATH of a plain `python`, the repo nowhere on its path), the role builds on the tiny model
    and makes its one call (ref: log-probs; actor: an update; critic: values; reward model: scores;
    rollout: HF generate; offload: a stash round trip)."""
    folder = tmp_path / "mine"
    folder.mkdir()
    for f in copy_set.copy_set(role):
        shutil.copy(os.path.join(HERE, f + ".py"), folder)
    torch.save(tiny_batch(8, 5, torch.device("cpu"), seed=1), tmp_path / "batch.pt")
    code = (f"import sys; assert not any(p.startswith({HERE!r}) for p in sys.path)\n"
            + (BUILD if role != "offload" else "") + USE[role]
            + f"assert {role}.__file__.startswith({str(folder)!r})\n")
    r = run(["-c", code, tmp_path / "batch.pt"], script=None, cwd=folder, env={"PYTHONPATH": str(folder)}, timeout=280)
    assert r.returncode == 0, r.stderr[-3000:]


def test_copy_sets_follow_imports_inside_functions(monkeypatch, tmp_path):
    """A module imported only inside a function body (`import b`, `from c import x`, at any depth) is in the
    copy set: copied without it, the role fails at the call, not at import."""
    (tmp_path / "role.py").write_text("import a\n\n\ndef f():\n    import b\n\n\nclass K:\n    def g(self):\n"
                                      "        if True:\n            from c import x\n")
    for name in "abcd":
        (tmp_path / f"{name}.py").write_text("import d\n" if name == "c" else "")
    monkeypatch.setattr(copy_set, "HERE", str(tmp_path))
    assert copy_set.imports("role") == {"a", "b", "c"}
    assert copy_set.copy_set("role") == ["role", "a", "b", "c", "d"]


# The most lines each role's copy set may hold: the frozen roles' sets carry no optimizer (adam.py) and no loss
# math (losses.py), offload.py alone is the mechanism of the moves, and no other set grows past what it was when
# AdamW's step left offload.py and model.py (actor 2,452, critic 2,852 with actor.py in it, rollout 2,295, ...).
BOUNDS = {"ref": 1200, "reward_model": 1300, "offload": 250, "actor": 2452, "critic": 2852, "rollout": 2295,
          "rollout_async": 3471, "rollout_engine": 2956}


def test_readme_copy_sets_are_the_codes():
    """README's copy-set table: each role's files as copy_set finds them, and its lines within 5 %."""
    rows = _readme_table("Copying one role into your code")
    assert rows
    for role, files, lines in rows:
        name = role.strip("`")[:-3]
        assert files.strip("`").split() == [f + ".py" for f in copy_set.copy_set(name)], role
        actual = sum(map(copy_set.lines, copy_set.copy_set(name)))
        assert abs(int(lines.replace(",", "")) - actual) <= 0.05 * actual, (role, lines, actual)


def test_each_copy_set_stays_within_its_bound():
    """Every role's copy set within BOUNDS; ref's and the reward model's hold no optimizer code and no loss
    math, the critic's no actor (what both trained roles need lives in adam.py and losses.py)."""
    assert set(BOUNDS) == set(copy_set.ROLES)
    over = {r: n for r in copy_set.ROLES if (n := sum(map(copy_set.lines, copy_set.copy_set(r)))) > BOUNDS[r]}
    assert over == {}, {r: (n, BOUNDS[r]) for r, n in over.items()}
    for frozen in ("ref", "reward_model"):
        assert {"adam", "losses", "actor", "critic"} & set(copy_set.copy_set(frozen)) == set(), frozen
    assert "actor" not in copy_set.copy_set("critic")


def _mover_callers() -> set:
    """The source files that call one of offload's movers (offload.reload(...) and the like)."""
    out = set()
    for name in copy_set.modules() - {"offload"}:
        tree = ast.parse(open(os.path.join(HERE, name + ".py")).read())
        if any(isinstance(n, ast.Call) and isinstance(n.func, ast.Attribute) and n.func.attr in MOVERS
               and isinstance(n.func.value, ast.Name) and n.func.value.id == "offload" for n in ast.walk(tree)):
            out.add(name + ".py")
    return out


def test_who_moves_what_names_every_file_that_moves_bytes():
    rows = _readme_table("## Who moves what")
    assert {r[0].strip("`") for r in rows} == _mover_callers()


def _functions():
    for name in sorted(copy_set.modules()):
        for n in ast.walk(ast.parse(open(os.path.join(HERE, name + ".py")).read())):
            if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef)):
                yield f"{name}.py:{n.name}", n


def _long_lines() -> dict:
    """{file: [line numbers]} of the lines over 120 characters in the top-level *.py, tests/*.py, bench/*.py and
    bench/*.sh (bench/history and bench/results are the record, not code)."""
    out = {}
    for pattern in ("*.py", "tests/*.py", "bench/*.py", "bench/*.sh"):
        for f in sorted(glob.glob(os.path.join(HERE, pattern))):
            with open(f) as fh:
                long = [i for i, line in enumerate(fh.read().splitlines(), 1) if len(line) > 120]
            if long:
                out[os.path.relpath(f, HERE)] = long
    return out


def test_the_limits_hold():
    """Every source file up to 500 lines; every function up to 45 lines and 7 positional parameters
    (keyword-only ones are not counted); no file imports itself through others."""
    assert {m: copy_set.lines(m) for m in copy_set.modules() if copy_set.lines(m) > 500} == {}
    assert [w for w, n in _functions() if n.end_lineno - n.lineno + 1 > 45] == []
    assert [w for w, n in _functions() if len(n.args.posonlyargs + n.args.args) > 7] == []
    circles = [m for m in copy_set.modules() if any(m in copy_set.copy_set(d) for d in copy_set.imports(m))]
    assert circles == []


def test_no_line_is_over_120_characters():
    assert _long_lines() == {}


def test_no_module_has_an_installed_packages_import_name():
    """Run from the repository root, a top-level `x.py` wins over an installed package `x`: transformers 5.25
    depends on Hugging Face's `kernels` and imports it when it builds a model, and this repository's
    `kernels.py` (now `kernel_choice.py`) broke every model import. No module here may take an installed name."""
    import importlib.metadata
    installed = importlib.metadata.packages_distributions()
    assert {m: installed[m] for m in copy_set.modules() if m in installed} == {}
