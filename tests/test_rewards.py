"""minirl.recipes.rewards: math extraction and equality, the code sandbox, format rewards, combine.

CPU only; about 15 s on 2 cores, a third of it importing minirl (torch). Each run_code case
starts one Python process (~0.1 s); the two hang cases wait out their 1 s limit.
"""

import logging
import math
import socket
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor

import pytest

from minirl.recipes import rewards
from minirl.recipes.rewards import (code_reward, combine, extract_answer, extract_code, format_reward,
                            gsm8k_reward, math_equal, math_reward, run_code)

# -------------------------------------------------------------------------------------- math


@pytest.mark.parametrize("text, expected", [
    ("Natalia sold 48 + 24 = 72 clips.\n#### 72", "72"),
    ("so the total is\n#### 1,000\nDone", "1,000"),
    ("#### 3\nlater\n#### 5", "5"),                               # the last #### wins
    ("The answer is $\\boxed{\\frac{1}{2}}$.", "\\frac{1}{2}"),
    ("\\boxed{\\frac{\\sqrt{3}}{2}} is it", "\\frac{\\sqrt{3}}{2}"),  # nested braces
    ("first \\boxed{1}, then \\boxed{2}", "2"),                   # the last box wins
    ("\\boxed{7} and #### 9", "7"),                               # a box beats ####
    ("\\boxed{4} but then \\boxed{5", "4"),                       # unclosed box skipped
    ("cut off: \\boxed{12", "12"),                                # ... then the last number
    ("\\fbox{ 8 }", "8"),
    ("So x = 3, and we get 4.5 apples.", "4.5"),
    ("It costs $1,234.50 in total.", "1,234.50"),
    ("Half is 3/4 of it", "3/4"),
    ("The temperature fell to -7 degrees", "-7"),
    ("The temperature fell to −7 degrees", "−7"),                  # a Unicode minus is a sign too
    ("no digits at all", None),
    ("", None),
    ("the code is ab7c", None),                                  # 7 is glued inside a word
    ("the code ab7c has 3 parts", "3"),                          # ... so the 3 standing alone is last
    ("so the answer is 7", "7"),                                 # a number at the very end
    ("call x2 and y3", None),                                    # letter before: a name, not a number
    ("she came 7th", None),                                      # letter after: an ordinal
    ("He owes -12 dollars", "-12"),                              # a sign after a space is a sign
    ("x-7", "7"), ("12-5", "5"),                                 # after a letter or digit: a minus
    ("version 1.2.3", None),                                     # no number stands alone in 1.2.3
    ("pi is about 3.14.", "3.14"),                               # a final period is punctuation
    ("agent 007", "007"),                                        # as written; math_equal reads 7
    ("######## 5", "5"),                                         # after the last ####, not the first
    ("\\boxed{1} then \\boxed{\\boxed{2}", "2"),                  # the last complete box: the inner one
])
def test_extract_answer(text, expected):
    assert extract_answer(text) == expected


@pytest.mark.parametrize("text, expected", [
    ("So x = 3, and we get 4.5 apples.", None),
    ("cut off: \\boxed{12", None),
    ("#### 42", "42"),
    ("\\boxed{}", ""),                                            # found, empty: never equal
])
def test_extract_answer_without_number_fallback(text, expected):
    assert extract_answer(text, fallback_last_number=False) == expected


