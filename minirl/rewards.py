"""Verifiers as reward functions: math answers, code against tests, and output format.

Every `*_reward` returns 1.0/0.0 or a fraction. `gsm8k_reward(prompt, completion, answer)` has
minirl's reward_fn signature; the others take the completion first and compose with `combine`:

    from minirl.rewards import code_reward, combine, format_reward, gsm8k_reward
    reward_fn = combine((gsm8k_reward, 1.0), (lambda p, c, *_: format_reward(c, boxed=True), 0.1))
    code_fn = lambda prompt, completion, tests: code_reward(completion, tests)

Math equality uses sympy (exact rationals; symbolic answers at sample points); code runs in a
child Python under resource limits (`run_code`). CPU only, Linux (elsewhere without the network
namespace); no downloads. Tests: `python -m pytest tests/test_rewards.py -q`.
"""

from __future__ import annotations

import contextlib
import json
import logging
import math
import os
import re
import secrets
import shutil
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from functools import cache

log = logging.getLogger(__name__)

# ---------------------------------------------------------------------------------------- math

_NUMBER = re.compile(r"-?(?:\d+(?:,\d{3})*(?:\.\d+)?|\.\d+)(?:/\d+)?")
_UNITS = re.compile(r"(?<=\S)(?:\s+[a-zA-Z]{2,}\.?(?:\^\{?\d\}?)?)+\s*$")  # " cm^2", " dollars"
# All that may reach sympy's parser (it evals): digits, operators, sqrt, pi, one-letter symbols;
# no 1e9 notation (1e999999999 would be expanded exactly).
_SAFE = re.compile(r"(?!.*\d[eE][-+\d])(?:\d|\.(?=\d)|[-+*/()\s]|sqrt|pi|[a-z](?![a-z]))*", re.S)


def _group(s: str, i: int) -> tuple[str, int] | None:
    """The `{...}` group (nested braces) or single character at s[i], and the index after it;
    None when there is none or its braces do not close."""
    if i < len(s) and s[i] != "{":
        return s[i], i + 1
    depth = 0
    for j in range(i, len(s)):
        depth += {"{": 1, "}": -1}.get(s[j], 0)
        if depth == 0:
            return s[i + 1:j], j + 1
    return None


def _last_boxed(text: str) -> str | None:
    """Contents of the last complete `\\boxed{...}` (or `\\fbox{...}`), nested braces allowed."""
    for m in reversed(list(re.finditer(r"\\(?:boxed|fbox)\s*\{", text))):
        if (g := _group(text, m.end() - 1)) is not None:
            return g[0]
    return None


def extract_answer(text: str, *, fallback_last_number: bool = True) -> str | None:
    """The final answer in `text`, first found of: the contents of the last complete `\\boxed{}`
    (an unclosed one, e.g. cut off by max_tokens, is skipped); the rest of the line after the
    last GSM8K `####` (may be ""); if `fallback_last_number`, the last number (`1,000`, `-2.5`,
    `3/4`). None when there is none. Stripped, not normalized (`math_equal` does that)."""
    if (box := _last_boxed(text)) is not None:
        return box.strip()
    if marks := re.findall(r"####[ \t]*([^\n]*)", text):
        return marks[-1].strip()
    if fallback_last_number and (nums := _NUMBER.findall(text)):
        return nums[-1]
    return None


def _normalize(s: str) -> str:
    """Drop what does not change the value: `\\text{}` wrappers, `$`, `%`, degrees, spacing
    macros, a leading `x =`, trailing unit words, thousands separators, a final period."""
    s = re.sub(r"\\(?:text|textbf|mbox|mathrm)\{([^{}]*)\}", r" \1", s)
    s = re.sub(r"\\left|\\right|\\displaystyle|\\[,;:! $%]|[$%°]|\^\s*\{?\\circ\}?", " ", s)
    s = _UNITS.sub("", s.replace("−", "-").split("=")[-1].strip())
    return re.sub(r"(?<=\d),(?=\d{3}(?!\d))", "", s).strip().rstrip(".")


def _to_sympy(s: str):
    """A sympy expression for a normalized answer (LaTeX `\\frac \\dfrac \\sqrt \\pi \\cdot ^{}`
    or plain), or None when it is not plain math or its exponents multiply past 10**4 (so that
    `9^{9^{9}}` cannot hang the caller)."""
    import sympy
    from sympy.parsing.sympy_parser import (implicit_multiplication, parse_expr, rationalize,
                                            standard_transformations)
    s = re.sub(r"\\[dt]frac", r"\\frac", s).replace("\\pi", " pi ")
    s = s.replace("\\cdot", "*").replace("\\times", "*")
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
    kw = dict(transformations=standard_transformations + (implicit_multiplication, rationalize),
              global_dict={"__builtins__": {}, **{n: getattr(sympy, n) for n in names}})
    try:
        bound = 1
        for p in parse_expr(s, evaluate=False, **kw).atoms(sympy.Pow):
            if not p.exp.is_Rational or (bound := bound * max(abs(p.exp.p), 1)) > 10**4:
                return None
        return parse_expr(s, **kw)
    except Exception:   # sympy raises many types (SyntaxError, TypeError, TokenError, ...)
        return None


