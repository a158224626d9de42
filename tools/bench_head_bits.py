"""A decoder's LM head in fewer bits: what each form costs in perplexity, measured on the exact hidden states.

    python tools/bench_head_bits.py ~/.cache/graphopt/models/smollm2-135m/model.fp32.onnx \
        --tokenizer ~/.cache/graphopt/models/smollm2-135m --text graphopt/bench/data/heldout.txt --text compound.txt

The model runs once per text (512-token windows from an empty past) with the LM head's input added as an output;
every head form is then applied to those hidden states in numpy, so each row isolates what the head alone costs:
``ppl(head form) / ppl(exact head)`` per text, and top-1 agreement with the exact head on the first text. The
calibration rows (the clipping search's ``X``) are the head inputs on graphopt's default held-out text, which is
not one of the evaluated texts. Forms: 8-bit symmetric RTN (block 32: what ``quantize-int4``'s 8-bit head
computes), 4-bit RTN (symmetric / zero points, ONNX Runtime's quantizer), 4-bit with AWQ's clipping search
(``rewrites.quantize.awq.clipped_blocks``, blocks of 32 and 16), and mixed heads: the first R token ids (BPE ids
are roughly in merge order, so the most frequent tokens first) in 8 bits, the rest clipped 4-bit.
"""

from __future__ import annotations

import argparse
import math
import sys
from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
from onnx import helper, numpy_helper

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from graphopt.data import heldout  # noqa: E402
from graphopt.generate import quality  # noqa: E402
from graphopt.rewrites.quantize import awq, nbits  # noqa: E402


def _head(m: onnx.ModelProto) -> tuple[str, np.ndarray]:
    """(the head's input name, its [K, V] table) of the MatMul that makes ``logits``."""
    node = next((n for n in m.graph.node if "logits" in n.output), None)
    if node is None or node.op_type != "MatMul":
        raise SystemExit("bench_head_bits: 'logits' is not made by a MatMul (give the fp32 export)")
    inits = {i.name: i for i in m.graph.initializer}
    made = {o: n for n in m.graph.node for o in n.output}

    def const(name: str) -> np.ndarray:
        if name in inits:
            return numpy_helper.to_array(inits[name])
        p = made.get(name)
        if p is not None and p.op_type == "Transpose":
            return const(p.input[0]).T
        raise SystemExit(f"bench_head_bits: the head weight {name!r} is not a constant (or its Transpose)")
    return node.input[0], np.ascontiguousarray(const(node.input[1]), np.float32)


def _hidden(sess, name: str, ids: list[int], window: int) -> list[tuple[np.ndarray, np.ndarray]]:
    names = {i.name: i for i in sess.get_inputs()}
    out = []
    for a in range(0, len(ids) - 1, window):
        w = np.asarray(ids[a:a + window], np.int64)
        if len(w) < 2:
            continue
        feed = {"input_ids": w[None], "attention_mask": np.ones((1, len(w)), np.int64)}
        if "position_ids" in names:
            feed["position_ids"] = np.arange(len(w), dtype=np.int64)[None]
        for n, i in names.items():
            if n.startswith("past_key_values."):
                feed[n] = np.zeros([1] + [d if isinstance(d, int) else 0 for d in i.shape[1:]], np.float32)
        out.append((sess.run([name], feed)[0][0], w))
    return out


def _ppl(wq: np.ndarray, rows) -> float:
    tot = sum(quality.nll(h[:-1] @ wq, w[1:]) for h, w in rows)
    return math.exp(tot / sum(len(w) - 1 for _, w in rows))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("model", help="a decoder ONNX file whose logits come from a MatMul (graphopt's fp32 export)")
    ap.add_argument("--tokenizer", required=True, help="the tokenizer folder")
    ap.add_argument("--text", action="append", required=True, help="an evaluation text file (repeatable)")
    ap.add_argument("--window", type=int, default=512)
    ap.add_argument("--mixed", default="4096,8192,16384", help="R values: the first R token ids in 8 bits")
    args = ap.parse_args()
    m = onnx.load(args.model)
    name, table = _head(m)
    m.graph.output.append(helper.make_tensor_value_info(name, onnx.TensorProto.FLOAT, None))
    so = ort.SessionOptions()
    so.intra_op_num_threads = 2
    sess = ort.InferenceSession(m.SerializeToString(), so, providers=["CPUExecutionProvider"])
    del m
    texts = {Path(t).name: Path(t).read_text(encoding="utf-8") for t in args.text}
    rows = {k: _hidden(sess, name, quality.text_ids(t, args.tokenizer, None), args.window) for k, t in texts.items()}
    calib = np.concatenate([h for h, _ in _hidden(sess, name, quality.text_ids(heldout.TEXT, args.tokenizer, None),
                                                  args.window)])
    exact = {k: _ppl(table, r) for k, r in rows.items()}
    first = next(iter(rows))
    ref_top = [(h @ table).argmax(-1) for h, _ in rows[first]]
    k = table.shape[0]
    w8 = nbits.dequant(nbits.rtn8_blocks(table, 32), k)
    w4 = nbits.dequant(awq.clipped_blocks(table, calib, 32, True), k)
    forms = {"8-bit RTN, block 32": w8,
             "4-bit RTN symmetric, block 32": nbits.dequant(nbits.rtn_blocks(table, 32, True), k),
             "4-bit RTN zero points, block 32": nbits.dequant(nbits.rtn_blocks(table, 32, False), k),
             "4-bit clipped symmetric, block 32": w4,
             "4-bit clipped zero points, block 32": nbits.dequant(awq.clipped_blocks(table, calib, 32, False), k),
             "4-bit clipped symmetric, block 16": nbits.dequant(awq.clipped_blocks(table, calib, 16, True), k)}
    for r in (int(x) for x in args.mixed.split(",") if x.strip()):
        mixed = w4.copy()
        mixed[:, :r] = w8[:, :r]
        forms[f"first {r} ids 8-bit, the rest 4-bit clipped"] = mixed
    print(f"exact head: ppl {', '.join(f'{t} {p:.3f}' for t, p in exact.items())}; calibration rows {len(calib)}")
    print("| head form | " + " | ".join(f"ppl ratio, {t}" for t in rows) + f" | top-1 = exact, {first} |")
    print("|---|" + "---:|" * (len(rows) + 1))
    for label, wq in forms.items():
        ratios = [_ppl(wq, r) / exact[t] for t, r in rows.items()]
        agree = np.mean(np.concatenate([(h @ wq).argmax(-1) == ref for (h, _), ref in zip(rows[first], ref_top)]))
        print(f"| {label} | " + " | ".join(f"{x:.4f}" for x in ratios) + f" | {agree:.3f} |", flush=True)


if __name__ == "__main__":
    main()