@pytest.mark.parametrize("a, b", [
    ("1,000", "1000"), ("1,000,000", "10^6"), ("0.5", "1/2"), ("0.5", "\\frac{1}{2}"),
    ("10,\\!000", "10000"), ("1,\\!234,\\!567", "1234567"), ("1{,}000", "1000"),  # LaTeX thousands commas
    ("\\dfrac12", ".5"), ("\\tfrac{3}{4}", "0.75"), ("3.0", "3"), ("72.", "72"), ("-5", "−5"),
    ("\\$18", "18"), ("$18.00", "18"), ("18 dollars", "18"), ("5\\text{ cm}^2", "5"),
    ("90^\\circ", "90"), ("x = 3", "3"), ("50%", "50"), ("50\\%", "50"),
    ("f(x) = x^2", "x^2"), ("3 + 4 = 7", "7"), ("x = 2, y = 3", "y=3, x=2"),  # a name's or a sum's `=`
    ("\\frac{\\sqrt{2}}{2}", "\\frac{1}{\\sqrt{2}}"), ("2\\sqrt{3}", "\\sqrt{12}"),
    ("\\sqrt{2}+\\sqrt{3}", "\\sqrt{5+2\\sqrt{6}}"), ("2^{10}", "1024"), ("10^{-2}", "0.01"),
    ("2^{1/2}", "\\sqrt{2}"), ("8^{1/3}", "2"), ("4^{-\\frac{1}{2}}", "0.5"),    # fractional exponents
    ("\\left(3\\right)", "3"), ("2\\pi r", "2 r \\pi"), ("x^2+2x+1", "(x+1)^2"),
    ("3 \\cdot 4", "12"), ("(1, 2)", "(1,2)"), ("\\text{(B)}", "(B)"),
    ("007", "7"), ("7.0", "7"), ("-7", "-7.00"), ("-.5", "-1/2"), ("1.5/3", "0.5"),  # exact, no sympy
    ("(\\frac12, 1]", "(0.5, 1]"),                                # parts in order, same brackets
    ("1, 2", "2, 1"), ("\\{1, 2, 2\\}", "\\{2, 1, 2\\}"),           # lists and sets in any order
    ("(-\\infty, \\frac12) \\cup (3, \\infty)", "(-\\infty,0.5)\\cup(3,\\infty)"),
    ("((1, 2), 3)", "((1.0, 2), 3)"),                          # one level of nesting
    ("\\begin{pmatrix} \\frac12 & 2 \\\\ 3 & 4 \\end{pmatrix}", "\\begin{bmatrix}0.5&2\\\\3&4\\end{bmatrix}"),
    ("x \\le 3", "x \\leq 3"), ("x > 2", "2 < x"), ("\\pm 2", "2, -2"),  # math-verify
    ("6\\frac{1}{4}", "\\frac{25}{4}"), ("6\\frac14", "6.25"), ("-2\\frac{1}{2}", "-2.5"),  # mixed numbers
    ("3\\frac{\\pi}{2}", "\\frac{3\\pi}{2}"),                     # not one: a product
    ("12 \\text{ m}", "12"), ("12\\text{ g}", "12"), ("25 \\text{ m}^2", "25"),   # one-letter units as text
])
def test_math_equal(a, b):
    assert math_equal(a, b) and math_equal(b, a)


@pytest.mark.parametrize("a, b", [
    ("50%", "0.5"),                   # percent: the number as written (see math_equal)
    ("0.33", "1/3"), ("1/3", "0." + "3" * 30),                    # rationals are exact
    ("\\pi", "3.14159265358979"), ("10^{-30}", "0"), ("2^{10000}", "2^{10000}+1"),
    ("x", "y"), ("2x", "x^2"), ("A", "a"), ("", "0"), ("", ""), ("12", "21"),
    ("1e3", "1000"),                  # scientific notation is not parsed
    ("1" * 501, "1" * 501),           # over 500 characters
    ("007", "70"), ("-7", "7"),
    ("3/0", "3"), ("\\frac{1}{0}", "\\sqrt{2}"), ("x/0", "72"),  # 1/0 equalled every answer
    ("(1, 2)", "(2, 1)"), ("(1, 2)", "[1, 2]"), ("(1, 2)", "\\{1, 2\\}"),  # order and brackets count
    ("1, 1, 2", "1, 2, 2"), ("1, 2", "1, 2, 3"),                # matched one to one
    ("1,\\!2", "12"), ("10{,}00", "1000"),                       # a list, not a thousands comma
    ("(0.333333, 1)", "(\\frac13, 1)"), ("(A, B)", "(a, b)"),   # parts as exact as whole answers
    ("\\begin{pmatrix} 1 & 2 \\end{pmatrix}", "\\begin{pmatrix} 1 \\\\ 2 \\end{pmatrix}"),  # shape
    ("x <= 3", "3"), ("x \\le 3", "3"), ("x \\le 3", "x < 3"),   # a relation is not its bound
    ("x = 5, y = 3", "x = 2, y = 3"), ("2x - y + 3z + 8 = 0", "x + y + z = 0"),  # equations are not
    ("2x - y + 3z + 8 = 0", "0"), ("x^2 + y^2 = 25", "25"),                        # their right sides
    ("6\\frac{1}{4}", "\\frac{3}{2}"),                              # 6 + 1/4, not 6 x 1/4
    ("\\text{not prime}", "\\text{not composite}"), ("\\text{Saturday}", "\\text{Saturday and Sunday}"),
    ("3 pi", "3"), ("12 m", "12"),                                  # words, pi and bare letters are no units
])
def test_math_not_equal(a, b):
    assert not math_equal(a, b)


