"""Move the ``onnxruntime-gpu`` wheel (~255 MB) to a device machine in parts under the 64 MiB transfer limit.

Here (a machine with PyPI)::

    python tools/split_ort_gpu_wheel.py download            # pip download onnxruntime-gpu==1.31.1 --no-deps (cp312 manylinux_2_28)
    python tools/split_ort_gpu_wheel.py split .whl/onnxruntime_gpu-*.whl   # -> .whl/ort-gpu/partNN + MANIFEST

``.whl/`` is git-ignored. Carry one part per device call (``carry=[".whl/ort-gpu/part00", ".whl/ort-gpu/MANIFEST"]``,
then part01, ...: files carried earlier stay on a warm machine), and in the last call join, install and check::

    python tools/split_ort_gpu_wheel.py join .whl/ort-gpu -o /tmp/ort-gpu.whl \\
      && pip install -q --no-deps --target /tmp/ortgpu /tmp/ort-gpu.whl \\
      && PYTHONPATH=/tmp/ortgpu .venv/bin/python tools/cuda_checks.py --json $OUT/cuda.json

(``python tools/split_ort_gpu_wheel.py device-command`` prints that line.) ``--target`` keeps the CPU
``onnxruntime`` of the venv untouched; ``PYTHONPATH`` puts the GPU build first. onnxruntime-gpu 1.31.1
is built for CUDA 13 and cuDNN 9 (its ``cuda``/``cudnn`` extras: nvidia-cuda-runtime~=13.0,
nvidia-cudnn-cu13~=9.0), which the device image must provide.
"""

from __future__ import annotations

import argparse
import hashlib
import subprocess
import sys
from pathlib import Path

VERSION = "1.31.1"
PART_BYTES = 60 * 2**20 - 1  # every part < 60 MiB
DEFAULT_DIR = Path(".whl/ort-gpu")


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with path.open("rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def download(dest: Path, python: str, platform: str) -> Path:
    dest.mkdir(parents=True, exist_ok=True)
    subprocess.run([sys.executable, "-m", "pip", "download", f"onnxruntime-gpu=={VERSION}", "--no-deps",
                    "--only-binary=:all:", "--python-version", python, "--platform", platform, "-d", str(dest)],
                   check=True)
    wheels = sorted(dest.glob(f"onnxruntime_gpu-{VERSION}-*.whl"))
    if not wheels:
        raise SystemExit(f"error: no onnxruntime_gpu-{VERSION} wheel in {dest}")
    return wheels[-1]


def split(wheel: Path, out: Path, part_bytes: int = PART_BYTES) -> list[Path]:
    """Write ``out/partNN`` (each at most ``part_bytes``) and ``out/MANIFEST`` (name, size, sha256 of wheel and parts)."""
    out.mkdir(parents=True, exist_ok=True)
    for old in out.glob("part*"):
        old.unlink()
    parts, lines = [], [f"wheel {wheel.name} {wheel.stat().st_size} {_sha256(wheel)}"]
    with wheel.open("rb") as f:
        for i, chunk in enumerate(iter(lambda: f.read(part_bytes), b"")):
            p = out / f"part{i:02d}"
            p.write_bytes(chunk)
            parts.append(p)
            lines.append(f"{p.name} {len(chunk)} {hashlib.sha256(chunk).hexdigest()}")
    (out / "MANIFEST").write_text("\n".join(lines) + "\n")
    return parts


def join(folder: Path, output: Path) -> Path:
    """Concatenate the parts listed in ``folder/MANIFEST`` into ``output``, checking every hash."""
    manifest = (folder / "MANIFEST").read_text().split("\n")
    _, name, size, digest = manifest[0].split()
    h = hashlib.sha256()
    with output.open("wb") as f:
        for line in filter(None, manifest[1:]):
            part, psize, pdigest = line.split()
            p = folder / part
            if not p.exists():
                raise SystemExit(f"error: {p} is missing (carry every part of {folder} before joining)")
            data = p.read_bytes()
            if len(data) != int(psize) or hashlib.sha256(data).hexdigest() != pdigest:
                raise SystemExit(f"error: {p} is damaged ({len(data)} bytes, want {psize})")
            f.write(data)
            h.update(data)
    if output.stat().st_size != int(size) or h.hexdigest() != digest:
        raise SystemExit(f"error: joined {output} does not match {name}")
    return output


def device_command(folder: Path = DEFAULT_DIR) -> str:
    return (f"python tools/split_ort_gpu_wheel.py join {folder} -o /tmp/ort-gpu.whl "
            "&& pip install -q --no-deps --target /tmp/ortgpu /tmp/ort-gpu.whl "
            "&& PYTHONPATH=/tmp/ortgpu .venv/bin/python tools/cuda_checks.py --json $OUT/cuda.json")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    d = sub.add_parser("download")
    d.add_argument("--dest", type=Path, default=Path(".whl"))
    d.add_argument("--python", default="3.12", help="the device's Python (3.11 or 3.12)")
    d.add_argument("--platform", default="manylinux_2_28_x86_64")
    s = sub.add_parser("split")
    s.add_argument("wheel", type=Path)
    s.add_argument("--out", type=Path, default=DEFAULT_DIR)
    j = sub.add_parser("join")
    j.add_argument("folder", type=Path)
    j.add_argument("-o", "--output", type=Path, required=True)
    sub.add_parser("device-command")
    args = ap.parse_args(argv)
    if args.cmd == "download":
        print(download(args.dest, args.python, args.platform))
    elif args.cmd == "split":
        for p in split(args.wheel, args.out):
            print(f"{p} {p.stat().st_size / 2**20:.1f} MiB")
    elif args.cmd == "join":
        print(join(args.folder, args.output))
    else:
        print(device_command())
    return 0


if __name__ == "__main__":
    sys.exit(main())
