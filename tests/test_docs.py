"""The pages name only what exists (CPU; reads the pages and the code, builds no model): every file path,
`module.function` and `--option` a markdown page writes in backticks, and every link between pages. And neither the
pages nor the code's comments and docstrings use the words of how the work was organised (`PROCESS` below: numbered
campaigns, device loans, merges): they state the fact, and bench/history/ and bench/results/ keep the diary.

    python -m pytest -q tests/test_docs.py

The pages: README.md, docs/*.md, tests/README.md, bench/README.md. The records in bench/history/ are exempt:
each says what was run on its day, with the file names, functions and options of that day.

What counts as named, in inline code and in fenced code blocks (HTML comments are not read):
- a path: a word ending in .py .md .sh .ini .txt, or one that starts with a folder of the repository (bench/,
  docs/, tests/, .ci/). It must exist from the repo root or from the page's folder (`x.py::test` and
  `x.py:42` check x.py). Words with <, $ or * are placeholders; run outputs (out/..., absolute paths) are not
  the repository's.
- `module.name` (`.member` after a class too) where module is a .py file at the root: the name is defined
  there (read from the code, nothing imported). A role's option without its dashes (`actor.param_offload`,
  `rollout.n`) counts as existing too.
- `--option`: train_grpo.py's options (options.Config, dotted by section), plan.py's own (plan.PlanConfig,
  --templates, --plot) and --help. In a command only what follows `train_grpo.py` or `plan.py` is checked:
  torchrun's, python's and pytest's flags before it are theirs, and a command that runs a bench/ script
  (`python bench/...`, `bash bench/...`, `bench_offload.py --levers`) is skipped whole, since each bench
  script has its own argparse options. An inline span that starts with `--` is ours unless it is one of
  torchrun's (TORCHRUN).
- a link [text](target): the target exists, and its #anchor is a heading of that page.
"""
import ast
import dataclasses
import glob
import io
import os
import re
import tokenize

import pytest

import options
import plan
from conftest import HERE

HISTORY = os.path.join("bench", "history")
FOLDERS = ("bench", "docs", "tests", ".ci")
EXTENSIONS = (".py", ".md", ".sh", ".ini", ".txt")
SCRIPTS = ("train_grpo.py", "plan.py")
TORCHRUN = {"--nproc_per_node", "--nnodes", "--node_rank", "--max-restarts", "--standalone", "--rdzv-backend",
            "--rdzv-endpoint", "--rdzv-id", "--master_addr", "--master_port"}
MODULES = {os.path.basename(f)[:-3] for f in glob.glob(os.path.join(HERE, "*.py"))}


def pages() -> list:
    return ["README.md", *sorted(os.path.relpath(f, HERE) for f in glob.glob(os.path.join(HERE, "docs", "*.md"))),
            os.path.join("tests", "README.md"), os.path.join("bench", "README.md")]


def read(page: str) -> str:
    with open(os.path.join(HERE, page)) as f:
        return re.sub(r"<!--.*?-->", "", f.read(), flags=re.S)


def code(text: str) -> tuple:
    """(the inline spans outside code blocks, the command lines of the fenced blocks)."""
    spans, lines, fenced = [], [], False
    for line in text.splitlines():
        if line.lstrip().startswith("```"):
            fenced = not fenced
        elif fenced:
            lines.append(line)
        else:
            spans += re.findall(r"`([^`]+)`", line)
    joined = "\n".join(lines).replace("\\\n", " ")          # a command continued over several lines is one
    return spans, [c for line in joined.splitlines() for c in re.split(r"&&|;|\|", line.split(" #")[0])]


# --------------------------------------------------------------------------- what exists
def option_names() -> set:
    out = {"--help", "--templates", "--plot"} | {f"--{f.name}" for f in dataclasses.fields(plan.PlanConfig)}
    for section, (cfg, _, _) in options.sections(options.Config()).items():
        for f in dataclasses.fields(cfg):
            if not dataclasses.is_dataclass(getattr(cfg, f.name)):
                out.add(f"--{section}.{f.name}" if section else f"--{f.name}")
    return out


def _names(body) -> dict:
    """name -> its node (a class keeps its body) for one module's or class's statements."""
    out = {}
    for n in body:
        if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            out[n.name] = n
        elif isinstance(n, ast.Assign):
            out.update({t.id: n for t in n.targets if isinstance(t, ast.Name)})
        elif isinstance(n, ast.AnnAssign) and isinstance(n.target, ast.Name):
            out[n.target.id] = n
        elif isinstance(n, (ast.Import, ast.ImportFrom)):
            out.update({(a.asname or a.name).split(".")[0]: n for a in n.names})
    return out


