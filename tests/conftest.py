"""Shared fixtures. CPU only; builds the tiny local model once per session (no downloads).

Engine fixtures run vLLM in this process (as WeightManager always does); tests that need a
fresh process (whole jobs, torchrun, Ray clusters) start one with subprocess.
"""

import os
import sys
from pathlib import Path

import pytest

os.environ.setdefault("RAY_AUTH_MODE", "disabled")
os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
ROOT = Path(__file__).resolve().parents[1]
PYTHON = sys.executable


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory) -> str:
    from minirl.recipes.tiny import build_tiny_model
    return str(build_tiny_model(tmp_path_factory.mktemp("tiny") / "model"))


@pytest.fixture(scope="session")
def wm(tiny_model):
    """One co-located WeightManager (fp32, CPU) shared by the engine tests."""
    from minirl.colocated import WeightManager
    m = WeightManager(tiny_model, lr=1e-3, enforce_eager=True, max_model_len=128)
    yield m
    m.close()


def run_py(args, *, timeout=600, env=None, cwd=ROOT):
    """Run a python command in a fresh process; return CompletedProcess (text). env: variables to
    set over this process's (None: unset)."""
    import subprocess
    dist_vars = {"RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"}
    e = {k: v for k, v in os.environ.items() if k not in dist_vars}   # this process's world
    e.update({"PYTHONUNBUFFERED": "1", **(env or {})})
    e = {k: v for k, v in e.items() if v is not None}
    return subprocess.run([PYTHON, *args], cwd=cwd, env=e, capture_output=True, text=True,
                          timeout=timeout)


@pytest.fixture(autouse=True, scope="module")
def _no_ray_left_behind():
    """No module leaves Ray running, and nothing in this process starts a Ray instance implicitly
    (a background thread's call after a module's ray.shutdown() would otherwise auto-start one)."""
    import ray._private.auto_init_hook as hook
    hook.enable_auto_connect = False
    yield
    import ray
    if ray.is_initialized():
        ray.shutdown()


@pytest.fixture(scope="module")
def ray_local():
    """A private local Ray cluster for one test module (never joins another cluster)."""
    import ray
    ray.init(address="local", num_cpus=4, object_store_memory=300 * 2**20, include_dashboard=False,
             namespace="minirl", log_to_driver=False)
    yield ray
    ray.shutdown()
