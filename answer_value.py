"""The answer a response gives, read as its value: what the built-in GSM8K reward's flexible form compares.

    python -m pytest -q tests/test_answers.py

Instruct models write answers in LaTeX and with fractions (`\\boxed{\\frac{1}{2}}`, `2^{10}`, `3/4`, `50\\%`,
`1{,}234`, `18 \\text{ dollars}`). Read as "the last number", each of them is a number out of the middle of the
answer (2, 10, 4), and a run trained on that reward is paid for wrong answers. Here an answer is read whole, as
one exact value (`fractions.Fraction`: 18.0 == 18 and .5 == 1/2 exactly), or not at all: `\\boxed{x+2}` and the
list `1,2,3` read as no number (the reward scores them 0), never as 2 or 123.

Which part of a response is its answer (`final`), the first of:
1. the last complete `\\boxed{...}`, read whole (a box that holds no single value reads as none);
2. the last `#### N` whose line is one value (GSM8K's own form: `#### 18`, `#### $18.00`, `#### 18 dollars`);
3. the last "the answer is N" (also `answer: N`, `final answer = N`) whose N is one value followed by words or
   the end (not `3 + 4 = 7`);
4. the last number in the text (verl's flexible rule), unless it is a list (`1,2,3`) or closes an expression
   (`x+2`).
A `####` line or a phrase that holds no single value (`#### 18 and then 25`, `the answer is x+2`) is not an answer
of its form, and the next form is tried; a box is the model's own mark, and is read or scores 0.
"""
import re
from fractions import Fraction
from typing import NamedTuple


class Value(NamedTuple):
    """A number as written (`50%` -> 50), and whether a `%` followed it (then it also matches 50 / 100)."""
    number: Fraction
    percent: bool = False


# --------------------------------------------------------------------------- LaTeX and markdown to plain text
# (pattern, replacement), in order: what an instruct model writes around a number, reduced to the number
WRAPPER = r"\\(?:text|textbf|textrm|textit|mathrm|mathbf|mbox|operatorname)\s*\{([^{}]*)\}"   # \text{ dollars}
PLAIN = [
    ("\u2212", "-"),                                       # a typeset minus sign
    (r"\\[dt]frac", r"\\frac"),                            # \dfrac, \tfrac: \frac at another size
    (r"\{,\}", ","),                                       # 1{,}234: LaTeX's thousands comma
    (r"(\d)\\,(?=\d{3}\b)", r"\1,"),                       # 1\,234: a thin space between thousands
    (r"\\[,;:! ]|\\q?quad\b|~", " "),                      # other LaTeX spaces
    (r"\\\$", "$"), (r"\\%", "%"), (r"\\left\b|\\right\b", ""), (r"\\[()\[\]]", " "),
    (r"\^\s*\{?\s*\\circ\s*\}?", " degrees"),             # 90^\circ
    (r"\\frac\s*\{\s*([-+]?[\d.,]+)\s*\}\s*\{\s*([-+]?[\d.,]+)\s*\}", r"\1/\2"),   # \frac{1}{2} -> 1/2
    (r"\\frac\s*(\d)(\d)", r"\1/\2"),                      # \frac12
    (r"\^\s*\{\s*([-+]?\d+)\s*\}", r"^\1"),                # 2^{10} -> 2^10
    (r"\*\*|\$", ""),                                      # markdown bold; a currency sign or math delimiters
]
NESTED = 3                                 # wrappers in wrappers: \text{\textbf{\mathrm{18}}} at most
MIXED = r"([-+]?)(?<!\d)(\d{1,9})\s*\\frac\s*\{\s*(\d{1,9})\s*\}\s*\{\s*(\d{1,9})\s*\}"   # 2\frac{1}{2}: two and a half


def plain(text: str) -> str:
    """`text` with the LaTeX and markdown around its numbers taken away (`\\boxed{}` itself is kept)."""
    for _ in range(NESTED):                # \text{\textbf{18}}: wrappers unwrap from the inside out
        text = re.sub(WRAPPER, r" \1 ", text)
    text = re.sub(MIXED, lambda m: f"{m[1]}{int(m[2]) * int(m[4]) + int(m[3])}/{m[4]}", text)
    for pattern, replacement in PLAIN:
        text = re.sub(pattern, replacement, text)
    return text


# --------------------------------------------------------------------------- one number, and its value
# A run of digits and commas (its commas checked after: 1,234 is a number, 1,2,3 a list), with decimals; or .5
RUN = r"(?<![\d.,])(?:\d[\d,]*\d|\d)(?:\.\d+)?|(?<![\d.,])\.\d+"
EXPR = (rf"(?P<a>[-+]?(?:{RUN}))"                        # 18, -18, 1,234.5, .5
        rf"(?:\s*/\s*(?P<b>[-+]?(?:{RUN}))|\s*\^\s*(?P<e>[-+]?\d+))?"   # 3/4, 2^10
        rf"(?P<pct>\s*%)?")                              # 50%