def defined(dotted: str) -> bool:
    """`module.name[.member...]`: the name in the module, a member in the class it names (deeper: not read)."""
    module, *attrs = dotted.split(".")
    with open(os.path.join(HERE, module + ".py")) as f:
        scope = _names(ast.parse(f.read()).body)
    for attr in attrs:
        if attr not in scope:
            return False
        node = scope[attr]
        if not isinstance(node, ast.ClassDef):
            return True
        scope = _names(node.body)
    return True


def anchors(page: str) -> set:
    """The #anchors of a page's headings, as GitHub makes them."""
    heads = re.findall(r"^#+ (.+)$", read(page), flags=re.M)
    return {re.sub(r"[^\w\- ]", "", h.strip().lower()).replace(" ", "-") for h in heads}


# --------------------------------------------------------------------------- what a page names
def paths(words) -> set:
    out = set()
    for w in words:
        w = re.split(r"::|:\d", w.strip("\"'()[],").rstrip("."))[0]
        if not w or any(c in w for c in "<$*") or w.startswith(("out/", "/", "~", "-")) or "=" in w:
            continue
        if w.endswith(EXTENSIONS) or w.split("/")[0] in FOLDERS and "/" in w:
            out.add(w)
    return out


def dotted_names(text: str) -> set:
    """module.name[.member] for the modules at the root, not inside a path or an option."""
    found = re.findall(r"(?<![\w.\-/])([a-z_][a-z0-9_]*(?:\.[A-Za-z_]\w*)+)", text)
    return {d for d in found if d.split(".")[0] in MODULES and not d.endswith(tuple(e[1:] for e in EXTENSIONS))}


def command_options(command: str) -> set:
    words = command.split()
    if any(w.startswith("bench/") or os.path.basename(w).startswith("bench_") for w in words):
        return set()                    # a bench script: its own argparse options
    scripts = [i for i, w in enumerate(words) if os.path.basename(w) in SCRIPTS]
    return {w for w in words[scripts[0] + 1:] if w.startswith("--")} if scripts else set()


def span_options(span: str) -> set:
    if any(w.endswith((".py", ".sh")) for w in span.split()):     # a command: its script says whose options
        return command_options(span)
    return {w for w in span.split() if w.startswith("--")} if span.startswith("--") else set()


def option(word: str) -> str:
    """`--actor.lr=1e-6`, `[--logger=none]`: the option's name."""
    return re.split(r"[=\[\]]", word.strip("[]`'\"),."))[0]


def named(page: str) -> dict:
    text = read(page)
    spans, commands = code(text)
    words = [w for s in spans + commands for w in s.split()]
    opts = {o for s in spans for o in span_options(s)} | {o for c in commands for o in command_options(c)}
    opts = {option(o) for o in opts}
    links = re.findall(r"\]\(([^)\s]+)\)", text)
    return {"paths": paths(words), "dotted": {d for s in spans + commands for d in dotted_names(s)},
            "options": {o for o in opts if "<" not in o and o not in TORCHRUN and o != "--"},
            "links": {ln for ln in links if not re.match(r"\w+://", ln)}}


# --------------------------------------------------------------------------- the checks
@pytest.mark.parametrize("page", pages())
def test_what_a_page_names_exists(page):
    folder, found = os.path.dirname(page), named(page)
    missing = [p for p in found["paths"]
               if not any(os.path.exists(os.path.join(HERE, base, p)) for base in ("", folder))]
    sections = {o[2:] for o in option_names()}
    undefined = [d for d in found["dotted"] if d not in sections and not defined(d)]
    unknown = sorted(found["options"] - option_names())
    assert not (missing or undefined or unknown), \
        f"{page} names what does not exist: paths {missing}, module names {undefined}, options {unknown}"


@pytest.mark.parametrize("page", pages())
def test_every_link_leads_somewhere(page):
    broken = []
    for link in named(page)["links"]:
        target, _, anchor = link.partition("#")
        path = os.path.normpath(os.path.join(os.path.dirname(page), target)) if target else page
        if not os.path.exists(os.path.join(HERE, path)):
            broken.append(link)
        elif anchor and (not path.endswith(".md") or anchor not in anchors(path)):
            broken.append(link)
    assert not broken, f"{page} links to no file or no heading: {broken}"


def test_every_page_is_read_or_a_record():
    """A new markdown file is either one of the pages above or a record in bench/history/."""
    found = {os.path.relpath(f, HERE) for f in glob.glob(os.path.join(HERE, "**", "*.md"), recursive=True)}
    found = {f for f in found if not f.startswith(("out" + os.sep, HISTORY + os.sep))}
    assert found == set(pages())


