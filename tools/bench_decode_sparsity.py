#!/usr/bin/env python
"""Decode-time sparsity (``decode-sparsity``) on a decoder: speed, perplexity and greedy match per keep level.

    python tools/bench_decode_sparsity.py MODEL.onnx --tokenizer DIR [--groups 8] [--levels 2,4,6]
        [--eval FILE] [--calib FILE] [--prompts 8] [--new 32] [--steps 16] [--rounds 5]

MODEL is a gated-FFN decoder before ``merge-projections`` (e.g. the int4 recipe without its last step). The
router and groups are calibrated on ``--calib`` (default: graphopt's default held-out text, the text the
pass calibrates on); quality is measured on ``--eval`` (default: ``bench --generate``'s held-out text, which
the calibration never sees): perplexity over 64-token windows with every position computed as its own
decode step would (the simulation form), and greedy tokens of the real graph, one prompt at a time (batch 1),
against the same model without sparsity. Speed: decode steps at batch 1, 1 thread, every level and the model
without sparsity timed round-robin in one process; the ratio of medians.
"""

from __future__ import annotations

import argparse
import os

import numpy as np


def main(argv: list[str] | None = None) -> int:
    from graphopt import io
    from graphopt.bench.perplexity import DEFAULT_TEXT
    from graphopt.generate import quality
    from graphopt.generate.loop import open_decoder
    from graphopt.rewrites import decode_sparsity as ds
    from graphopt.rewrites.common.decode_timing import step_seconds
    from graphopt.runtime.session import make_session

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("model")
    ap.add_argument("--tokenizer", required=True)
    ap.add_argument("--groups", type=int, default=8)
    ap.add_argument("--levels", default="2,4,6")
    ap.add_argument("--eval", default=str(DEFAULT_TEXT))
    ap.add_argument("--calib", default=None)
    ap.add_argument("--prompts", type=int, default=8)
    ap.add_argument("--new", type=int, default=32)
    ap.add_argument("--steps", type=int, default=16)
    ap.add_argument("--rounds", type=int, default=5)
    a = ap.parse_args(argv)
    levels = [int(v) for v in a.levels.split(",")]
    model = io.load(a.model)

    def sess(m):
        return make_session(m, threads=1, spinning=False)

    base = open_decoder(sess(model), threads=1)
    body, _ = quality.read_text(a.calib)
    calib = quality.split_tokens(quality.text_ids(body, a.tokenizer, base.sig.vocab), max_windows=16)
    cal = ds.calibrate(model, calib.windows[quality.CALIB] + calib.windows[quality.HELD], a.groups)
    n = len(cal)
    body, _ = quality.read_text(a.eval)
    ev = quality.split_tokens(quality.text_ids(body, a.tokenizer, base.sig.vocab), max_windows=8,
                              prompts=a.prompts, new_tokens=a.new, prompt_tokens=32)
    windows = ev.windows[quality.CALIB] + ev.windows[quality.HELD]
    prompts = (ev.prompts[quality.CALIB] + ev.prompts[quality.HELD])[:a.prompts]
    print(f"{a.model}: {n} gated FFNs, {a.groups} groups; calibration {calib.describe()}; "
          f"eval {len(windows)} windows of 64 tokens, {len(prompts)} prompts x {a.new} greedy tokens "
          f"(load {os.getloadavg()[0]:.2f})")

    def greedy(dec):
        return [quality.greedy(dec, [p], a.new)[0] for p in prompts]

    ref_ppl, ref_tok = quality.perplexity(base, windows), greedy(base)
    # keep = groups: every group on (the grouped graph itself: its If overhead, its kernels' rounding)
    reals = {k: open_decoder(sess(ds.sparse_model(model, cal, [k] * n, grouped_dense=True)), threads=1)
             for k in levels}
    rows = {}
    for k in levels:
        sim = open_decoder(sess(ds.sparse_model(model, cal, [k] * n, simulate=True, grouped_dense=True)),
                           threads=1)
        ppl = quality.perplexity(sim, windows)
        orc = open_decoder(sess(ds.sparse_model(model, cal, [k] * n, simulate=True, oracle=True)), threads=1)
        oracle_ppl = quality.perplexity(orc, windows)
        del orc
        got = greedy(reals[k])
        same = sum(g == r for g, r in zip(got, ref_tok))
        rows[k] = (ppl, quality.common_prefix_fraction(got, ref_tok, a.new), same, oracle_ppl)
        del sim
    secs = step_seconds([base] + [reals[k] for k in levels], steps=a.steps, rounds=a.rounds)
    print(f"without sparsity: decode step {1e3 * secs[0]:.2f} ms ({1 / secs[0]:.1f} tok/s), ppl {ref_ppl:.3f}")
    print("| keep | decode step ms | tok/s | vs without | ppl | ppl ratio | greedy prefix | identical prompts "
          "| ppl ratio, oracle groups |")
    print("|---|---|---|---|---|---|---|---|---|")
    for k, t in zip(levels, secs[1:]):
        ppl, pref, same, orc = rows[k]
        print(f"| {k}/{a.groups} | {1e3 * t:.2f} | {1 / t:.1f} | {secs[0] / t:.2f}x | {ppl:.3f} | "
              f"{ppl / ref_ppl:.4f} | {pref:.3f} | {same}/{len(prompts)} | {orc / ref_ppl:.4f} |")
    print(f"(load {os.getloadavg()[0]:.2f})")
    print("local FFN output error on calibration tokens, mean over FFNs (router groups / oracle groups / "
          "oracle neurons, same count), router recall of the top groups:")
    for k in levels:
        cs = [c for c in cal if c is not None]
        if k >= a.groups:
            continue
        print(f"  {k}/{a.groups}: {np.mean([c.local(k)[0] for c in cs]):.3f} / "
              f"{np.mean([c.local(k, oracle=True)[0] for c in cs]):.3f} / "
              f"{np.mean([c.neuron_error[k] for c in cs]):.3f}; recall {np.mean([c.local(k)[1] for c in cs]):.3f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
