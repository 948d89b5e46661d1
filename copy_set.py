"""What copying one role into your own code takes: the role's file and every project file it imports, at any
depth (function-level imports included), with their lines. Reads the code; runs nothing.

    python copy_set.py                 # every role
    python copy_set.py ref critic      # the files to copy for those roles, and their lines (ref.py works too)
    python -m pytest -q tests/test_shape.py  # each set builds its role and calls it from a folder of its files alone
"""
import ast
import glob
import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
ROLES = ("ref", "actor", "critic", "reward_model", "rollout", "rollout_async", "rollout_engine", "offload")


def modules() -> set:
    """The project's own modules (test files and conftest excluded)."""
    return {os.path.basename(f)[:-3] for f in glob.glob(os.path.join(HERE, "*.py"))
            if not os.path.basename(f).startswith("test_") and not f.endswith("conftest.py")}


def imports(name: str) -> set:
    """The project modules `name` imports directly: anywhere in the file (ast.walk), a function body's too."""
    with open(os.path.join(HERE, name + ".py")) as f:
        tree = ast.parse(f.read())
    out = set()
    for n in ast.walk(tree):
        if isinstance(n, ast.Import):
            out |= {a.name.split(".")[0] for a in n.names}
        elif isinstance(n, ast.ImportFrom) and n.module and not n.level:
            out.add(n.module.split(".")[0])
    return out & modules() - {name}


def copy_set(name: str) -> list:
    """`name` and everything it reaches, sorted (the role first)."""
    seen, todo = set(), [name]
    while todo:
        m = todo.pop()
        if m not in seen:
            seen.add(m)
            todo += sorted(imports(m) - seen)
    return [name] + sorted(seen - {name})


def lines(name: str) -> int:
    with open(os.path.join(HERE, name + ".py")) as f:
        return len(f.read().splitlines())


def report(names) -> str:
    out = []
    for r in names:
        files = copy_set(r)
        out.append(f"{r}.py: {len(files)} files, {sum(map(lines, files)):,} lines: "
                   + " ".join(f"{f}.py ({lines(f)})" for f in files))
    return "\n".join(out)


def names(argv: list) -> list:
    """The roles asked for, as README's table writes them (`ref.py`) or bare (`ref`); an unknown one raises
    one line listing the roles."""
    out = [a.removesuffix(".py") for a in argv]
    unknown = [a for a, n in zip(argv, out) if n not in modules()]
    if unknown:
        raise ValueError(f"copy_set.py: no project file {', '.join(unknown)}; roles: {', '.join(ROLES)} "
                         f"(or any other file here, e.g. model)")
    return out or list(ROLES)


def main(argv: list) -> int:
    if "--help" in argv or "-h" in argv:
        print(f"usage: python copy_set.py [ROLE ...]   roles: {', '.join(ROLES)} (ref or ref.py; none: every role)\n"
              + __doc__.split("\n\n")[1].rstrip())
        return 0
    try:
        print(report(names(argv)))
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
