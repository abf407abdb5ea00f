"""Our C++ CPU kernels, compiled on first use with the machine's C++ compiler and cached by torch.

`load_cpu_ops()` returns the compiled module, or None (with the reason logged once) where no compiler is found,
so CPU serving falls back to the pure-torch attention path rather than failing.
"""

from __future__ import annotations

import contextlib
import fcntl
import functools
import hashlib
import logging
import os
import platform
import shutil
import time
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType

logger = logging.getLogger(__name__)

SOURCE_DIRECTORY = Path(__file__).parent / "csrc"
EXTENSION_NAME = "pagedserve_cpu_ops"
# Longest wait for another process's build of the same kernels; a build takes about a minute.
BUILD_WAIT_S = 900

# This process's `runtime.cpu_kernels` == "off", set once by select_cpu_kernels where the model is built.
_turned_off = False


@contextlib.contextmanager
def exclusive_build(build_directory: Path) -> Iterator[None]:
    """Serialize our builds with an OS lock, which dies with its holder, unlike torch's lock file.

    A build killed mid-way leaves torch's `lock` file behind and torch waits on it forever; holding the OS lock
    means no build of ours is running, so any such file is a leftover and is removed.
    """
    with open(build_directory.with_suffix(".flock"), "a") as lock_file:
        deadline = time.monotonic() + BUILD_WAIT_S
        while True:
            try:
                fcntl.flock(lock_file, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                if time.monotonic() > deadline:
                    raise TimeoutError(f"another build of the CPU kernels held its lock for {BUILD_WAIT_S} s") from None
                time.sleep(0.5)
        try:
            torch_lock = build_directory / "lock"
            if torch_lock.exists():
                logger.warning("removing a build lock left by a killed build: %s", torch_lock)
                torch_lock.unlink(missing_ok=True)
            yield
        finally:
            fcntl.flock(lock_file, fcntl.LOCK_UN)


def build_name() -> str:
    """The extension's name on this CPU: a build cached by torch must never be loaded on a CPU lacking its ISA."""
    # torch keys its cache on sources and flags only, and `-march=native` reads the same everywhere.
    try:
        cpu_flags = next(
            line for line in Path("/proc/cpuinfo").read_text().splitlines() if line.startswith(("flags", "Features"))
        )
    except (OSError, StopIteration):
        cpu_flags = platform.machine()
    return f"{EXTENSION_NAME}_{hashlib.sha256(cpu_flags.encode()).hexdigest()[:10]}"


def build_directory() -> Path:
    """Where torch builds and caches the extension for this CPU."""
    from torch.utils import cpp_extension

    return Path(cpp_extension._get_build_directory(build_name(), verbose=False))


def source_files() -> list[Path]:
    """Our C++ sources (one translation unit each) and the headers they share, in a fixed order."""
    return sorted([*SOURCE_DIRECTORY.glob("*.cpp"), *SOURCE_DIRECTORY.glob("*.h")])


def headers_digest(sources: list[Path]) -> str:
    """A hash of the headers' names and text, passed to the compiler as a flag.

    torch keys a build on the .cpp files' text and the flags only: with this, an edited header changes every
    translation unit's build command and rebuilds it.
    """
    digest = hashlib.sha256()
    for path in sources:
        if path.suffix == ".h":
            digest.update(path.name.encode() + b"\0" + path.read_bytes() + b"\0")
    return digest.hexdigest()[:16]


def staged_sources(build_directory: Path, sources: list[Path]) -> list[Path]:
    """Our sources and headers copied to a folder inside the build directory, the same for every checkout.

    ninja reruns a build whose command changed, and the command names each source's absolute path: built from
    each checkout's own files, a second checkout (a `ray job submit` working dir) would rebuild for a minute.
    """
    folder = build_directory / "src"
    folder.mkdir(parents=True, exist_ok=True)
    staged = []
    for source in sources:
        target = folder / source.name
        source_text = source.read_bytes()
        # Rewritten only when the text differs: a fresh mtime alone would make ninja rebuild.
        if not target.exists() or target.read_bytes() != source_text:
            target.write_bytes(source_text)
        staged.append(target)
    # A file no longer among our sources (a renamed header) must not be found by an include.
    for leftover in set(folder.iterdir()) - set(staged):
        if leftover.is_file():
            leftover.unlink()
    return staged


def select_cpu_kernels(mode: str) -> ModuleType | None:
    """Apply the config's `runtime.cpu_kernels` to this process, once, before its model is built: "off" keeps every
    CPU op on pure torch, "on" fails unless the kernels build, "auto" uses them where they build."""
    global _turned_off
    _turned_off = mode == "off"
    ops = load_cpu_ops()
    if mode == "on" and ops is None:
        raise RuntimeError("runtime.cpu_kernels is 'on' but the C++ CPU kernels did not build (see the warning above)")
    if _turned_off:
        logger.info("runtime.cpu_kernels is 'off': CPU ops run on pure torch")
    return ops


def load_cpu_ops() -> ModuleType | None:
    """The compiled kernels, or None where they did not build or the config turned them off."""
    return None if _turned_off else _built_cpu_ops()


@functools.cache
def _built_cpu_ops() -> ModuleType | None:
    if shutil.which(os.environ.get("CXX", "c++")) is None:
        logger.warning("no C++ compiler found: CPU attention uses the slower pure-torch path")
        return None
    from torch.utils import cpp_extension

    try:
        directory = build_directory()
        sources = source_files()
        with exclusive_build(directory):
            staged = staged_sources(directory, sources)
            # -march=native: the build runs on (and is cached for) the machine that uses it. -fvisibility=hidden:
            # calls between our translation units bind directly, not through the PLT.
            return cpp_extension.load(
                name=build_name(),
                sources=[str(path) for path in staged if path.suffix == ".cpp"],
                extra_cflags=[
                    "-O3",
                    "-march=native",
                    "-fopenmp",
                    "-fvisibility=hidden",
                    f"-DPAGEDSERVE_HEADERS={headers_digest(sources)}",
                ],
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
