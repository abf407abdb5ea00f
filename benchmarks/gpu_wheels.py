"""Lay out `.whl/` for `benchmarks/gpu_check.sh` on a GPU machine that cannot reach a registry: the packages its
image lacks as cp312 manylinux wheels (the versions installed here), Ray's wheel trimmed under the device tool's
64 MiB limit, and SmolLM2's config and tokenizer (no weights) as a pagedserve home.

`python -m benchmarks.gpu_wheels` (then: `run` with `carry: [".whl"]`, command `bash benchmarks/gpu_check.sh`).
"""

from __future__ import annotations

import argparse
import importlib.metadata
import logging
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

logger = logging.getLogger("gpu_wheels")

# What the engine, the server and the bench client import that the device image (docs: KINDS.md) does not hold.
PACKAGES = [
    "ray",
    "pydantic",
    "pydantic-core",
    "annotated-types",
    "typing-inspection",
    "typing-extensions",
    "starlette",
    "fastapi",
    "opentelemetry-api",
    "uvicorn",
    "grpcio",
    "grpcio-reflection",
    "protobuf",
    "jsonschema",
    "jsonschema-specifications",
    "referencing",
    "rpds-py",
]
PLATFORMS = ["manylinux_2_28_x86_64", "manylinux_2_27_x86_64", "manylinux_2_17_x86_64", "manylinux2014_x86_64"]
# Parts of Ray a one-node Serve deployment never loads (the Java jar, RLlib, the dashboard's UI, ...).
RAY_PARTS_DROPPED = (
    "ray/jars/",
    "ray/rllib/",
    "ray/dashboard/client/",
    "ray/llm/",
    "ray/data/",
    "ray/train/",
    "ray/tune/",
    "ray/workflow/",
    "ray/tests/",
)


def trim_wheel(source: Path, target: Path, dropped: tuple[str, ...] = RAY_PARTS_DROPPED) -> None:
    """`source` repacked without the files under `dropped` (and source maps), its RECORD listing what is left."""

    def kept(name: str) -> bool:
        return not name.startswith(dropped) and not name.endswith(".js.map")

    with zipfile.ZipFile(source) as wheel_in, zipfile.ZipFile(target, "w", zipfile.ZIP_DEFLATED, 9) as wheel_out:
        for info in wheel_in.infolist():
            if not kept(info.filename):
                continue
            data = wheel_in.read(info)
            if info.filename.endswith(".dist-info/RECORD"):
                rows = [row for row in data.decode().splitlines() if kept(row.split(",", 1)[0])]
                data = ("\n".join(rows) + "\n").encode()
            wheel_out.writestr(info, data, zipfile.ZIP_DEFLATED, 9)


def download(packages: list[str], directory: Path) -> None:
    pins = [f"{name}=={importlib.metadata.version(name)}" for name in packages]
    platforms = [flag for platform in PLATFORMS for flag in ("--platform", platform)]
    command = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:", "--python-version", "3.12"]
    subprocess.run([*command, "--implementation", "cp", *platforms, "-d", str(directory), *pins], check=True)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default=".whl", help="the folder to fill (ignored by git)")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    out = Path(args.out)
    out.mkdir(exist_ok=True)
    download(PACKAGES, out)
    (ray_wheel,) = out.glob("ray-*.whl")
    trimmed = ray_wheel.with_suffix(".trimmed")
    trim_wheel(ray_wheel, trimmed)
    trimmed.replace(ray_wheel)
    logger.info("Ray's wheel trimmed to %.1f MiB", ray_wheel.stat().st_size / 2**20)

    from configs.engine_config import DEFAULT_MODEL
    from model_executor.model_fetch import fetch_model

    model_dir = fetch_model(DEFAULT_MODEL)
    home = out / "pagedserve-home" / "models" / DEFAULT_MODEL
    home.mkdir(parents=True, exist_ok=True)
    for path in model_dir.iterdir():
        if path.is_file() and not path.name.endswith(".safetensors"):
            shutil.copy2(path, home / path.name)
    total = sum(path.stat().st_size for path in out.rglob("*") if path.is_file())
    logger.info("%s holds %.1f MiB (the device tool carries 64 MiB with the tree)", out, total / 2**20)
    return 0


if __name__ == "__main__":
    sys.exit(main())
