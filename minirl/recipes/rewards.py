"""Verifiers as reward functions (1.0/0.0 or a fraction): math answers (exact numbers, sympy, and
math-verify for relations), code against tests
(run in a child Python under resource limits), output format. `gsm8k_reward` has minirl's reward_fn
signature; the others take the completion first. CPU, Linux (elsewhere no network namespace).

    reward_fn = combine((gsm8k_reward, 1.0), (lambda p, c, *_: format_reward(c, boxed=True), 0.1))
    code_fn = lambda prompt, completion, tests: code_reward(completion, tests)
"""

import contextlib
import json
import logging
import math
import os
import re
import shutil
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from decimal import Decimal
from fractions import Fraction
from functools import cache, lru_cache

from minirl import faults

log = logging.getLogger(__name__)
# A number for the last-number fallback: -?digits (- or Unicode's minus), thousands commas, decimals (or .5),
# /digits; not right after a letter, digit, `_` or `.` (_last_number checks what follows it).
_NUMBER = re.compile(r"(?<![\w.])[-−]?(?:[0-9]+(?:,[0-9]{3})*(?:\.[0-9]+)?|\.[0-9]+)(?:/[0-9]+)?")
_PLAIN = re.compile(r"-?(?:[0-9]+\.?[0-9]*|\.[0-9]+)(?:/[0-9]+)?")     # a normalized 007, 7.0, -.5, 3/4
_NAME = re.compile(r"[^a-zA-Z]*|[a-zA-Z\s]+(?:_\{?\w+\}?|'+)?(?:\([^()]*\))?")   # _rhs: x, AB, x_1, f(x), 3 + 4
_BOX = re.compile(r"\\(?:boxed|fbox)\s*\{")
_BRACE = re.compile(r"[{}]")
# Words after a number or a bracket: " cm^2", " square units" (not pi: 3 pi is no 3; "not prime" keeps its words).
_UNITS = re.compile(r"(?<=[\d)}\]])(?:\s+(?!pi\b)[a-zA-Z]{2,}\.?(?:\^\{?\d\}?)?)+\s*$")
_TEXT_UNIT = re.compile(r"(?<=[\d)}\]])\s*\\(?:text|mbox|mathrm)\{\s*[a-zA-Z]+\.?\s*\}(?:\^\{?\d\}?)?\s*\.?$")
_MIXED = re.compile(r"(?<![\w.)}^])(\d+)\s*\\frac\s*(?:\{\s*(\d+)\s*\}\s*\{\s*(\d+)\s*\}|(\d)(\d))")
# What may reach sympy's parser (it evals): digits, operators, sqrt, pi, one-letter symbols; no 1e9.
_SAFE = re.compile(r"(?!.*\d[eE][-+\d])(?:\d|\.(?=\d)|[-+*/()\s]|sqrt|pi|[a-z](?![a-z]))*", re.S)


def _group(s: str, i: int) -> tuple[str, int] | None:
    """The `{...}` group (nested braces) or character at s[i] and the index after it; None if unclosed.
    Scans to the closing brace: for short strings only (answers of at most 500 characters)."""
    if i < len(s) and s[i] != "{":
        return s[i], i + 1
    depth = 0
    for j in range(i, len(s)):
        depth += {"{": 1, "}": -1}.get(s[j], 0)
        if depth == 0:
            return s[i + 1:j], j + 1
    return None


def _last_boxed(text: str) -> str | None:
    """Contents of the last complete `\\boxed{...}` (or `\\fbox{...}`), nested braces allowed. One pass
    pairs every brace from the first box on (scanning ahead from each box was quadratic: 190 s on
    100 KB of `\\boxed{`)."""
    opens = [m.end() - 1 for m in _BOX.finditer(text)]
    if not opens:
        return None
    closes, stack = {}, []
    for m in _BRACE.finditer(text, opens[0]):
        if m[0] == "{":
            stack.append(m.start())
        elif stack:
            closes[stack.pop()] = m.start()
    return next((text[i + 1:closes[i]] for i in reversed(opens) if i in closes), None)


def _last_number(text: str) -> str | None:
    """The last `_NUMBER` not followed by a letter, digit, `_` or `.digit`, as written."""
    nums = [m[0] for m in _NUMBER.finditer(text) if not re.match(r"\w|\.[0-9]", text[m.end():m.end() + 2])]
    return nums[-1] if nums else None