@pytest.mark.timeout(10)
@pytest.mark.parametrize("a", [
    "9^{9^{9^{9}}}", "9^{9^{9}/2}", "2^{99999999/2}", "1e999999999", "2\n1e999999999", "(a+b+c+d+e+f+g+h)^{10}",
    "(x+1)^{100000}",
    "\\dfrac{5^{\\left(5^{\\left(5^{\\left(5^5\\right)}\\right)} - 4\\right)} - 5}{16}",
    "(a+b+c+d)^2 (e+f+g+h)^2 (i+j+k+l)^2 (m+n+o+p)^2 (q+r+s+t)^2",
    "__import__('os').system('true')", "(1).__class__", "x " + "aa " * 160 + "!",
])
def test_math_equal_hostile_inputs_return_quickly(a):
    t = time.perf_counter()
    assert not math_equal(a, "1")
    assert time.perf_counter() - t < 2


def test_math_equal_works_off_the_main_thread():     # no signal-based timeouts, math-verify's included
    with ThreadPoolExecutor(2) as pool:
        pairs = [("0.5", "\\frac{1}{2}"), ("2^{10}", "1024"), ("x > 2", "2 < x")]
        assert list(pool.map(math_equal, *zip(*pairs))) == [True] * 3


@pytest.mark.parametrize("completion, answer, expected", [
    ("48/2 = 24, 48 + 24 = 72\n#### 72", "72", 1.0),
    ("The answer is \\boxed{72}.", "Natalia sold 48/2 = <<48/2=24>>24.\n#### 72", 1.0),
    ("... so \\boxed{\\frac{1}{2}}", "By symmetry the answer is $\\boxed{0.5}$.", 1.0),
    ("She has 1,000 apples now.", 1000, 1.0),                   # int answers are allowed
    ("She has 71 apples.", "72", 0.0),
    ("I do not know.", "72", 0.0),
    ("#### ", "72", 0.0),
    ("the code is ab7c", 7, 0.0),                               # a digit inside a word is no answer
    ("the code ab7c: 5 + 2 = 7", 7, 1.0),                       # the last number standing alone
    ("James Bond is 007", 7, 1.0),                              # 007 and 7 are the same number
    ("#### 7.0", "7", 1.0), ("\\boxed{7}", "7.00", 1.0),        # so are 7.0 and 7.00
    ("It drops 3 degrees to -3.", -3, 1.0),                     # negative, before a final period
    ("It drops to -3", "3", 0.0),                               # the sign counts
    ("It drops 3 degrees to −3.", -3, 1.0), ("It drops to −3", "3", 0.0),  # a Unicode minus too
    ("#### 1,000", "#### 1000", 1.0),                           # thousands commas, both sides reduced
    ("\\boxed{1/0}", "72", 0.0),                                # 1/0 scored 1.0 against any answer
    ("#### 10000000000000000", 1e16, 1.0),                      # a float reference read as its digits
    ("\\boxed{(\\frac{1}{2}, 3)}", "$(0.5, 3)$", 1.0),            # an ordered pair, part by part
])
def test_math_reward(completion, answer, expected):
    assert math_reward(completion, answer) == expected


