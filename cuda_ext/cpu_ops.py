"""Our C++ CPU kernels, compiled on first use with the machine's C++ compiler and cached by torch.

`load_cpu_ops()` returns the compiled module, or None (with the reason logged once) where no compiler is found,
so CPU serving falls back to the pure-torch attention path rather than failing.
"""

from __future__ import annotations

import functools
import logging
import os
import shutil
import time
from pathlib import Path
from types import ModuleType

logger = logging.getLogger(__name__)

SOURCE = Path(__file__).parent / "csrc" / "cpu_ops.cpp"
DISABLE_ENV = "PAGEDSERVE_DISABLE_CPU_KERNELS"
EXTENSION_NAME = "pagedserve_cpu_ops"
# A build takes well under this; an older lock was left by a killed build and would make every load wait forever.
STALE_LOCK_S = 600


def _remove_stale_build_lock(build_directory: Path) -> None:
    lock = build_directory / "lock"
    try:
        age = time.time() - lock.stat().st_mtime
    except FileNotFoundError:
        return
    if age > STALE_LOCK_S:
        logger.warning("removing a stale CPU-kernel build lock (%.0f s old): %s", age, lock)
        lock.unlink(missing_ok=True)


@functools.cache
def load_cpu_ops() -> ModuleType | None:
    if os.environ.get(DISABLE_ENV) == "1":
        logger.info("%s=1: CPU attention uses the pure-torch path", DISABLE_ENV)
        return None
    if shutil.which(os.environ.get("CXX", "c++")) is None:
        logger.warning("no C++ compiler found: CPU attention uses the slower pure-torch path")
        return None
    from torch.utils import cpp_extension

    _remove_stale_build_lock(Path(cpp_extension._get_build_directory(EXTENSION_NAME, verbose=False)))
    try:
        # -march=native: the build runs on (and is cached for) the machine that uses it.
        return cpp_extension.load(
            name=EXTENSION_NAME,
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