def extract_answer(text: str, *, fallback_last_number: bool = True) -> str | None:
    """The final answer of `text`, stripped, by the first of these rules that finds one, else None:
    1. the contents of the last complete `\\boxed{...}` or `\\fbox{...}` (nested braces allowed; a box
       left open, e.g. cut by max_tokens, is skipped);
    2. the rest of the line after the last `####` (may be "");
    3. if fallback_last_number, the last number that stands alone: `-`?digits (`-` or `−`), optional thousands
       commas and decimals (or `.5`), optionally `/digits`, with no letter, digit, `_` or `.` just before
       it and no letter, digit, `_` or `.digit` just after it. So "ab7c", "x2", "7th", "5cm" and
       "v1.2.3" hold no number; "x-7" and "5-7" end in 7 (a `-` after a letter or digit is a minus).
    Time is linear in len(text)."""
    if (box := _last_boxed(text)) is not None:
        return box.strip()
    if (i := text.rfind("####")) >= 0:
        return text[i + 4:(j if (j := text.find("\n", i)) >= 0 else len(text))].strip()
    return _last_number(text) if fallback_last_number else None


def _normalize(s: str) -> str:
    """Drop `\\text{}` wrappers, `$`, `%`, degrees, spacing, `x =` (_rhs), units, thousands commas, a final `.`."""
    s = re.sub(r"(?<=\d)(?:,\\!|\{,\})(?=\d)", ",", s)       # LaTeX's digit-group commas `10,\!000`, `10{,}000`
    s = _TEXT_UNIT.sub("", s)                                 # a unit set as text, one letter too: `12\text{ m}`
    s = re.sub(r"\\(?:text|textbf|mbox|mathrm)\{([^{}]*)\}", r" \1", s)
    s = re.sub(r"(\\\\)|\\left|\\right|\\displaystyle|\\[,;:! $%]|[$%°]|\^\s*\{?\\circ\}?",
               lambda m: m[1] or " ", s)                  # a matrix's row break \\ stays
    s = _UNITS.sub("", _rhs(s.replace("−", "-")).strip())
    return re.sub(r"(?<=\d),(?=\d{3}(?!\d))", "", s).strip().rstrip(".")


def _rhs(s: str) -> str:
    """What follows the last `=` (not <=, >=, !=) of s when each side before it is a name (`x`, `AB`, `\\theta`,
    `x_1`, `f(x)`) or has no letters (`3 + 4`), else all of s: an equation (`x + y = 0`, `x = 2, y = 3`) stays."""
    *lhs, rhs = re.split(r"(?<![<>!])=", s)
    return rhs if all(_NAME.fullmatch(re.sub(r"\\[a-zA-Z]+", "", x).strip()) for x in lhs) else s


def _plain_number(s: str) -> Fraction | None:
    """The exact value of a normalized plain number (`007`, `7.0`, `-.5`, `3/4`, `1.5/2`), else None."""
    if not _PLAIN.fullmatch(s):
        return None
    num, _, den = s.partition("/")
    if den and not int(den):
        return None                             # x/0
    return Fraction(num) / Fraction(den or 1)


@lru_cache(maxsize=4096)      # a set's parts are compared pairwise
def _to_sympy(s: str):
    """Sympy value of a normalized answer; None if not plain math, or if exponents multiply past 10**4
    or, times the longest integer's digits, past 10**5."""
    import sympy
    from sympy.parsing import sympy_parser as sp
    s = re.sub(r"\\cdot|\\times", "*", re.sub(r"\\[dt]frac", r"\\frac", s)).replace("\\pi", " pi ")
    s = _MIXED.sub(lambda m: f"({m[1]}+\\frac{{{m[2] or m[4]}}}{{{m[3] or m[5]}}})", s)   # 6\frac{1}{4}: 25/4
    for cmd, fmt in (("\\frac", "(({})/({}))"), ("\\sqrt", "sqrt({})")):
        while (i := s.find(cmd)) >= 0:
            args, j = [], i + len(cmd)
            while len(args) < fmt.count("{}"):
                if (g := _group(s, j)) is None:
                    return None
                args, j = args + [g[0]], g[1]
            s = s[:i] + fmt.format(*args) + s[j:]
    s = s.replace("{", "(").replace("}", ")").replace("^", "**")
    if len(s) > 200 or not _SAFE.fullmatch(s):
        return None
    names = ("Integer", "Float", "Rational", "Symbol", "Add", "Mul", "Pow", "sqrt", "pi")
    kw = dict(transformations=sp.standard_transformations + (sp.implicit_multiplication, sp.rationalize),
              global_dict={"__builtins__": {}, **{n: getattr(sympy, n) for n in names}})
    with contextlib.suppress(Exception):    # sympy raises many types (SyntaxError, TokenError, ...)
        expr = sp.parse_expr(s, evaluate=False, **kw)
        rationals = [_rational(p.exp) for p in expr.atoms(sympy.Pow)]
        digits = max(len(str(n.p)) for n in expr.atoms(sympy.Rational) | {sympy.S.One})
        exps = math.prod(max(abs(r.p), 1) for r in rationals if r is not None)
        if None not in rationals and exps <= 10**4 and exps * digits <= 10**5:
            return sp.parse_expr(s, **kw)   # values of at most ~10**5 digits (a 190-digit number^9999: 0.6 s)
    return None