# 100 KB completions (about the engine's longest) a model can emit; each was slow before or reaches a
# slow path: 14,285 nested open boxes took 190 s (every box scanned to the end of the text).
ADVERSARIAL = {
    "nested open boxes": "\\boxed{" * 14_285,
    "nested closed boxes": "\\boxed{" * 6_000 + "7" + "}" * 6_000,
    "box then open braces": "\\boxed{" + "{" * 99_990,
    "closed boxes, the last open": "\\boxed{1}" * 10_000 + "\\boxed{7",
    "digits": "7" * 100_000,
    "a comma list": "1," * 50_000,
    "a long #### line": "#### " + "(" * 100_000,
    "frac nest": "\\boxed{" + "\\frac{1}{" * 11_000 + "2" + "}" * 11_001,
    "frac nest under 500 chars": "\\boxed{" + "\\frac{1}{" * 50 + "2" + "}" * 51,
    "a set of 200 parts": "\\boxed{\\{" + "x," * 200 + "y\\}}",
    "a big power": "\\boxed{" + "9" * 190 + "^{9999}}",
}


@pytest.mark.parametrize("name", ADVERSARIAL)
def test_math_reward_is_fast_on_adversarial_completions(name):
    math_reward("\\boxed{x \\le \\frac12}", "x \\leq 0.5")   # imports (sympy, math-verify) come first
    t = time.perf_counter()
    assert math_reward(ADVERSARIAL[name], "7") == (name == "nested closed boxes")
    assert time.perf_counter() - t < 1.0           # measured 0.1 s at most on 2 busy cores


def test_math_reward_options_and_errors():
    assert math_reward("it is 72", "72", fallback_last_number=False) == 0.0
    assert gsm8k_reward("Q: 70 + 2?", "70 + 2 = 72.", "72") == 1.0
    with pytest.raises(TypeError, match="answer must be a str or a number"):
        math_reward("72", ["72"])

# -------------------------------------------------------------------------------------- code


F = "def f(x):\n    return x + 1\n"


@pytest.mark.parametrize("completion, expected", [
    (f"Here:\n```python\n{F}```\nDone.", F),
    (f"```py\nold = 1\n```\nbetter:\n```python\n{F}```", F),     # the last python block
    (f"```python\n{F}```\nrun it with\n```bash\npython f.py\n```", F),  # bash skipped
    (f"```\n{F}```", F),                                         # untagged fence
    (f"```python\n{F}```\nFor example:\n```\nf(1)  # 2\n```", F),   # tagged code before an untagged example
    (f"```Python\n{F}```", F),                                   # any case
    (F, F),                                                      # no fence: the whole text
    ("```bash\nls\n```", None),                                  # fences, none Python
    ("   \n", None),
    ("```python\n```", None),                                    # empty block
])
def test_extract_code(completion, expected):
    assert extract_code(completion) == expected


@pytest.mark.parametrize("code, tests, status, passed", [
    (F, ["assert f(1) == 2", "assert f(2) == 3"], "ok", 2),
    (F, "assert f(1) == 2\nassert f(5) == 6", "ok", 1),          # one str: one test
    (F, ["assert f(1) == 2", "assert f(2) == 4", "assert g(1)"], "fail", 1),
    ("def f(x) return x", ["assert f(1) == 2"], "fail", 0),      # syntax error
    ("import sys; sys.exit(0)", ["assert False"], "fail", 0),    # exiting early does not pass
    ("import os; os._exit(0)", ["assert False"], "crash", 0),
    ("import faulthandler; faulthandler._sigsegv()", ["assert True"], "crash", 0),
    ("while True: print('x' * 10000)", ["assert True"], "crash", 0),  # file size limit
    ("x = bytearray(2 << 30)", ["assert True"], "memory", 0),
    (F + "if __name__ == '__main__':\n    input()", ["assert f(0) == 1"], "ok", 1),
    ("import sys; data = sys.stdin.read()", ["assert data == ''"], "ok", 1),
    (F + "print('0' * 32 + '[\"ok\", 9]')", ["assert False"], "fail", 0),  # no nonce: ignored
    ("def f(x): return f(x)", ["f(1)", "assert True"], "fail", 1),  # RecursionError fails one test
    ("raise KeyboardInterrupt", ["assert True"], "fail", 0),
    ("x = []", ["x.append(1)", "assert x == [1]", "assert len(x) == 2"], "fail", 2),  # tests share names
    ("import socket", ["assert socket.AF_INET"], "ok", 1),       # importing is fine, connecting is not
])
def test_run_code(code, tests, status, passed):
    r = run_code(code, tests, memory_mb=256)
    total = 1 if isinstance(tests, str) else len(tests)
    assert (r.status, r.passed, r.total) == (status, passed, total)


