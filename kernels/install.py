"""Install the kit's Jupyter kernelspec and ipyparallel profile (run by ``make setup``).

The kernelspec goes into this Python's prefix (``sys.prefix/share/jupyter/kernels``) with
``argv[0]`` set to this interpreter, so papermill and nbval run the notebooks with the Python
that has torch and the kit installed. The profile goes into IPYTHONDIR as ``profile_hpkit``.
"""

from __future__ import annotations

import json
import shutil
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent
KERNEL = "hyper-parallel-kit"
PROFILE = "profile_hpkit"


def install_kernelspec() -> str:
    from jupyter_client.kernelspec import KernelSpecManager

    spec = json.loads((HERE / KERNEL / "kernel.json").read_text())
    spec["argv"][0] = sys.executable
    with tempfile.TemporaryDirectory() as tmp:
        (Path(tmp) / "kernel.json").write_text(json.dumps(spec, indent=1))
        return KernelSpecManager().install_kernel_spec(tmp, KERNEL, prefix=sys.prefix)


def install_profile() -> Path:
    from IPython.paths import get_ipython_dir

    target = Path(get_ipython_dir()) / PROFILE
    target.mkdir(parents=True, exist_ok=True)
    for config in (HERE / PROFILE).glob("*.py"):
        shutil.copy2(config, target / config.name)
    return target


if __name__ == "__main__":
    print(f"kernelspec {KERNEL}: {install_kernelspec()}")
    print(f"ipyparallel profile: {install_profile()}")