WORD = r"[A-Za-z][A-Za-z'/-]*(?:\s*\^\s*\d)?"                # dollars, km/h, m^2 (\text{ m}^2)
UNITS = rf"{WORD}(?:[ .]+{WORD})*"                        # words, no other number: 18 dollars per week
# one value and what may stand around it: `#### `, `x = `, units, closing punctuation (each part unambiguous, so a
# long line that is no value fails in linear time)
ONE = re.compile(rf"\s*(?:####)?\s*(?:[A-Za-z]\w*\s*=\s*)?{EXPR}\s*(?:{UNITS})?[\s.,;:!?)\"'*]*")
MAX_POWER = 100                                          # 10^100 is no GSM8K answer; 10^10^9 would not finish
MAX_DIGITS = 40                                          # nor is a number of more digits (a run-on 1111...)


def digits(run: str) -> Fraction | None:
    """A run of digits as a number: commas only between groups of three (1,234; 1,2,3 is a list: None). A run
    longer than MAX_DIGITS is no answer (and Python refuses to read one of 4,300 digits)."""
    whole = run.lstrip("+-").split(".")[0]
    if "," in whole and not re.fullmatch(r"\d{1,3}(?:,\d{3})+", whole) or len(run) > MAX_DIGITS:
        return None
    return Fraction(run.replace(",", ""))


def read(m: re.Match) -> Value | None:
    """The value of one EXPR match (a fraction, a power or a percentage read whole), or None (a list, a zero
    denominator, a power too large to be an answer)."""
    a = digits(m["a"])
    if a is None:
        return None
    if m["b"] is not None:
        b = digits(m["b"])
        if not b:
            return None
        a = a / b
    elif m["e"] is not None:
        e = int(m["e"])
        if abs(e) > MAX_POWER or a == 0 and e < 0:
            return None
        a = a ** e
    return Value(a, m["pct"] is not None)


def value(text: str | None) -> Value | None:
    """`text` read whole as one value, with the words and signs people write around a number (`$18.00`,
    `18 dollars.`, `\\frac{1}{2}`, `50\\%`, `x = 5`), or None when it is not exactly one number."""
    if text is None:
        return None
    m = ONE.fullmatch(plain(text))
    return read(m) if m else None


def same(got: Value | None, truth: Value | None) -> bool:
    """The two values are equal (exactly: 18.0 == 18); a percentage also equals its hundredth (50% and 0.5)."""
    if got is None or truth is None:
        return False
    return got.number == truth.number or got.percent and got.number / 100 == truth.number


# --------------------------------------------------------------------------- which part of a response is its answer
def last_boxed(text: str) -> str | None:
    """The contents of the last `\\boxed{...}` (braces inside it balanced), or None."""
    start = text.rfind("\\boxed{")
    if start < 0:
        return None
    depth, i = 1, start + len("\\boxed{")
    for j in range(i, len(text)):
        depth += {"{": 1, "}": -1}.get(text[j], 0)
        if depth == 0:
            return text[i:j]
    return None                            # cut off before its closing brace


PHRASE = re.compile(r"\banswer\s*(?:is|:|=|would be|will be|should be)\s*:?\s*", re.I)
AFTER_PHRASE = re.compile(EXPR + r"(?=\s*(?:$|[A-Za-z.,;:!?)\"']))")   # its number, then words or punctuation
CLOSES = re.compile(r"[A-Za-z)](?:\s*[+*/^]\s*|-|\s*-\s+)$")   # x+2, (a) * 3, x-2, x - 2 (not "is -8")


def final(response: str) -> Value | None:
    """The value of the response's answer (the order: the module docstring), or None: no answer, or one that is
    not a single number."""
    boxed = last_boxed(response)
    if boxed is not None:
        return value(boxed)
    text = plain(response)
    for line in reversed(re.findall(r"####[ \t]*([^\n]*)", text)):
        got = value(line)
        if got is not None:
            return got
    for phrase in reversed(list(PHRASE.finditer(text))):
        m = AFTER_PHRASE.match(text, phrase.end())
        if m:
            return read(m)
    found = list(re.finditer(EXPR, text))
    if not found:
        return None
    last = found[-1]                       # what comes before its digits, its sign included: x-2 ends x - 2
    before = text[max(0, last.start() - 40):last.start() + (1 if last["a"][0] in "+-" else 0)]
    if CLOSES.search(before):
        return None
    return read(last)