def math_equal(a: str, b: str) -> bool:
    """Whether two final answers have the same value. Both are normalized (`1,000` = `1000`, `$5`
    = `5`, `5 cm` = `5`, `x = 3` = `3`, `50%` = `50` != `0.5` as GSM8K writes percentages), then
    compared as sympy values when both parse: exactly when rational (`0.5` = `\\frac{1}{2}`,
    `0.33` != `1/3`), to 20 digits when irrational (`\\pi` != `3.14159`), symbols set to two
    fixed rationals (`x^2+2x+1` = `(x+1)^2`); else as strings, spaces ignored. No 1e3 notation.
    Empty answers, and answers over 500 characters (bounds the time), are never equal."""
    if len(a) > 500 or len(b) > 500 or not (a := _normalize(a)) or not (b := _normalize(b)):
        return False
    if re.sub(r"\s", "", a) == re.sub(r"\s", "", b):
        return True
    if (ea := _to_sympy(a)) is None or (eb := _to_sympy(b)) is None:
        return False
    import sympy
    try:
        for k in (1, 2):
            at = {x: sympy.Rational(7 * i + 3 * k, 11 * k + 13)
                  for i, x in enumerate(sorted(ea.free_symbols | eb.free_symbols, key=str))}
            va, vb = ea.subs(at), eb.subs(at)
            if not (va == vb if (va - vb).is_Rational
                    else abs(sympy.N(va - vb, 30)) <= 1e-20 * abs(sympy.N(va, 30))):
                return False
        return True
    except Exception:   # e.g. a division by zero at the sample point
        return False


def math_reward(completion: str, answer, *, fallback_last_number: bool = True) -> float:
    """1.0 if the completion's final answer (`extract_answer`) equals `answer` (`math_equal`),
    else 0.0. `answer` is a str or number; a reference solution with `####` or `\\boxed{}`
    (GSM8K's and MATH's solution fields) is reduced to its final answer first."""
    if not isinstance(answer, (str, int, float)) or isinstance(answer, bool):
        raise TypeError(f"answer must be a str or a number (the reference answer, e.g. '72'), "
                        f"got {type(answer).__name__}: {answer!r:.100}")
    if re.search(r"####|\\boxed|\\fbox", answer := str(answer)):
        answer = extract_answer(answer, fallback_last_number=False) or ""
    got = extract_answer(completion, fallback_last_number=fallback_last_number)
    return 1.0 if got is not None and math_equal(got, answer) else 0.0


def gsm8k_reward(prompt: str, completion: str, answer) -> float:
    """minirl reward_fn (prompt, completion, answer): `math_reward(completion, answer)`."""
    return math_reward(completion, answer)

# ---------------------------------------------------------------------------------------- code