def test_the_check_sees_a_name_that_does_not_exist():
    """The reader itself: a bogus function, option and path are found, the real ones are not."""
    assert dotted_names("`actor.nonexistent` and `offload.loaded`") == {"actor.nonexistent", "offload.loaded"}
    assert not defined("actor.nonexistent") and defined("offload.loaded") and defined("model.Shapes.fused")
    assert {option(o) for o in span_options("--actor.nonexistent=1 --steps 3")} - option_names() == \
        {"--actor.nonexistent"}
    assert command_options("torchrun --nproc_per_node=2 train_grpo.py --steps=3") == {"--steps=3"}
    assert command_options("python bench/bench_step.py --variants=x") == set()
    assert paths(["tests/test_nothing.py::test_x", "out/metrics.jsonl", ".ci/run", "metrics.jsonl"]) == \
        {"tests/test_nothing.py", ".ci/run"}


# --------------------------------------------------------------------------- words of the work, not of the project
PROCESS = re.compile(r"\brounds? \d+|\bleases?\b|\bleased\b|\blanding\b|\bas on CI\b"
                     r"|\bsession'?s? (?:device|budget|time|GPU|machine)|\b(?:device|GPU|work) sessions?\b", re.I)
RECORDS = re.compile(r"\S*(?:bench/results|bench/history|history)/\S*")   # paths of the record: their names are dated


def process_words(text: str) -> list:
    """The process words of one line, its record paths (bench/results/round9/...) left out."""
    return PROCESS.findall(RECORDS.sub(" ", text))


def sources() -> list:
    """The code whose comments and docstrings are read: the roles at the top, tests/, bench/."""
    found = [glob.glob(os.path.join(HERE, folder, "*.py")) for folder in ("", "tests", "bench")]
    return sorted(os.path.relpath(f, HERE) for files in found for f in files)


def prose(path: str) -> list:
    """(line, text) of every comment and docstring line of one Python file."""
    with open(os.path.join(HERE, path)) as f:
        source = f.read()
    out = [(t.start[0], t.string) for t in tokenize.generate_tokens(io.StringIO(source).readline)
           if t.type == tokenize.COMMENT]
    for node in ast.walk(ast.parse(source)):
        body = getattr(node, "body", None)
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)) and body \
                and isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant) \
                and isinstance(body[0].value.value, str):
            out += [(body[0].lineno + i, ln) for i, ln in enumerate(body[0].value.value.splitlines())]
    return out


def process_hits(path: str, lines) -> list:
    return [f"{path}:{n}: {', '.join(words)}" for n, text in sorted(lines) for words in [process_words(text)] if words]


def test_the_pages_speak_of_the_project_not_of_how_the_work_went():
    hits = [h for page in pages() for h in process_hits(page, enumerate(read(page).splitlines(), 1))]
    assert not hits, "process words in the pages (say the fact, keep the diary in bench/history/):\n" + "\n".join(hits)


def test_the_codes_comments_and_docstrings_speak_of_the_project_not_of_how_the_work_went():
    hits = [h for path in sources() for h in process_hits(path, prose(path))]
    assert not hits, "process words in comments and docstrings (say the fact: 'measured at 7B', not 'round 11'):\n" \
        + "\n".join(hits)


def test_the_process_words_reader_knows_rounding_from_a_round():
    """What it finds and what it leaves: a round trip, rounding, all-round, pytest's session, a release, a copy
    that landed."""
    assert process_words("(round 11: 18.7 GB outlived the update) in rounds 21-24, Round 9's run") == \
        ["round 11", "rounds 21", "Round 9"]
    assert process_words("one lease, as on CI at the last landing; the session's device time") == \
        ["lease", "as on CI", "landing", "session's device"]
    assert process_words("a round trip, rounded to 0.1, all-round, round(x, 2), a pytest session, the release, "
                         "the copy landed, bench/results/round29/gpu.txt, bench/results/lease3_flat_0.5b.jsonl, "
                         "history/2026-12-04-round16-decode.md, start_new_session=True") == []
    lines = prose(os.path.join("tests", "test_docs.py"))
    assert any("a round trip" in text for _, text in lines)          # this docstring is read, and passes


def test_the_bench_page_holds_current_figures_only():
    """bench/README.md is the one home of the current figures: a section a mechanism, each its latest table, and no
    more than 300 lines; earlier tables and the stories of how they were found live in bench/history/."""
    lines = open(os.path.join(HERE, "bench", "README.md")).read().splitlines()
    assert len(lines) <= 300, f"bench/README.md is {len(lines)} lines: move what is not current to bench/history/"
