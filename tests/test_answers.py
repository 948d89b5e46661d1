"""The GSM8K reward's flexible form reads an answer as its value (answer_value.py): real answers of an instruct
model with the scores checked by hand, the LaTeX and fraction forms that reading "the last number" got wrong, and
inputs that must cost little.

    python -m pytest -q tests/test_answers.py
"""
import time
from fractions import Fraction

import pytest

import answer_value
import gsm8k
from answer_value import Value

# --------------------------------------------------------------------------- real answers, scored by hand
# Held-out GSM8K answers of Qwen2.5-Coder-0.5B-Instruct (verl's "####" instruction appended) from the GRPO runs whose
# val_samples.jsonl files stand under bench/results (the source: its folder there, and its row counted from 0).
# Each excerpt is the end of a response that holds its answer, and reads as the whole response does; each score
# was checked by hand against the problem's answer. The model answers in integers, as GSM8K's answers are: money
# (`\$694`), units, `####` alone or doubled, in a box or in a code block's output, wrong, and cut off.
# (source, response excerpt, answer, flexible score, strict score)
REAL = [
    ('round15/grpo:2',
     'Thus, the distance covered by each train in the two days is:\n\\[ \\boxed{230} \\]',
     '#### 230', 1, 0),
    ('round15/grpo_async:12',
     'Therefore, the candle will be \\(\\boxed{8}\\) centimeters shorter after burning from 1:00 PM to '
     '5:00 PM.',
     '#### 8', 1, 0),
    ('round18/grpo_async:16',
     'Therefore, the total cost of the pastries is \\(\\boxed{694}\\).',
     '#### 694', 1, 0),
    ('round23/grpo_async_s1_d0:30',
     '9.0\n```\nThe final answer is \\(\\boxed{9}\\).',
     '#### 9', 1, 0),
    ('round21/grpo_async_s1:10',
     '- The total distance covered by both trains in one day is \\(80 + 150 = 230\\) miles.\n\n#### '
     'Final answer:\n\\[\n\\boxed{230}\n\\]',
     '#### 230', 1, 0),
    ('round23/grpo_async_s3_d0:10',
     '#### The distance covered by each train in the two days is \\(\\boxed{230}\\) miles.',
     '#### 230', 1, 0),
    ('round23/grpo_async_s1_d0:22',
     '#### 100\n\n[...]\n3. **Total points scored:**\n   - Sum the points from the first 20 minutes and '
     'the second 20 minutes:\n     \\[\n     4 + 5 = 9\n     \\]\n\nThus, the total points Mike scored '
     'is \\(\\boxed{9}\\).',
     '#### 9', 1, 0),
    ('round15/grpo_async:18',
     '80 miles westward + 150 miles northward = 230 miles\n#### Therefore, the distance covered by each '
     'train in the two days is:\n#### ####',
     '#### 230', 1, 0),
    ('round22/grpo_async_s1:32',
     'Therefore, the total cost is **#### \\$694**.',
     '#### 694', 1, 0),
    ('round22/grpo_async_s1:40',
     'Therefore, the final answer is:\n#### \\$694',
     '#### 694', 1, 0),
    ('round15/grpo:34',
     '   - The final answer is "#### 230 miles".\n\nThus, the distance covered by each train in the two '
     'days is \\(\\boxed{230}\\) miles.',
     '#### 230', 1, 1),
    ('round22/grpo_async_s1:48',
     'Therefore, the final answer is \\(\\boxed{####694}\\).',
     '#### 694', 1, 1),
    ('round23/grpo_async_s3_d0:42',
     '#### 230 miles\n```\nThe final answer is \\(\\boxed{230}\\).',
     '#### 230', 1, 1),
    ('round15/grpo_async:24',
     '   #### 694\n\nThis is the total cost of the pastries.',
     '#### 694', 1, 1),
    ('round21/grpo_async_s1:48',
     '   - Total cost: $204 + $160 + $330 = $694\n\n#### #### 694.00',
     '#### 694', 1, 1),
    ('round15/grpo:30',
     '   - Total points = 4 + 5 = 9\n\n#### Final answer: #### 9',
     '#### 9', 1, 1),
    ('round21/grpo_async_s1:54',
     '#### #### 9\nMike scored a total of 9 points.',
     '#### 9', 1, 1),
    ('round21/grpo_async:32',
     '   - "#### 694"\n\nThe final answer is: #### 694',
     '#### 694', 1, 1),
    ('round23/grpo_async_s3_d0:38',
     '   - The final answer is:\n     \\[\n     #### 9\n     \\]',
     '#### 9', 1, 1),
    ('round22/grpo_async_s1:75',
     '**Output the final answer after "####".**\n\n#### 6',
     '#### 6', 1, 1),
    ('round18/grpo_async:8',
     'The total cost of the pastries is \\(\\boxed{290}\\).',
     '#### 694', 0, 0),
    ('round23/grpo_async_s3_d0:15',
     'Since John cannot have a negative number of lego sets, we interpret this as he has no lego sets '
     'left. Therefore, the final answer is:\n\\[ \\boxed{0} \\]',
     '#### 2', 0, 0),
    ('round22/grpo_async_s1:13',
     'The original price of the book was \\(\\boxed{16.25}\\).',
     '#### 26', 0, 0),
    ('round21/grpo_async:21',
     'Therefore, the original price of the book was \\(\\boxed{14.625}\\).',
     '#### 26', 0, 0),
    ('round22/grpo_async_s1:17',
     'Therefore, it will take Carlos \\(\\boxed{210}\\) years before he starts earning money on the '
     'lemon tree.',
     '#### 13', 0, 0),
    ('round23/grpo_async_s3_d0:11',
     'Marissa needs to walk the remaining distance at a speed of \\(\\boxed{2}\\) miles per hour.',
     '#### 6', 0, 0),
    ('round22/grpo_async_s1:57',
     '   #### 11\n   \\]\n\nTherefore, it will take Carlos \\(\\boxed{11}\\) years before he starts '
     'earning money on the lemon tree.',
     '#### 13', 0, 0),
    ('round23/grpo_async_s3_d0:37',
     '#### 14.75\n```\nThe final answer is \\(\\boxed{14.75}\\).',
     '#### 26', 0, 0),
    ('round15/grpo:9',
     '   - Since Carlos cannot earn money in a fraction of a year, we need to round up to the next '
     'whole number. Therefore, it will take Carlos 3 years to earn $90.\n\n#### Final answer:\n\\[\n'
     '\\boxed{3}\n\\]',
     '#### 13', 0, 0),
    ('round21/grpo_async_s1:17',
     '#### 7. Output the final answer:\n   \\[\n   \\boxed{34}\n   \\]',
     '#### 13', 0, 0),
    ('round21/grpo_async:33',
     '#### 1.80\n```\nThe final answer is \\(\\boxed{1.80',
     '#### 13', 0, 0),
    ('round15/grpo:12',
     '\\[ 0 \\text{ centimeters} - 8 \\text{ centimeters} = -8 \\text{ centimeters} \\]\n\n#### Final '
     'answer:\n\\[\n\\boxed{-8}\n\\]',
     '#### 8', 0, 0),
    ('round22/grpo_async_s1:43',
     'The final answer is \\(\\boxed{#### 4 miles per hour}\\).',
     '#### 6', 0, 0),
    ('round21/grpo_async_s1:68',
     '4. Output the final answer after "####".\n   \\[\n   ####2\n   \\]',
     '#### 8', 0, 0),
    ('round21/grpo_async:41',
     '8. **Output the final answer:**\n   \\[\n   #### 3.68\n   \\]',
     '#### 13', 0, 0),
    ('round15/grpo:28',
     '#### Final answer: #### 3 hours shorter.',
     '#### 8', 0, 0),
    ('round21/grpo_async_s1:37',
     '3. Output the original price:\n   #### $14.75',
     '#### 26', 0, 0),
    ('round21/grpo_async_s1:43',
     '   Speed needed = Remaining distance / Remaining time = 4 miles / 4 hours = 1 mile per hour\n\n'
     '#### #### 1 mile per hour',
     '#### 6', 0, 0),
    ('round21/grpo_async_s1:60',
     'Therefore, the final answer is: #### 92 centimeters',
     '#### 8', 0, 0),
    ('round22/grpo_async:41',
     '\\[ \\frac{135 \\text{ dollars}}{90 \\text{ dollars}} = 1.5 \\text{ years} \\]\n\nThus, the final '
     'answer is:\n#### 1.5',
     '#### 13', 0, 0),
    ('round18/grpo_async:29',
     '\\[ \\text{Original price} = 19.50 - 4.875 = 14.625 \\]\n\nTherefore, the original price of the '
     'book is ####.',
     '#### 26', 0, 0),
    ('round15/grpo_async:28',
     '   - #### -8\n\nThis output indicates that the candle will be 8 centimeters shorter after burning '
     'from 1:00 PM to 5:00 PM.',
     '#### 8', 0, 0),
    ('round23/grpo_async_s3_d0:33',
     "   - The final answer is \\(#### 6\\).\n\nLet's confirm this with Python code.\n```python\n# "
     'Initial cost and growth\n[...]\n# Calculate total cost per year\n',
     '#### 13', 0, 0),
    ('round15/grpo_async:15',
     'Since John has $5 left, the number of lego',
     '#### 2', 0, 0),
    ('round22/grpo_async_s1:49',
     '284280243 \\text{ dollars/year} \\times 7 \\text{ lemons/year} = 1919',
     '#### 13', 0, 0),
    ('round23/grpo_async_s1_d0:21',
     'Therefore, the original price of the book was $4.875.',
     '#### 26', 0, 0),
]