_HARNESS = r"""
import json, os, resource, sys, traceback
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
    """Outcome of `run_code`. status: "ok" (all tests passed), "fail" (a test failed or the code
    raised), "timeout" (wall or CPU limit), "memory" (MemoryError) or "crash" (died unreported:
    a signal, os._exit, output past the file size limit)."""

    status: str
    passed: int         # tests passed; 0 unless status is "ok" or "fail"
    total: int
    returncode: int     # of the child; negative: killed by that signal
    stderr: str         # its last 2,000 characters


@cache
def _netns_prefix() -> tuple[str, ...]:
    """`unshare -rn` (new user and network namespaces: no network) where this system permits it
    unprivileged; () where not (not Linux, or user namespaces disabled)."""
    if sys.platform != "linux" or not (exe := shutil.which("unshare")):
        return ()
    try:
        ok = subprocess.run([exe, "-rn", "true"], capture_output=True, timeout=10).returncode == 0
    except (OSError, subprocess.SubprocessError):
        ok = False
    return (exe, "-rn") if ok else ()


def _check_tests(tests) -> list[str]:
    tests = [tests] if isinstance(tests, str) else tests
    if not isinstance(tests, (list, tuple)) or not all(isinstance(t, str) for t in tests):
        raise TypeError(f"tests must be a str or a list of str (Python code, one test each, e.g. "
                        f"['assert f(1) == 2']), got {type(tests).__name__}: {tests!r:.100}")
    if not tests:
        raise ValueError("tests is empty: pass at least one test (without tests any code would score 1.0)")
    return list(tests)


def run_code(code: str, tests: str | list[str], *, timeout_s: float = 5.0, memory_mb: int = 512) -> RunResult:
    """Run `code`, then each test (Python source, e.g. asserts) in its namespace, in a child
    `python -I`: own session, temp working dir, env only PATH, stdin at EOF, `__name__` =
    "solution". Limits: RLIMIT_AS memory_mb, RLIMIT_CPU ceil(timeout_s)+1 s, RLIMIT_NPROC 64
    (root is exempt), RLIMIT_FSIZE 4 MiB, no core; its process group is killed at timeout_s of
    wall time. An audit hook refuses sockets, process creation, os.kill and ctypes; where
    permitted it runs under `unshare -rn` (no network). Contains mistakes, hangs and runaway
    resource use, not attacks on the harness (use a container). Raises only for bad arguments."""
    tests = _check_tests(tests)
    if not isinstance(code, str):
        raise TypeError(f"code must be a str, got {type(code).__name__}")
    nonce = secrets.token_hex(16)
    limits = [("RLIMIT_AS", memory_mb << 20), ("RLIMIT_CPU", math.ceil(timeout_s) + 1),
              ("RLIMIT_NPROC", 64), ("RLIMIT_FSIZE", 4 << 20), ("RLIMIT_CORE", 0)]
    job = json.dumps({"code": code, "tests": tests, "nonce": nonce, "limits": limits}).encode()
    with tempfile.TemporaryDirectory(prefix="minirl-code-", ignore_cleanup_errors=True) as tmp:
        out, err = os.path.join(tmp, ".stdout"), os.path.join(tmp, ".stderr")
        with open(out, "wb") as fo, open(err, "wb") as fe, subprocess.Popen(
                [*_netns_prefix(), sys.executable, "-I", "-c", _HARNESS], cwd=tmp,
                env={"PATH": os.defpath}, stdin=subprocess.PIPE, stdout=fo, stderr=fe,
                start_new_session=True) as proc:     # on exit: closes stdin, waits
            try:    # the job goes in on stdin, which the code then finds at its end
                proc.communicate(job, timeout=timeout_s)
                timed_out = False
            except subprocess.TimeoutExpired:
                timed_out = True
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(proc.pid, 9)      # also ends whatever the code left in its process group
        with open(out, errors="replace") as fo, open(err, errors="replace") as fe:
            reports = [json.loads(ln[len(nonce):]) for ln in fo  # whole lines only
                       if ln.startswith(nonce) and ln.endswith("\n")]
            stderr = fe.read()[-2000:]
    if timed_out or proc.returncode == -24:     # SIGXCPU: the CPU time limit
        status, passed = "timeout", 0
    else:
        status, passed = reports[-1] if reports else ("crash", 0)
    return RunResult(status, passed if status in ("ok", "fail") else 0, len(tests), proc.returncode, stderr)


def extract_code(completion: str) -> str | None:
    """The last fenced block tagged python, py, python3 or untagged; with no fenced block at all,
    the whole text. None when that is empty or whitespace."""
    blocks = re.findall(r"```[ \t]*(\w*)[^\n]*\n(.*?)```", completion, re.DOTALL)
    code = next((b for lang, b in reversed(blocks) if lang in ("python", "py", "python3", "")),
                None if blocks else completion)
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

# -------------------------------------------------------------------------------------- format


def format_reward(completion: str, tags: tuple[str, ...] | list[str] = ("answer",), *,
                  boxed: bool = False) -> float:
    """1.0 if each tag appears exactly once as a non-empty `<tag>...</tag>`, in the given order,
    and (if boxed) the last complete `\\boxed{...}` is non-empty; else 0.0. tags=() checks only
    boxed. Tags are matched exactly: `<Answer>` or `<answer id=1>` is not `<answer>`."""
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
    """A reward_fn returning sum(weight * fn(*args)) over (fn, weight) pairs; every fn gets the
    arguments the trainer passes (prompt, completion[, metadata]). Wrap a completion-only
    reward in a lambda: `(lambda p, c, *_: format_reward(c), 0.1)`."""
    if not pairs:
        raise ValueError("combine needs at least one (reward_fn, weight) pair")
    for pair in pairs:
        if not (isinstance(pair, tuple) and len(pair) == 2 and callable(pair[0])
                and isinstance(pair[1], (int, float)) and math.isfinite(pair[1])):
            raise TypeError(f"combine takes (reward_fn, finite weight) pairs, got {pair!r}; "
                            f"e.g. combine((gsm8k_reward, 1.0), (my_format_fn, 0.1))")

    def reward_fn(*args) -> float:
        return float(sum(w * fn(*args) for fn, w in pairs))
    return reward_fn