def _rational(e):
    """An unevaluated exponent's value where it is a number like 3, -2 or 1/2 (written a/b it parses
    as a * b**-1); None for anything else (a symbol, a power in the exponent)."""
    import sympy
    if e.is_Rational:
        return e
    if e.free_symbols or any(not (q.exp == -1 and q.base.is_Integer) for q in e.atoms(sympy.Pow)) \
            or not all(a.is_Integer for a in e.atoms(sympy.Number)):
        return None
    v = e.doit()
    return v if v.is_Rational else None


def _sympy_equal(ea, eb) -> bool:
    """Equal exactly when rational, else to 20 digits; symbols are set to two fixed rationals; an
    infinite or undefined value (`1/0`) equals nothing."""
    import sympy
    with contextlib.suppress(Exception):    # e.g. a division by zero at the sample point
        for k in (1, 2):
            at = {x: sympy.Rational(7 * i + 3 * k, 11 * k + 13)
                  for i, x in enumerate(sorted(ea.free_symbols | eb.free_symbols, key=str))}
            va, vb = ea.subs(at), eb.subs(at)
            if not (va.is_finite and vb.is_finite):
                return False                # 1/0 is zoo, and |zoo - 72| <= 1e-20 * |zoo| held: it matched all
            if not (va == vb if (va - vb).is_Rational
                    else abs(sympy.N(va - vb, 30)) <= 1e-20 * abs(sympy.N(va, 30))):
                return False
        return True
    return False


def _split(s: str, sep: str) -> list[str] | None:
    """s cut at each match of the regex `sep` outside brackets, parts stripped; None if the brackets
    of s do not balance."""
    parts, depth, start = [], 0, 0
    for m in re.finditer(rf"[(\[{{]|[)\]}}]|{sep}", s):
        if m[0] in "([{":
            depth += 1
        elif m[0] in ")]}":
            if (depth := depth - 1) < 0:
                return None
        elif depth == 0:
            parts, start = parts + [s[start:m.start()].strip()], m.end()
    return parts + [s[start:].strip()] if depth == 0 else None


def _items(s: str) -> tuple[str, list[str], bool] | None:
    """A normalized answer made of parts, as (kind, parts, ordered): a matrix (its cells row by row; the
    kind holds its shape), a union of intervals (`\\cup`), a set `\\{1, 2\\}` or a bare list `1, 2`
    (any order), a tuple or interval `(1, 2]` (in order, brackets kept in the kind); else None."""
    if m := re.fullmatch(r"\\begin\{([pbv]?)matrix\}(.*)\\end\{\1matrix\}", s, re.S):
        rows = [_split(row, "&") or [] for row in _split(m[2], r"\\\\") or []]
        return f"matrix{[len(r) for r in rows]}", [c for r in rows for c in r], True
    if len(parts := _split(s, r"\\cup") or []) > 1:
        return "cup", parts, True
    if s.startswith("\\{") and s.endswith("\\}") and (parts := _split(s[2:-2], ",")):
        return "set", parts, False
    if s[:1] in "([" and s[-1:] in ")]" and len(parts := _split(s[1:-1], ",") or []) > 1:
        return s[0] + s[-1], parts, True
    if len(parts := _split(s, ",") or []) > 1:
        return "set", parts, False
    return None


