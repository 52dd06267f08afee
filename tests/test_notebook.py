"""launch/driver.ipynb runs headless (nbclient) and learns something plottable.

Needs: CPU only, nbclient + ipykernel (the `dev` extra). The kernel is this interpreter
(sys.executable, i.e. the venv's python), through a kernelspec written into a temp dir, so it
works on a fresh clone with no kernel registered anywhere. The notebook starts its own private
local Ray cluster and shuts it down in its last cell (and the cluster dies with the kernel
anyway). The notebook's files (tiny model, metrics) live in a temporary directory that its last
cell removes; the test checks the printed lines and that the directory is gone. Slow: ~1.5 min
on a 2-core machine.
"""

import math
import os
import re
import tempfile
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[1]
NOTEBOOK = ROOT / "launch" / "driver.ipynb"
DROP = {"RAY_ADDRESS", "RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"}


def test_driver_notebook_runs_headless(tmp_path):
    import nbformat
    from ipykernel.kernelspec import write_kernel_spec
    from jupyter_client.kernelspec import KernelSpecManager
    from jupyter_client.manager import KernelManager
    from nbclient import NotebookClient

    kernels = tmp_path / "kernels"
    write_kernel_spec(kernels / "minirl-test", overrides={"display_name": "minirl (test venv)"})
    ksm = KernelSpecManager(kernel_dirs=[str(kernels)], ensure_native_kernel=False)
    km = KernelManager(kernel_name="minirl-test", kernel_spec_manager=ksm)

    nb = nbformat.read(NOTEBOOK, as_version=4)
    env = {k: v for k, v in os.environ.items() if k not in DROP}   # a private cluster, one rank
    env.update(RAY_AUTH_MODE="disabled", PYTHONUNBUFFERED="1")
    client = NotebookClient(nb, km=km, timeout=300, allow_errors=False,
                            resources={"metadata": {"path": str(NOTEBOOK.parent)}})
    try:
        client.execute(env=env)          # raises CellExecutionError on the first failing cell
    finally:
        nbformat.write(nb, tmp_path / "driver.out.ipynb")   # for a look after a failure

    outputs = [o for c in nb.cells if c.cell_type == "code" for o in c.get("outputs", [])]
    assert not [o for o in outputs if o.output_type == "error"]
    text = "".join(o.get("text", "") for o in outputs if o.output_type == "stream")
    steps = re.findall(r"^step (\d+): reward (\S+)", text, re.M)
    assert [int(s) for s, _ in steps] == list(range(1, len(steps) + 1)) and len(steps) >= 5, text
    final = re.search(r"^final reward: (\S+) \(step 1: (\S+)\) after (\d+) steps; (\S+) removed$", text, re.M)
    assert final, text
    last, first, n, work = float(final[1]), float(final[2]), int(final[3]), Path(final[4])
    assert math.isfinite(last) and abs(last - float(steps[-1][1])) < 1e-3, text
    assert abs(first - float(steps[0][1])) < 1e-3 and n == len(steps), text
    assert work.name.startswith("minirl-notebook-") and work.parent == Path(tempfile.gettempdir()), work
    assert not work.exists(), f"the notebook left {work} behind"
    assert any("image/png" in o.get("data", {}) for o in outputs
               if o.output_type in ("display_data", "execute_result"))
