"""The house's shape (CPU, reads the code): each role's copy set imports from a folder holding only its
files, the README's tables of who moves what and of the copy sets are the code's, and the limits hold
(files up to 550 lines, functions up to 45 lines and 7 positional parameters, no import circle).

    python -m pytest -q tests/test_shape.py
"""
import ast
import os
import shutil
import subprocess
import sys

import pytest

import copy_set

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


@pytest.mark.parametrize("role", ["ref", "actor", "critic", "reward_model", "rollout", "offload"])
def test_each_role_imports_from_its_copy_set_alone(role, tmp_path):
    """The files copy_set names are all a role needs: copied alone into a folder, it imports and its
    config builds (the embedded default's shape comes from model.py: tiny.py is not needed)."""
    for f in copy_set.copy_set(role):
        shutil.copy(os.path.join(HERE, f + ".py"), tmp_path)
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    code = f"import {role}, sys; assert all(not m.startswith('{HERE}') for m in sys.path)"
    if role == "ref":
        code += "; import model; assert model.hf_config(None).vocab_size == 16; ref.RefConfig()"
    r = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr[-2000:]


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


def test_readme_copy_sets_are_the_codes():
    """README's copy-set table: each role's files as copy_set finds them, and its lines within 5 %;
    ref.py's set stays under 1,300 lines."""
    rows = _readme_table("Copying one role into your code")
    assert rows
    for role, files, lines in rows:
        name = role.strip("`")[:-3]
        assert files.strip("`").split() == [f + ".py" for f in copy_set.copy_set(name)], role
        actual = sum(map(copy_set.lines, copy_set.copy_set(name)))
        assert abs(int(lines.replace(",", "")) - actual) <= 0.05 * actual, (role, lines, actual)
    assert sum(map(copy_set.lines, copy_set.copy_set("ref"))) <= 1300


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


def test_the_limits_hold():
    """Every source file up to 550 lines; every function up to 45 lines and 7 positional parameters
    (keyword-only ones are not counted); no file imports itself through others."""
    assert {m: copy_set.lines(m) for m in copy_set.modules() if copy_set.lines(m) > 550} == {}
    assert [w for w, n in _functions() if n.end_lineno - n.lineno + 1 > 45] == []
    assert [w for w, n in _functions() if len(n.args.posonlyargs + n.args.args) > 7] == []
    circles = [m for m in copy_set.modules() if any(m in copy_set.copy_set(d) for d in copy_set.imports(m))]
    assert circles == []