def _items_equal(a: tuple[str, list[str], bool], b: tuple[str, list[str], bool], nested: bool = True) -> bool:
    """Same kind and length, parts equal in order or, unordered, matched one to one. Parts compare by
    `_value_equal`, or, if nested, as tuples or intervals themselves (`(1, 2) \\cup (3, 4)`, `((1, 2), 3)`).
    At most 64 parts in order or 16 in any order (up to 16 * 16 pairs, each well under 1 ms)."""
    (kind, pa, ordered), (kind_b, pb, _) = a, b
    if kind != kind_b or len(pa) != len(pb) or len(pa) > (64 if ordered else 16):
        return False

    def equal(x: str, y: str) -> bool:
        if (same := _value_equal(x, y)) is not None or not nested:
            return bool(same)
        ix, iy = _items(x), _items(y)
        return bool(ix and iy and ix[2] and ix[0] in ("()", "(]", "[)", "[]") and _items_equal(ix, iy, False))
    if ordered:
        return all(equal(x, y) for x, y in zip(pa, pb))
    left = list(pb)
    for x in pa:
        if (j := next((j for j, y in enumerate(left) if equal(x, y)), None)) is None:
            return False
        left.pop(j)
    return True


# Relations and +-, which math-verify reads and the paths above do not.
_RELATION = re.compile(r"[<>]|\\(?:le|leq|ge|geq|lt|gt|ne|neq|pm|mp)(?![a-zA-Z])")
# What math-verify may see. Unguarded it ran 8 minutes on "(9^{9^{9}}, 1)" (a big-integer power, which
# holds the GIL: no thread can time it out) and 10 s expanding "\{(a+b+c+d+e+f)^9, 1\}"; with powers,
# nested roots or fractions or a polynomial of degree 9 its relation solver took 0.2-0.5 s. So: 60
# characters of numbers, \pi, two \frac, two \sqrt, one \cup, these commands, one variable used twice.
_MV_TOKENS = re.compile(r"(?:[0-9a-zA-Z\s.,+\-*/()\[\]<>=|{}]|\\[{}]|\\(?:[dt]?frac|sqrt|pi|infty|le|leq|"
                        r"ge|geq|lt|gt|ne|neq|pm|mp|cup|cdot|times|in)(?![a-zA-Z]))*")


def _math_verify_safe(s: str) -> bool:
    letters = re.findall(r"[a-zA-Z]", re.sub(r"\\[a-zA-Z]+", "", s))
    return (len(s) <= 60 and len(letters) <= 2 and len(set(letters)) <= 1 and s.count("\\sqrt") <= 2
            and s.count("frac") <= 2 and s.count("\\cup") <= 1 and _MV_TOKENS.fullmatch(s) is not None)


@cache
def _math_verify():
    """The math_verify module (extra `tasks`), or None where it is not installed."""
    try:
        import math_verify
    except ImportError:
        return None
    quiet = lambda record: not record.getMessage().startswith("Timeout is disabled")  # noqa: E731
    for name in ("math_verify.parser", "math_verify.grader"):   # we bound it: _math_verify_equal
        logging.getLogger(name).addFilter(quiet)
    parse = lambda s: math_verify.parse(s, parsing_timeout=None, raise_on_error=True)  # noqa: E731
    try:    # the first parse and comparison build the parser and import sympy's solvers: ~0.5 s, once
        math_verify.verify(parse("$x(x+1) > 2$"), parse("$x > 1$"), timeout_seconds=None, raise_on_error=True)
    except Exception as e:      # e.g. an antlr4 runtime that its LaTeX parser does not accept
        log.warning("math-verify does not run here (%s: %s); relations compare as text", type(e).__name__, e)
        return None
    return math_verify


def _math_verify_equal(a: str, b: str) -> bool:
    """math-verify's verdict (either way round: it is not symmetric) on two normalized answers, one a
    relation or `\\pm`, both within _math_verify_safe (then it took at most 0.26 s, most under 0.01 s).
    Its signal-based timeouts work only on the main thread, so they are off; a call still running after
    0.5 s scores unequal and is logged (the thread runs on: Python cannot stop it)."""
    relation = _RELATION.search(a) or _RELATION.search(b)
    if not (relation and _math_verify_safe(a) and _math_verify_safe(b)) or (mv := _math_verify()) is None:
        return False
    config = [mv.LatexExtractionConfig()]

    def judge() -> bool:
        pa, pb = (mv.parse(f"${s}$", config, fallback_mode="no_fallback", parsing_timeout=None)
                  for s in (a, b))
        return bool(pa and pb) and any(mv.verify(g, p, float_rounding=10, timeout_seconds=None)
                                       for g, p in ((pb, pa), (pa, pb)))
    try:
        return faults.bounded(judge, 0.5, "math-verify")()
    except TimeoutError as e:
        log.warning("math_equal: %s on %r vs %r; scored unequal", e, a, b)
        return False


