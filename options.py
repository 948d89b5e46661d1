"""The command line's options: parsing `--section.key=value`, the range or the choices of each
(checked at parse time) and --help, all read from the config dataclasses (every default and its
comment written once, there).

    python train_grpo.py --help
    python -m pytest test_train.py -q -k "help or range or bad"

Each role file keeps RANGES and CHOICES beside its config dataclass; train_grpo.sections() lists
them with the section each belongs to.
"""
import ast
import inspect
import io
import math
import textwrap
import tokenize
import types
import typing
from dataclasses import fields, is_dataclass


def within(value, rule: str) -> bool:
    """`value` satisfies `rule`: "any" (finite), ">= a", "> a", "[a, b)" (any bracket mix), "x or RULE"."""
    if not math.isfinite(value):
        return False
    if " or " in rule:
        first, rest = rule.split(" or ", 1)
        return value == float(first) or within(value, rest)
    if rule == "any":
        return True
    if rule[0] in "[(":
        lo, hi = (float(x) for x in rule[1:-1].split(","))
        return (lo <= value if rule[0] == "[" else lo < value) and (value <= hi if rule[-1] == "]" else value < hi)
    op, bound = rule.split()
    return value >= float(bound) if op == ">=" else value > float(bound)


def check(sections: dict):
    """Every option of every section against its rule or its choices; the first outside raises,
    with the option as it is typed. `sections`: {"actor": (cfg.actor, RANGES, CHOICES), ...},
    "" for the top level."""
    for name, (obj, ranges, choices) in sections.items():
        prefix = f"{name}." if name else ""
        for key, rule in ranges.items():
            if not within(getattr(obj, key), rule):
                raise ValueError(f"--{prefix}{key}={getattr(obj, key)}: must be {rule}"
                                 + (" (a finite number)" if rule == "any" else ""))
        for key, allowed in choices.items():
            if getattr(obj, key) not in allowed:
                raise ValueError(f"--{prefix}{key}={getattr(obj, key)}: use one of {', '.join(map(str, allowed))}")


def apply(argv: list[str], cfg):
    """`cfg` (a dataclass with dataclass sections) with each `--key=value` / `--key value` of
    `argv` set, converted to the field's type; an unknown key or a value of the wrong type raises
    with what to change."""
    args = list(argv)
    while args:
        arg = args.pop(0)
        if not arg.startswith("--"):
            raise ValueError(f"unexpected argument {arg!r}; options look like --actor.lr=1e-6")
        key, eq, value = arg[2:].partition("=")
        if not eq:
            if not args:
                raise ValueError(f"--{key} needs a value")
            value = args.pop(0)
        *path, name = key.split(".")
        obj = cfg
        for part in path:
            obj = getattr(obj, part, None)
            if not is_dataclass(obj):
                names = ", ".join(f.name for f in fields(cfg) if is_dataclass(getattr(cfg, f.name)))
                raise ValueError(f"unknown option --{key}; sections: {names}")
        hints = typing.get_type_hints(type(obj))
        if name not in hints or is_dataclass(hints[name]):
            known = ", ".join(f.name for f in fields(obj) if not is_dataclass(getattr(obj, f.name)))
            raise ValueError(f"unknown option --{key}; known here: {known}")
        setattr(obj, name, _convert(value, hints[name], key))
    return cfg


def _convert(text: str, typ, key: str):
    if typ is bool:
        if text.lower() in ("1", "true", "yes", "on"):
            return True
        if text.lower() in ("0", "false", "no", "off"):
            return False
        raise ValueError(f"--{key}={text}: expected true or false")
    if typing.get_origin(typ) in (typing.Union, types.UnionType):
        return None if text.lower() in ("none", "null", "") else text
    try:
        return typ(text)
    except ValueError:
        raise ValueError(f"--{key}={text}: expected {typ.__name__}") from None


def field_comments(cls) -> dict:
    """Each field's comment in the class source (its line's, then comment-only lines under it):
    what --help prints, so every default and its explanation are written once, in the dataclass."""
    src = textwrap.dedent(inspect.getsource(cls))
    by_line = {t.start[0]: t.string.lstrip("#").strip()
               for t in tokenize.generate_tokens(io.StringIO(src).readline) if t.type == tokenize.COMMENT}
    lines = src.splitlines()
    out = {}
    for node in ast.parse(src).body[0].body:
        if isinstance(node, ast.AnnAssign):
            text, n = [by_line.get(node.lineno, "")], node.lineno + 1
            while n in by_line and lines[n - 1].lstrip().startswith("#"):   # continuation lines
                text.append(by_line[n])
                n += 1
            out[node.target.id] = " ".join(t for t in text if t)
    return out


def usage(sections: dict) -> str:
    """--help: every option with its type, range, default and comment. `sections`: as for `check`,
    built from a default config (train_grpo.sections(Config()))."""
    out = ["usage: python train_grpo.py [--key=value ...]   (or torchrun --nproc_per_node=N train_grpo.py ...)",
           "options are --key=value or --key value; a role's keys take its section: --actor.lr=1e-6", ""]
    for name, (obj, ranges, choices) in sections.items():
        out.append(f"[{name or 'run'}]")
        comments = field_comments(type(obj))
        for f in fields(obj):
            if is_dataclass(getattr(obj, f.name)):
                continue
            hint = typing.get_type_hints(type(obj))[f.name]
            kind = "str or none" if typing.get_origin(hint) in (typing.Union, types.UnionType) else hint.__name__
            rule = ranges.get(f.name) or ("|".join(map(str, choices[f.name])) if f.name in choices else "")
            out.append(f"  --{name + '.' if name else ''}{f.name}={getattr(obj, f.name)}  ({kind}"
                       f"{'; ' + rule if rule and rule != 'any' else ''})  {comments.get(f.name, '')}")
        out.append("")
    return "\n".join(out)