@pytest.mark.parametrize("code", [
    "import os\nwhile True: os.fork()",                          # fork bomb
    "import subprocess; subprocess.run(['true'])",
    "import os; os.kill(os.getppid(), 9)",                       # would kill the caller
    "import ctypes",
    "import socket; socket.socket()",
])
def test_run_code_refuses_processes_and_signals(code):
    r = run_code(code, "assert True")
    assert (r.status, r.passed) == ("fail", 0) and "not allowed in the sandbox" in r.stderr


@pytest.mark.parametrize("prefix", ["as configured", "audit hook only"])
def test_run_code_has_no_network(prefix, monkeypatch):
    if prefix == "audit hook only":
        monkeypatch.setattr(rewards, "_netns_prefix", lambda: ())
    with socket.create_server(("127.0.0.1", 0)) as server:
        port = server.getsockname()[1]
        r = run_code(f"import socket\nsocket.create_connection(('127.0.0.1', {port}), 2)",
                     "assert True")
    assert r.status == "fail" and "Error" in r.stderr


def test_network_namespace_isolates_loopback():
    prefix = rewards._netns_prefix()
    if not prefix:
        pytest.skip("this system does not allow unprivileged user namespaces (unshare -rn); "
                    "run_code then relies on its audit hook alone")
    with socket.create_server(("127.0.0.1", 0)) as server:
        port = server.getsockname()[1]
        probe = f"import socket; socket.create_connection(('127.0.0.1', {port}), 2)"
        assert subprocess.run([sys.executable, "-c", probe]).returncode == 0
        assert subprocess.run([*prefix, sys.executable, "-c", probe],
                              capture_output=True).returncode != 0


@pytest.mark.parametrize("code", [
    "while True: pass",                                          # CPU
    "import os\nwhile True:\n    try: os.fork()\n    except Exception: pass",
])
def test_run_code_timeout(code):
    t = time.perf_counter()
    r = run_code(code, "assert True", timeout_s=1.0)
    assert (r.status, r.passed) == ("timeout", 0) and time.perf_counter() - t < 5


def test_code_reward(caplog):
    fenced = f"```python\n{F}```"
    tests = ["assert f(1) == 2", "assert f(2) == 3", "assert f(3) == 5", "assert f(0) == 1"]
    assert code_reward(fenced, tests) == 0.75
    assert code_reward(fenced, tests, partial=False) == 0.0
    assert code_reward(fenced, tests[:2], partial=False) == 1.0
    assert code_reward("I cannot solve this.", tests) == 0.0     # prose: a syntax error
    assert code_reward("   ", tests) == 0.0                      # no code, no process
    with caplog.at_level(logging.WARNING, logger="minirl.recipes.rewards"):
        assert code_reward("```python\nimport os; os._exit(3)\n```", tests) == 0.0
    assert "crash (exit 3)" in caplog.text


@pytest.mark.parametrize("tests, error, match", [
    ({"t": "assert f(1)"}, TypeError, "tests must be a str or a list of str"),
    (["assert f(1)", 3], TypeError, "tests must be a str or a list of str"),
    (None, TypeError, "tests must be a str or a list of str"),
    ([], ValueError, "tests is empty"),
])
def test_code_reward_rejects_bad_tests(tests, error, match):
    with pytest.raises(error, match=match):
        code_reward(F, tests)
    with pytest.raises(error, match=match):
        run_code(F, tests)

# ------------------------------------------------------------------------------------ format