def _value_equal(a: str, b: str) -> bool | None:
    """Rules 1-3 of math_equal on normalized answers; None where none applies."""
    if re.sub(r"\s", "", a) == re.sub(r"\s", "", b):
        return True
    if (na := _plain_number(a)) is not None and (nb := _plain_number(b)) is not None:
        return na == nb
    if (ea := _to_sympy(a)) is not None and (eb := _to_sympy(b)) is not None:
        return _sympy_equal(ea, eb)
    return None


def math_equal(a: str, b: str) -> bool:
    """Whether two answers have the same value. Both are normalized (`_normalize`: `$5` = `5 cm` =
    `x = 5`, `1,000` = `1000`, `50%` = `50`, not `0.5`); then the first rule that applies decides:
    1. equal strings (spaces ignored);
    2. plain numbers (`007`, `7.0`, `-.5`, `3/4`) compare exactly, without sympy: `007` = `7.0` = `7`,
       `0.5` = `1/2`, `0.33` != `1/3`;
    3. expressions sympy can read safely (`\\frac`, `\\sqrt`, `^`, `\\pi`, one-letter symbols): exactly
       when rational (`0.5` = `\\frac{1}{2}`), else to 20 digits, symbols at two fixed rationals
       (`x^2+2x+1` = `(x+1)^2`);
    4. answers made of parts, part by part with rules 1-3: tuples and intervals in order with the same
       brackets (`(\\frac12, 1]` = `(0.5, 1]`), sets `\\{\\}` and bare lists in any order (`1, 2` =
       `2, 1`), unions of intervals, matrices of one shape;
    5. relations and `\\pm` by math-verify (`x > 2` = `2 < x`, `\\pm 2` = `2, -2`), within
       `_math_verify_safe`.
    Anything else, an empty answer, or one over 500 characters: False. math-verify is used for rule 5
    only: on the rest it is 10-1000x slower (5-500 ms a comparison against well under 1 ms), can run
    for minutes, and is looser (it rounds decimals, `1/3` = `0.333333`; `50%` = `0.5`; `A` = `a`)."""
    if len(a) > 500 or len(b) > 500 or not (a := _normalize(a)) or not (b := _normalize(b)):
        return False
    if (same := _value_equal(a, b)) is not None:
        return same
    if (ia := _items(a)) and (ib := _items(b)):
        return _items_equal(ia, ib)
    return _math_verify_equal(a, b)


def math_reward(completion: str, answer, *, fallback_last_number: bool = True) -> float:
    """1.0 if `extract_answer(completion)` (the last complete `\\boxed{}`, else the line after the last
    `####`, else, with fallback_last_number, the last number standing alone) `math_equal`s `answer`,
    else 0.0. `answer` is a str or a number (a solution with `####` or `\\boxed{}`, as in GSM8K and
    MATH, is reduced to its final answer first). Under 1 s on any completion up to 100 KB (after the
    first call's imports)."""
    if not isinstance(answer, (str, int, float)) or isinstance(answer, bool):
        raise TypeError(f"answer must be a str or a number (the reference answer, e.g. '72'), "
                        f"got {type(answer).__name__}: {answer!r:.100}")
    answer = format(Decimal(repr(answer)), "f") if isinstance(answer, float) else str(answer)  # 1e16: digits
    if re.search(r"####|\\boxed|\\fbox", answer):
        answer = extract_answer(answer, fallback_last_number=False) or ""
    got = extract_answer(completion, fallback_last_number=fallback_last_number)
    return 1.0 if got is not None and math_equal(got, answer) else 0.0


def gsm8k_reward(prompt: str, completion: str, answer) -> float:
    """minirl reward_fn (prompt, completion, answer): `math_reward(completion, answer)`."""
    return math_reward(completion, answer)