@pytest.mark.parametrize("source,response,answer,flexible,strict", REAL, ids=[r[0] for r in REAL])
def test_real_answers_score_as_checked_by_hand(source, response, answer, flexible, strict):
    """The flexible form pays for the model's final answer when it is right: a box (`\\boxed{####694}` too),
    else the last `#### N` line that is one value (`#### \\$694`, `#### 92 centimeters`), else the last number
    (a cut-off box, `#### ####`); the strict form reads `#### N` as verl does (not `#### \\$694`)."""
    assert gsm8k.gsm8k_flexible_reward(response, answer) == flexible
    assert gsm8k.gsm8k_reward(response, answer) == strict


def test_the_real_table_is_varied():
    """At least 40 answers, right and wrong by each form, from several runs."""
    assert len(REAL) >= 40 and len({r[0].split(":")[0] for r in REAL}) >= 6
    assert {(f, s) for _, _, _, f, s in REAL} == {(1, 1), (1, 0), (0, 0)}


# --------------------------------------------------------------------------- the forms the last number misread
# (response, answers it is right for, answers it is wrong for). Each case failed when the flexible form read the
# last number (its box's, else the text's): it paid for a number out of the middle of the answer.
FORMS = [
    (r"\boxed{\frac{1}{2}}", ["0.5"], ["2", "1"]),
    (r"\boxed{\dfrac{3}{4}}", ["0.75"], ["4"]),
    (r"So Tom ate $\tfrac{3}{4}$ of the pie.", ["0.75"], ["4"]),
    (r"\boxed{-\frac{1}{2}}", ["-0.5"], ["2", "-2"]),
    (r"\boxed{2\frac{1}{2}}", ["2.5"], ["2"]),                      # a mixed number: two and a half
    ("The answer is 3/4", ["0.75"], ["4", "3"]),
    ("The answer is .5", ["0.5"], ["5"]),                           # a leading decimal point
    (r"\boxed{2^{10}}", ["1024"], ["10"]),
    ("so there are 2^10 ways to choose.", ["1024"], ["10"]),        # a power, unbraced, as the last number
    (r"\boxed{50\%}", ["50", "0.5"], ["5"]),                        # a percentage: as written, or its hundredth
    ("The discount is 25%.", ["25", "0.25"], []),
    (r"\boxed{18 \text{ m}^2}", ["18"], ["2"]),                     # units after the number
    ("#### 18 dollars\n\nThat is 6 dollars a day for 3 days.", ["18"], ["3"]),
    ("The answer is 18 km. It took 2 hours.", ["18"], ["2"]),
    (r"\boxed{1{,}234}", ["1234", "1,234"], ["234"]),               # LaTeX's thousands separators
    (r"\boxed{1\,234}", ["1234"], ["234"]),
    (r"\boxed{\text{1/2 cup}}", ["0.5"], ["2"]),                    # a \text{} wrapper
    ("\\boxed{\u22125}", ["-5"], ["5"]),                            # a typeset minus sign
    ("the numbers are 1,2,3", [], ["123", "3"]),                    # a list, not a thousands group
    (r"\boxed{x+2}", [], ["2"]),                                    # an expression is no number
    ("So the answer is x+2", [], ["2"]),
    (r"\boxed{\text{Tuesday}, 3 days later}", [], ["3"]),
    ("#### 18\nThat is 9 eggs at 2 dollars each.", ["18"], ["2"]),  # GSM8K's #### before the last number
    ("The answer is 18.\nCheck: 9 eggs x 2.", ["18"], ["2"]),         # "the answer is" before the last number
]