@pytest.mark.parametrize("completion, kwargs, expected", [
    ("<answer>72</answer>", {}, 1.0),
    ("I think... <answer> 72 </answer> done", {}, 1.0),
    ("<answer>\n72\n</answer>", {}, 1.0),
    ("<answer></answer>", {}, 0.0),                              # empty
    ("<answer>  </answer>", {}, 0.0),
    ("<answer>72", {}, 0.0),                                     # unclosed
    ("<answer>1</answer><answer>2</answer>", {}, 0.0),           # twice
    ("72", {}, 0.0),
    ("<think>add</think><answer>72</answer>", {"tags": ("think", "answer")}, 1.0),
    ("<answer>72</answer><think>add</think>", {"tags": ("think", "answer")}, 0.0),  # order
    ("<think>add</think>", {"tags": ("think", "answer")}, 0.0),
    ("<answer>\\boxed{72}</answer>", {"boxed": True}, 1.0),
    ("<answer>72</answer>", {"boxed": True}, 0.0),
    ("so \\boxed{\\frac{1}{2}}", {"tags": (), "boxed": True}, 1.0),
    ("so \\boxed{\\frac{1}{2}", {"tags": (), "boxed": True}, 0.0),  # unbalanced
    ("anything", {"tags": ()}, 1.0),
    ("\\boxed{ }", {"tags": (), "boxed": True}, 0.0),              # empty box
    ("\\boxed{} then \\boxed{3}", {"tags": (), "boxed": True}, 1.0),  # the last box counts
    ("<Answer>72</Answer>", {}, 0.0),                            # tags are case-sensitive
    ('<answer id="1">72</answer>', {}, 0.0),                     # no attributes
    ("<answer><b>72</b></answer>", {}, 1.0),                     # markup inside is content
    ("<think>\nstep 1\nstep 2\n</think>\n<answer>72</answer>", {"tags": ("think", "answer")}, 1.0),
    ("<think>a<answer>72</answer></think>", {"tags": ("think", "answer")}, 0.0),  # nested
    ("<think>a</think><think>b</think><answer>7</answer>", {"tags": ("think", "answer")}, 0.0),
    ("<answer>\\boxed{\\frac{1}{2}}</answer>", {"tags": ["answer"], "boxed": True}, 1.0),
    ("<answer>72</answer>\n", {}, 1.0),
    ("<answer>72</answer >", {}, 0.0),                          # not exactly the closing tag
    ("</answer>72<answer>", {}, 0.0),                           # reversed
    ("<think></think><answer>7</answer>", {"tags": ("think", "answer")}, 0.0),   # empty think
    ("<answer>\\boxed{}</answer>", {"boxed": True}, 0.0),       # empty box inside the tags
])
def test_format_reward(completion, kwargs, expected):
    assert format_reward(completion, **kwargs) == expected


def test_format_reward_rejects_a_str_of_tags():
    with pytest.raises(TypeError, match=r"tags must be a tuple of tag names, e\.g\. \('answer',\)"):
        format_reward("<answer>1</answer>", "answer")


def test_combine():
    fmt = lambda p, c, *_: format_reward(c, boxed=True, tags=())    # noqa: E731
    reward_fn = combine((gsm8k_reward, 1.0), (fmt, 0.25))
    assert reward_fn("q", "so \\boxed{72}", "72") == 1.25
    assert reward_fn("q", "so 72", "72") == 1.0
    assert reward_fn("q", "so \\boxed{71}", "72") == 0.25
    two_arg = combine((lambda p, c: float(len(c) > 2), 2), (lambda p, c: -1.0, 0.5))
    assert two_arg("q", "abc") == 1.5 and isinstance(two_arg("q", ""), float)
    assert math.isfinite(reward_fn("q", "", "72"))


@pytest.mark.parametrize("pairs, error", [
    ((), ValueError), ((gsm8k_reward,), TypeError), (((gsm8k_reward, "1"),), TypeError),
    (((gsm8k_reward, math.inf),), TypeError), ((("gsm8k", 1.0),), TypeError),
])
def test_combine_rejects_bad_pairs(pairs, error):
    with pytest.raises(error):
        combine(*pairs)