_HARNESS = r"""import json, os, resource, sys, traceback
def main():     # a function, so that the job (and its nonce) is not a global of __main__
    job = json.load(sys.stdin)
    for name, value in job["limits"]:   # hard limits too, so the code cannot raise them
        hard = resource.getrlimit(r := getattr(resource, name))[1]
        cap = lambda v: v if hard == resource.RLIM_INFINITY else min(v, hard)
        resource.setrlimit(r, (cap(value), cap(value + (name == "RLIMIT_CPU"))))
    blocked = ("socket.", "os.fork", "os.system", "os.exec", "os.posix_spawn", "os.spawn",
               "subprocess.", "os.kill", "signal.pthread_kill", "ctypes.")
    def guard(event, args):
        if event.startswith(blocked) or event == "import" and args[0] == "_posixsubprocess":
            raise PermissionError(f"{event}{args!r:.60} is not allowed in the sandbox")
    sys.addaudithook(guard)
    report, ns, ok, status = os.dup(1), {"__name__": "solution"}, 0, "fail"
    try:
        exec(compile(job["code"], "solution.py", "exec"), ns)
        for i, test in enumerate(job["tests"]):
            try:
                exec(compile(test, f"test_{i}.py", "exec"), ns)
                ok += 1
            except MemoryError:
                raise
            except Exception as e:
                print(f"test {i} failed: {type(e).__name__}: {e}"[:500], file=sys.stderr)
        status = "ok" if ok == len(job["tests"]) else "fail"
    except MemoryError:
        status = "memory"
    except BaseException:
        traceback.print_exc(limit=-5)
    os.write(report, ("\n" + job["nonce"] + json.dumps([status, ok]) + "\n").encode())
main()
"""


@dataclass(frozen=True)
class RunResult:
    """Outcome of `run_code`. status: "ok" (all tests passed), "fail" (a test failed or the code raised),
    "timeout", "memory" (MemoryError) or "crash" (died unreported: signal, os._exit, file size limit)."""

    status: str
    passed: int         # tests passed; 0 unless status is "ok" or "fail"
    total: int
    returncode: int     # of the child; negative: killed by that signal
    stderr: str         # its last 2,000 characters


@cache
def _netns_prefix() -> tuple[str, ...]:
    """`unshare -rn` (new user and network namespaces: no network) where permitted unprivileged, else ()."""
    if sys.platform == "linux" and (exe := shutil.which("unshare")):
        with contextlib.suppress(OSError, subprocess.SubprocessError):
            if subprocess.run([exe, "-rn", "true"], capture_output=True, timeout=10).returncode == 0:
                return exe, "-rn"
    return ()


def _check_tests(tests) -> list[str]:
    tests = [tests] if isinstance(tests, str) else tests
    if not isinstance(tests, (list, tuple)) or not all(isinstance(t, str) for t in tests):
        raise TypeError(f"tests must be a str or a list of str (Python code, one test each, e.g. "
                        f"['assert f(1) == 2']), got {type(tests).__name__}: {tests!r:.100}")
    if not tests:
        raise ValueError("tests is empty: pass at least one test (without tests any code would score 1.0)")
    return list(tests)