@pytest.mark.parametrize("response,right,wrong", FORMS)
def test_an_answer_is_read_as_its_value(response, right, wrong):
    assert [gsm8k.gsm8k_flexible_reward(response, f"#### {a}") for a in right] == [1.0] * len(right)
    assert [gsm8k.gsm8k_flexible_reward(response, f"#### {a}") for a in wrong] == [0.0] * len(wrong)


def test_values_as_people_write_them():
    """One value, with what people write around it, and exactly (Fraction: 18.0 == 18); else None."""
    for text in ("18", "18.0", "$18.00", "18.", "18 dollars", "18 km/h", "x = 18", r"\$18", r"18 \text{ apples}",
                 "**18**", "#### 18", r"\frac{36}{2}", r"\dfrac{36}{2}", "+18", r"\text{\textbf{18}}", "18 m^2"):
        got = answer_value.value(text)
        assert got is not None and got.number == 18, text
    assert answer_value.value("50%") == Value(50, True) and answer_value.value(r"0.5\%") == Value(Fraction(1, 2), True)
    assert answer_value.value("1,234,567").number == 1234567 and answer_value.value("-1,234.5").number == -2469 / 2
    for text in ("", "abc", "1,2,3", "12,34", "1.2.3", "3 + 4", "18 and 20", "1/0", "10^{1000}", "1" * 41, None):
        assert answer_value.value(text) is None, text
    assert answer_value.same(Value(50, True), Value(0.5)) and not answer_value.same(Value(50), Value(0.5))
    assert not answer_value.same(None, Value(1)) and not answer_value.same(Value(1), None)


