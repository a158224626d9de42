"""tools/split_ort_gpu_wheel.py: split into parts under the limit, join back byte-identical, refuse damage."""

from __future__ import annotations

import pytest


def _tool():
    from conftest import load_tools_module

    return load_tools_module("split_ort_gpu_wheel")


def test_split_join_round_trip(tmp_path):
    tool = _tool()
    wheel = tmp_path / "onnxruntime_gpu-1.31.1-cp312-cp312-manylinux_2_28_x86_64.whl"
    wheel.write_bytes(bytes(range(256)) * 41 + b"tail")  # 10500 bytes
    parts = tool.split(wheel, tmp_path / "parts", part_bytes=4096)
    assert [p.stat().st_size for p in parts] == [4096, 4096, 2308]
    assert tool.PART_BYTES < 60 * 2**20
    joined = tool.join(tmp_path / "parts", tmp_path / "joined.whl")
    assert joined.read_bytes() == wheel.read_bytes()
    parts[1].write_bytes(b"x" * 4096)
    with pytest.raises(SystemExit, match="part01 is damaged"):
        tool.join(tmp_path / "parts", tmp_path / "bad.whl")
    tool.split(wheel, tmp_path / "parts", part_bytes=4096)
    parts[2].unlink()
    with pytest.raises(SystemExit, match="missing"):
        tool.join(tmp_path / "parts", tmp_path / "bad.whl")
    assert "pip install -q --no-deps --target" in tool.device_command()