def run_code(code: str, tests: str | list[str], *, timeout_s: float = 5.0, memory_mb: int = 512) -> RunResult:
    """Run `code`, then each test (Python source, e.g. asserts) in its namespace, in a child `python -I`:
    own session and temp cwd, env only PATH, the rlimits below (NPROC spares root), an audit hook against
    sockets, processes, os.kill and ctypes, `unshare -rn` where permitted; its process group is killed at
    timeout_s. Contains mistakes, hangs and runaway resource use, not attacks. Raises only for bad args."""
    tests = _check_tests(tests)
    if not isinstance(code, str):
        raise TypeError(f"code must be a str, got {type(code).__name__}")
    nonce = os.urandom(16).hex()
    limits = [("RLIMIT_AS", memory_mb << 20), ("RLIMIT_CPU", math.ceil(timeout_s) + 1),
              ("RLIMIT_NPROC", 64), ("RLIMIT_FSIZE", 4 << 20), ("RLIMIT_CORE", 0)]
    job = json.dumps({"code": code, "tests": tests, "nonce": nonce, "limits": limits}).encode()
    with tempfile.TemporaryDirectory(prefix="minirl-code-", ignore_cleanup_errors=True) as tmp:
        out, err = os.path.join(tmp, ".stdout"), os.path.join(tmp, ".stderr")
        with open(out, "wb") as fo, open(err, "wb") as fe, subprocess.Popen(
                [*_netns_prefix(), sys.executable, "-I", "-c", _HARNESS], cwd=tmp, env={"PATH": os.defpath},
                stdin=subprocess.PIPE, stdout=fo, stderr=fe, start_new_session=True) as proc:  # exit waits
            with contextlib.suppress(subprocess.TimeoutExpired):  # the code finds the job at its stdin's end
                proc.communicate(job, timeout=timeout_s)
            timed_out = proc.returncode is None
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(proc.pid, 9)      # also ends whatever the code left in its process group
        with open(out, errors="replace") as fo, open(err, errors="replace") as fe:
            reports = [json.loads(ln[len(nonce):]) for ln in fo if ln.startswith(nonce) and ln.endswith("\n")]
            stderr = fe.read()[-2000:]
    status, passed = reports[-1] if reports else ("crash", 0)
    if timed_out or proc.returncode == -24:     # SIGXCPU: the CPU time limit
        status = "timeout"
    return RunResult(status, passed if status in ("ok", "fail") else 0, len(tests), proc.returncode, stderr)


def extract_code(completion: str) -> str | None:
    """The last fenced block tagged python, py or python3 (any case), else the last untagged one (no fence:
    the whole text); None if blank. An example or output in an untagged block after tagged code is not it."""
    blocks = re.findall(r"```[ \t]*(\w*)[^\n]*\n(.*?)```", completion, re.DOTALL)
    code = next((b for lang, b in reversed(blocks) if lang.lower() in ("python", "py", "python3")), None)
    code = code or next((b for lang, b in reversed(blocks) if not lang), None if blocks else completion)
    return code if code and code.strip() else None


def code_reward(completion: str, tests: str | list[str], *, timeout_s: float = 5.0,
                memory_mb: int = 512, partial: bool = True) -> float:
    """Fraction of `tests` passed by `extract_code(completion)` under `run_code` (partial=False: 1.0
    only if all pass). 0.0 without code, and on timeout, memory or crash (logged as warnings)."""
    tests = _check_tests(tests)
    if (code := extract_code(completion)) is None:
        return 0.0
    r = run_code(code, tests, timeout_s=timeout_s, memory_mb=memory_mb)
    if r.status not in ("ok", "fail"):
        log.warning("code_reward: %s (exit %s): %s", r.status, r.returncode, r.stderr[-500:])
    return r.passed / r.total if partial else float(r.passed == r.total)

def format_reward(completion: str, tags: tuple[str, ...] | list[str] = ("answer",), *,
                  boxed: bool = False) -> float:
    """1.0 if each tag appears once, non-empty, in order, as exactly `<tag>...</tag>` (not `<Answer>`,
    `<answer id=1>`) and, if boxed, the last `\\boxed{}` is non-empty, else 0.0; tags=() checks boxed only."""
    if isinstance(tags, str):
        raise TypeError(f"tags must be a tuple of tag names, e.g. ({tags!r},), not a str")
    pos = 0
    for tag in tags:
        found = list(re.finditer(rf"<{re.escape(tag)}>(.*?)</{re.escape(tag)}>", completion, re.DOTALL))
        if len(found) != 1 or not found[0][1].strip() or found[0].start() < pos:
            return 0.0
        pos = found[0].end()
    return 0.0 if boxed and not (_last_boxed(completion) or "").strip() else 1.0


def combine(*pairs):
    """A reward_fn returning sum(weight * fn(*args)) over (fn, weight) pairs, each fn called with what
    the trainer passes; wrap completion-only rewards: `(lambda p, c, *_: format_reward(c), 0.1)`."""
    if not pairs:
        raise ValueError("combine needs at least one (reward_fn, weight) pair")
    for pair in pairs:
        if not (isinstance(pair, tuple) and len(pair) == 2 and callable(pair[0])
                and isinstance(pair[1], (int, float)) and math.isfinite(pair[1])):
            raise TypeError(f"combine takes (reward_fn, finite weight) pairs, got {pair!r}; "
                            f"e.g. combine((gsm8k_reward, 1.0), (my_format_fn, 0.1))")
    return lambda *args: float(sum(w * fn(*args) for fn, w in pairs))