def test_which_part_is_the_answer():
    """The order: the last box (read whole, even when it holds no number), the last `#### N` line that is one
    value, the last "the answer is N", the last number."""
    final = answer_value.final
    assert final(r"#### 18 \boxed{20} then 30").number == 20
    assert final(r"\boxed{18} and later \boxed{x}") is None           # the last box is the answer, and no number
    assert final("#### 18\n#### no number here\nThe answer is 20. 30").number == 18
    assert final("The answer is 18. Then 30").number == 18 and final("the answer is: 18").number == 18
    assert final("#### 18 and then the model keeps writing 25").number == 25    # a line of two numbers: no answer
    assert final("The answer is 3 + 4 = 7").number == 7                 # no single value after it: the last number
    assert final(r"\boxed{18").number == 18                             # a box cut off: the last number
    assert final("I cannot tell.") is None and final("") is None


def test_the_strict_form_stays_verls():
    """strict reads the number right after the last `####` as verl's rule does (`#### (-?[0-9.,]+)`, commas
    dropped) and compares it as it did: none of the flexible form's value reading."""
    assert gsm8k.gsm8k_reward(r"#### \frac{1}{2}", "#### 0.5") == 0.0
    assert gsm8k.gsm8k_reward("#### 1,2,3", "#### 123") == 1.0
    assert gsm8k.gsm8k_reward(r"\boxed{18}", "#### 18") == 0.0 and gsm8k.gsm8k_reward("#### 18.00", "#### 18") == 1.0


@pytest.mark.timeout(60)
def test_any_text_scores_in_little_time():
    """A reward runs on every sample of every step: run-on and adversarial text scores 0 or 1 in milliseconds,
    never raises (a 20,000-digit number, a power of a billion, a zero denominator, deep nesting, long lines)."""
    texts = ["1" * 20000, r"\boxed{10^{999999999}}", r"\boxed{1/0}", r"\boxed{0^{-1}}", "\\text{" * 3000 + "5",
             "#### 18 " + "a . " * 3000 + "x", "x" + " " * 20000 + "+ 2", "1," * 20000, "1/" * 20000, "1^" * 20000,
             "the answer is " * 2000, "2\\frac{1}{" + "1" * 20000 + "}", ("####" + "1" * 100 + "\n") * 200]
    for text in texts:
        start = time.perf_counter()
        assert gsm8k.gsm8k_flexible_reward(text, "#### 5") in (0.0, 1.0)
        assert time.perf_counter() - start < 1.0, text[:40]
