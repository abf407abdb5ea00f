"""Our C++ CPU kernels, compiled on first use with the machine's C++ compiler and cached by torch.

`load_cpu_ops()` returns the compiled module, or None (with the reason logged once) where no compiler is found,
so CPU serving falls back to the pure-torch attention path rather than failing.
"""

from __future__ import annotations

import functools
import logging
import os
import shutil
from pathlib import Path
from types import ModuleType

logger = logging.getLogger(__name__)

SOURCE = Path(__file__).parent / "csrc" / "cpu_ops.cpp"
DISABLE_ENV = "PAGEDSERVE_DISABLE_CPU_KERNELS"


@functools.cache
def load_cpu_ops() -> ModuleType | None:
    if os.environ.get(DISABLE_ENV) == "1":
        logger.info("%s=1: CPU attention uses the pure-torch path", DISABLE_ENV)
        return None
    if shutil.which(os.environ.get("CXX", "c++")) is None:
        logger.warning("no C++ compiler found: CPU attention uses the slower pure-torch path")
        return None
    from torch.utils import cpp_extension

    try:
        # -march=native: the build runs on (and is cached for) the machine that uses it.
        return cpp_extension.load(
            name="pagedserve_cpu_ops",
            sources=[str(SOURCE)],
            extra_cflags=["-O3", "-march=native", "-fopenmp"],
            extra_ldflags=["-fopenmp"],
            verbose=False,
        )
    except Exception as error:  # a broken toolchain must not take serving down
        logger.warning("building the CPU kernels failed (%s): CPU attention uses the pure-torch path", error)
        return None


def main() -> None:
    """`python -m cuda_ext.cpu_ops`: build (or find cached) kernels ahead of time, e.g. in `make setup`."""
    logging.basicConfig(level=logging.INFO)
    if load_cpu_ops() is None:
        raise SystemExit("CPU kernels unavailable (see the warning above)")
    logger.info("CPU kernels ready")


if __name__ == "__main__":
    main()
