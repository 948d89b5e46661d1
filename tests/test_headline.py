"""README.md's headline figures are the record's (CPU; reads two pages): every value in README's "Headline figures"
table is a cell, verbatim, of a table in the bench/README.md section its row links to, so a figure that bench/README.md
updates cannot stay behind in README.md, and README states no figure bench/README.md does not hold.

    python -m pytest -q tests/test_headline.py
"""
import os
import re

from conftest import HERE

HEADING = "## Headline figures"


def _read(page: str) -> str:
    with open(os.path.join(HERE, page)) as f:
        return re.sub(r"<!--.*?-->", "", f.read(), flags=re.S)


def _cells(line: str) -> list:
    return [c.strip().replace("**", "") for c in line.strip().strip("|").split("|")]


def headline_rows(readme: str) -> list:
    """(figure, value, anchor) for each row of README's headline table."""
    start = readme.index(HEADING)
    end = readme.find("\n## ", start + len(HEADING))
    rows = [ln for ln in readme[start:end if end > 0 else None].splitlines() if ln.startswith("|")][2:]
    out = []
    for ln in rows:
        figure, value, where = _cells(ln)
        link = re.search(r"\]\(bench/README\.md#([^)\s]+)\)", where)
        out.append((figure, value, link.group(1) if link else None))
    return out


def section_tables(bench: str, anchor: str) -> list:
    """The cells of every table row between the heading whose anchor this is and the next heading."""
    lines, found, cells = bench.splitlines(), False, []
    for ln in lines:
        if ln.startswith("#"):
            title = re.sub(r"^#+ ", "", ln).strip().lower()
            here = re.sub(r"[^\w\- ]", "", title).replace(" ", "-") == anchor
            if found and not here:
                break
            found = found or here
        elif found and ln.startswith("|"):
            cells += _cells(ln)
    return cells


def holds(cells: list, value: str) -> bool:
    """The value inside a cell, not as part of a longer number (18.2 is not 118.2 nor 18.25)."""
    pattern = r"(?<![\d.])" + re.escape(value) + r"(?![\d])"
    return any(re.search(pattern, c) for c in cells)


def mismatches(readme: str, bench: str) -> list:
    bad = []
    for figure, value, anchor in headline_rows(readme):
        if anchor is None:
            bad.append(f"{figure!r}: its row links to no bench/README.md section")
        elif not holds(section_tables(bench, anchor), value):
            bad.append(f"{figure!r}: {value!r} is in no table of bench/README.md#{anchor}")
    return bad


def test_every_headline_figure_is_a_cell_of_the_section_it_links_to():
    readme, bench = _read("README.md"), _read(os.path.join("bench", "README.md"))
    assert len(headline_rows(readme)) >= 5, "README.md's headline table is missing or nearly empty"
    bad = mismatches(readme, bench)
    assert not bad, "README.md's headline figures that bench/README.md does not hold:\n" + "\n".join(bad)


def test_the_check_sees_a_figure_that_moved():
    """The reader itself: a changed value, a value in another section, and a prefix of a number are all found."""
    bench = "## A\n\n| x | 0.50-0.53x | 118.2 |\n|---|---|---|\n\n## B\n\n| y | 26.0 % |\n|---|---|\n"
    row = "| fig | {} | [a](bench/README.md#{}) |"
    readme = HEADING + "\n\n| figure | value | where |\n|---|---|---|\n" + "\n".join(
        row.format(v, a) for v, a in [("0.50-0.53x", "a"), ("0.51x", "a"), ("26.0 %", "a"), ("18.2", "a"),
                                      ("26.0 %", "b")]) + "\n"
    assert [b.split(":")[1].strip() for b in mismatches(readme, bench)] == \
        ["'0.51x' is in no table of bench/README.md#a", "'26.0 %' is in no table of bench/README.md#a",
         "'18.2' is in no table of bench/README.md#a"]
