"""ONNX Runtime's CPU ``MatMulNBits`` per weight width: is anything below 4 bits faster at batch 1?

    python tools/bench_nbits_bits.py --shapes 576x1536,1536x576,576x49152 --rounds 30

Per shape (K x N, block 32, random codes and scales), one row of activations, every width ONNX Runtime accepts
(2, 4, 8; a width it refuses is reported with its one-line reason) at ``accuracy_level`` 1 and 4, and the fp32
MatMul of the same shape, each in its own single-thread session (spinning off), timed round-robin; medians and
the ratio to the 4-bit kernel at the same level.
"""

from __future__ import annotations

import argparse
import time

import numpy as np
import onnxruntime as ort
from onnx import TensorProto, helper, numpy_helper


def _session(model) -> ort.InferenceSession:
    so = ort.SessionOptions()
    so.intra_op_num_threads = 1
    so.add_session_config_entry("session.intra_op.allow_spinning", "0")
    return ort.InferenceSession(model.SerializeToString(), so, providers=["CPUExecutionProvider"])


def _nbits(k: int, n: int, bits: int, level: int, block: int, rng) -> ort.InferenceSession:
    nb = -(-k // block)
    q = rng.integers(0, 256, (n, nb, block * bits // 8), dtype=np.uint8)
    sc = (rng.random(n * nb) * 0.01).astype(np.float32)
    node = helper.make_node("MatMulNBits", ["x", "q", "s"], ["y"], domain="com.microsoft", K=k, N=n, bits=bits,
                            block_size=block, accuracy_level=level)
    g = helper.make_graph([node], "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, k])],
                          [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, n])],
                          [numpy_helper.from_array(q, "q"), numpy_helper.from_array(sc, "s")])
    return _session(helper.make_model(g, opset_imports=[helper.make_opsetid("", 17),
                                                        helper.make_opsetid("com.microsoft", 1)]))


def _fp32(k: int, n: int, rng) -> ort.InferenceSession:
    w = numpy_helper.from_array(rng.standard_normal((k, n)).astype(np.float32), "w")
    g = helper.make_graph([helper.make_node("MatMul", ["x", "w"], ["y"])], "g",
                          [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, k])],
                          [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, n])], [w])
    return _session(helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)]))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shapes", default="576x1536,1536x576")
    ap.add_argument("--bits", default="2,3,4,8")
    ap.add_argument("--block", type=int, default=32)
    ap.add_argument("--rounds", type=int, default=30)
    ap.add_argument("--calls", type=int, default=20, help="calls per timing")
    args = ap.parse_args()
    rng = np.random.default_rng(0)
    for shape in args.shapes.split(","):
        k, n = (int(v) for v in shape.lower().split("x"))
        x = rng.standard_normal((1, k)).astype(np.float32)
        sessions = {"fp32 MatMul": _fp32(k, n, rng)}
        for bits in (int(b) for b in args.bits.split(",")):
            for level in (1, 4):
                try:
                    sessions[(bits, level)] = _nbits(k, n, bits, level, args.block, rng)
                except Exception as e:  # noqa: BLE001 - report what ONNX Runtime refuses, in one line
                    why = str(e).split("was false.")[-1].strip().split("\n")[0][:120]
                    print(f"{k}x{n} {bits}-bit level {level}: refused by ONNX Runtime ({why})")
        times: dict = {key: [] for key in sessions}
        for s in sessions.values():
            s.run(None, {"x": x})
        for _ in range(args.rounds):
            for key, s in sessions.items():
                t = time.perf_counter()
                for _ in range(args.calls):
                    s.run(None, {"x": x})
                times[key].append((time.perf_counter() - t) / args.calls)
        med = {key: float(np.median(v)) for key, v in times.items()}
        print(f"\n{k} x {n}, block {args.block}, 1 row, 1 thread, medians of {args.rounds} rounds:")
        print("| kernel | us | vs 4-bit, same level |\n|---|---:|---:|")
        for key, t in med.items():
            if key == "fp32 MatMul":
                print(f"| fp32 MatMul | {1e6 * t:.1f} | |")
                continue
            ref = med.get((4, key[1]))
            rel = f"{t / ref:.2f}x" if ref else ""
            print(f"| {key[0]}-bit, level {key[1]} | {1e6 * t:.1f} | {rel} |")


if __name__ == "__main__":
    main()
