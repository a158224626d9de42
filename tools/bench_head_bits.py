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
import onnx_ir as ir

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from graphopt.data import heldout  # noqa: E402
from graphopt.generate import quality  # noqa: E402
from graphopt.rewrites.quantize import awq, nbits  # noqa: E402
from graphopt.rewrites.quantize.int4_graph import window_feed  # noqa: E402
from graphopt.rewrites.speculative_heads.graph import find_lm_head  # noqa: E402
from graphopt.runtime.session import make_session  # noqa: E402


def _hidden(sess, model: ir.Model, name: str, ids: list[int], window: int) -> list[tuple[np.ndarray, np.ndarray]]:
    """The head's input over consecutive windows of ``ids``, each from an empty past, with the window's ids."""
    names = {i.name for i in sess.get_inputs()}
    out = []
    for a in range(0, len(ids) - 1, window):
        w = np.asarray(ids[a:a + window], np.int64)
        if len(w) >= 2:
            feed = {k: v for k, v in window_feed(model, w).items() if k in names}
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
    m = ir.load(args.model)
    found = find_lm_head(m)
    if isinstance(found, str):
        raise SystemExit(f"bench_head_bits: {found} (give the fp32 export)")
    _, h, table = found
    table = np.ascontiguousarray(table, np.float32)
    m.graph.outputs.append(h)
    sess = make_session(m, threads=2)
    texts = {Path(t).name: Path(t).read_text(encoding="utf-8") for t in args.text}
    rows = {k: _hidden(sess, m, h.name, quality.text_ids(t, args.tokenizer, None), args.window)
            for k, t in texts.items()}
    calib = np.concatenate([x for x, _ in _hidden(sess, m, h.name, quality.text_ids(heldout.TEXT, args.tokenizer, None),
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
