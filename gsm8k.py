"""The built-in GSM8K reward: the number a response gives, read in the asked form (`#### N`) or in any form, and the
rewards --gsm8k_format picks from them.

    python -m pytest -q tests/test_answers.py tests/test_val.py -k "gsm8k or form or answer"

A user's reward replaces all of it (--reward=module:function); these are what a run without one scores GSM8K with,
and what validation reports beside any reward: both forms' accuracy and how the answers were written.
"""
import re
from decimal import Decimal, InvalidOperation
from fractions import Fraction

import answer_value

# A number as people write it: a sign, a `$`, thousands commas, decimals ("-$1,234.50", "18.", "3.0").
NUMBER = r"-?(?:\$\s?)?-?\d[\d,]*(?:\.\d+)?"


def number(text: str | None) -> Decimal | None:
    """`text` as a number (commas, `$`, spaces and a trailing period dropped), or None: so "1,000",
    "$1000." and "1000.00" are all 1000 (Decimal compares by value)."""
    if text is None:
        return None
    t = text.replace(",", "").replace("$", "").replace(" ", "").rstrip(".")
    try:
        return Decimal(t) if re.fullmatch(r"-?\d+(\.\d+)?", t) else None
    except InvalidOperation:
        return None


def gsm8k_answer(response: str, form: str) -> Decimal | Fraction | None:
    """The answer a response gives, read as `form` says: strict, the number after its last `####` (the
    form GSM8K's own answers end with, and verl's strict rule); flexible, the value of its final answer as
    answer_value.final reads it: the last `\\boxed{}` (what instruct models write), else the last `#### N`, else
    "the answer is N", else the last number (verl's flexible rule); a percentage as written (50% -> 50)."""
    if form == "strict":
        found = re.findall(r"####\s*(" + NUMBER + ")", response)
        return number(found[-1]) if found else None
    got = answer_value.final(response)
    return None if got is None else got.number


def gsm8k_truth(answer: str) -> Decimal | None:
    """The number a GSM8K answer ends with (after its `####`; a bare number also works)."""
    return number(answer.split("####")[-1].strip())


def gsm8k_reward(response: str, answer: str) -> float:
    """1.0 when the response's last `#### <number>` equals the answer's number, else 0.0 (strict)."""
    got = gsm8k_answer(response, "strict")
    return float(got is not None and got == gsm8k_truth(answer))


def gsm8k_flexible_reward(response: str, answer: str) -> float:
    """1.0 when the value of the response's final answer equals the value after the answer's `####`, else 0.0.
    The final answer, the first of (answer_value.final): the last `\\boxed{}`, read whole; the last `#### N` line
    that is one value; the last "the answer is N"; the last number in the text. Values compare exactly (3/4,
    \\frac{3}{4} and 0.75 are one value; 18.0 == 18); a percentage matches its number or its hundredth (50%:
    50 or 0.5); an answer that is not one number (\\boxed{x+2}, the list 1,2,3) scores 0."""
    truth = answer_value.value(answer.split("####")[-1])
    return float(answer_value.same(answer_value.final(response), truth))


def gsm8k_both_reward(response: str, answer: str) -> float:
    """The mean of the two forms: the right value read flexibly earns 0.5, and written as asked (`#### N`) 1.0.
    So a model that answers in its own form (`\\boxed{}`) is paid for the number from its first step, while
    the asked form stays worth learning: strict's signal is zero until the form appears, flexible's never asks
    for it (measured on a 0.5B instruct model: bench/README.md, what GRPO does to a real model)."""
    return 0.5 * (gsm8k_reward(response, answer) + gsm8k_flexible_reward(response, answer))


FORM_BONUS = 0.2   # --gsm8k_format=bonus: what ending in the asked form is worth, right or wrong


def ends_in_form(response: str) -> bool:
    """The response ends with `#### N` (the asked form, as GSM8K's own answers end): a markdown heading such as
    `#### 2. The total` inside the text is not the form."""
    return re.search(r"####\s*" + NUMBER + r"\.?$", response.strip()) is not None


def gsm8k_bonus_reward(response: str, answer: str) -> float:
    """The right value 0.8 and ending in the asked form 0.2, apart: so a sample that writes `#### N` earns more than
    one that does not whether or not its number is right. Under the both-forms reward the many wrong `####`
    samples score 0 beside right `\\boxed{}` ones and the form can die out; here it is paid on its own. Ending in the
    form commits the answer: the value is then the one after the last `####` (a right `\\boxed{}` followed by a
    wrong `#### N` earns the form only), else the flexible reading."""
    if ends_in_form(response):
        return FORM_BONUS + (1 - FORM_BONUS) * gsm8k_reward(response, answer)
    return (1 - FORM_BONUS) * gsm8k_flexible_reward(response, answer)


# --gsm8k_format: each built-in reward and how the set-up names it
REWARDS = {
    "strict": (gsm8k_reward, "gsm8k.gsm8k_reward (built in, strict: the last #### number)"),
    "flexible": (gsm8k_flexible_reward, "gsm8k.gsm8k_flexible_reward (built in, flexible: the value of the last "
                                        "\\boxed{}, else of #### N, else of 'the answer is N', else the last number)"),
    "both": (gsm8k_both_reward, "gsm8k.gsm8k_both_reward (built in, both forms: 0.5 for the right value in any form, "
                                "1 for it after ####)"),
    "bonus": (gsm8k_bonus_reward, f"gsm8k.gsm8k_bonus_reward (built in, the value and the form apart: "
                                  f"{1 - FORM_BONUS:g} for the right value, {FORM_BONUS:g} for ending in #### N)"),
}


def found_forms(responses: list[str]) -> dict:
    """How many responses write `####` (strict's form), a `\\boxed{}`, any number: what the reward stage reports
    beside a reward it has already scored."""
    return {"found_strict": float(sum(gsm8k_answer(r, "strict") is not None for r in responses)),
            "found_boxed": float(sum(answer_value.last_boxed(r) is not None for r in responses)),
            "found_number": float(sum(bool(re.search(r"\d", r)) for r in responses))}


def answer_forms(responses: list[str], answers: list[str]) -> dict:
    """How a set of responses answered, summed (validate.py turns them into shares): how many each form scores
    right, and `found_forms`."""
    return {"strict": float(sum(gsm8k_reward(r, a) for r, a in zip(responses, answers))),
            "flexible": float(sum(gsm8k_flexible_reward(r, a) for r, a in zip(responses, answers))),
            **found_forms(responses)}
