"""How far neuron-level contextual sparsity can go on a decoder before perplexity moves: an oracle upper bound.

Each projection's input is thresholded per token by magnitude (TEAL's form: the input is known before the matmul,
so the selection costs nothing and needs no predictor), at four sites per layer: the input of the q/k/v
projections, of the output projection, of the gate/up projections and of the down projection. Zeroed inputs
mean weight rows a gathered kernel would not read; the bound on the decode speed-up is the bytes of a dense step
over the bytes read, with selection, gathering and every other overhead free (a memory-bound step). Keep levels
are chosen on calibration text and confirmed on held-out text:

1. uniform levels per site (every layer the same);
2. per-(layer, site) sensitivity at ``--probe`` keep, ranked by perplexity increase per weight byte saved; the
   longest prefix of that ranking whose calibration perplexity stays within ``--budget`` (bisection), then the
   held-out perplexity of that choice.

Needs torch and transformers (the test extra). Example (SmolLM2-135M from ``models/smollm2.py``)::

    python tools/sparsity_bound.py --hf ~/.cache/graphopt/models/smollm2-135m/hf --budget 1.03
"""

from __future__ import annotations

import argparse
import math
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

SITES = ("qkv", "o", "gate_up", "down")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--hf", required=True, type=Path, help="Hugging Face folder of a Llama-family decoder")
    ap.add_argument("--heldout", type=Path, default=REPO / "graphopt/bench/data/heldout.txt",
                    help="text for the confirming perplexity (never used to choose)")
    ap.add_argument("--window", type=int, default=128, help="tokens per perplexity window")
    ap.add_argument("--budget", type=float, default=1.03, help="largest perplexity ratio allowed")
    ap.add_argument("--probe", type=float, default=0.5, help="keep fraction of the per-layer sensitivity probe")
    ap.add_argument("--levels", default="0.8,0.6,0.5,0.4", help="uniform keep fractions to tabulate per site")
    ap.add_argument("--threads", type=int, default=1)
    args = ap.parse_args()

    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from graphopt.data.heldout import TEXT

    torch.set_num_threads(args.threads)
    tok = AutoTokenizer.from_pretrained(args.hf)
    model = AutoModelForCausalLM.from_pretrained(args.hf, dtype=torch.float32).eval()
    cfg = model.config
    layers = model.model.layers
    keep: dict[tuple[int, str], float] = {}

    def windows(text: str) -> list:
        ids = tok(text, return_tensors="pt").input_ids[0]
        w = args.window
        return [ids[i:i + w] for i in range(0, len(ids) - w + 1, w)]

    calib, held = windows(TEXT), windows(args.heldout.read_text())

    def hook(index: int, site: str):
        def pre(_module, inputs):
            f = keep.get((index, site), 1.0)
            if f >= 1.0:
                return None
            x = inputs[0]
            k = max(1, int(round(x.shape[-1] * f)))
            thr = x.abs().topk(k, dim=-1).values[..., -1:]
            return (torch.where(x.abs() >= thr, x, torch.zeros_like(x)),)
        return pre

    for i, layer in enumerate(layers):
        a, m = layer.self_attn, layer.mlp
        for mod in (a.q_proj, a.k_proj, a.v_proj):
            mod.register_forward_pre_hook(hook(i, "qkv"))
        a.o_proj.register_forward_pre_hook(hook(i, "o"))
        m.gate_proj.register_forward_pre_hook(hook(i, "gate_up"))
        m.up_proj.register_forward_pre_hook(hook(i, "gate_up"))
        m.down_proj.register_forward_pre_hook(hook(i, "down"))

    # weights (parameters) read per token at each site of one layer, and outside the layers (the LM head)
    a0, m0 = layers[0].self_attn, layers[0].mlp
    site_params = {"qkv": sum(p.weight.numel() for p in (a0.q_proj, a0.k_proj, a0.v_proj)),
                   "o": a0.o_proj.weight.numel(),
                   "gate_up": m0.gate_proj.weight.numel() + m0.up_proj.weight.numel(),
                   "down": m0.down_proj.weight.numel()}
    head = cfg.vocab_size * cfg.hidden_size
    dense = head + len(layers) * sum(site_params.values())

    def saved_params() -> float:
        return sum(site_params[s] * (1.0 - f) for (_, s), f in keep.items())

    def bound(head_share_of: float = 1.0) -> float:
        # head_share_of: bytes per head weight relative to the layers' (the int4 build's head is 8-bit: 2.0)
        d = head * head_share_of + (dense - head)
        return d / (d - saved_params())

    @torch.no_grad()
    def ppl(wins) -> float:
        nll, n = 0.0, 0
        for w in wins:
            logits = model(w[None]).logits[0, :-1]
            nll += torch.nn.functional.cross_entropy(logits, w[1:], reduction="sum").item()
            n += len(w) - 1
        return math.exp(nll / n)

    t0 = time.time()
    base_c, base_h = ppl(calib), ppl(held)
    print(f"{cfg.model_type}, {len(layers)} layers; calibration {len(calib)} x {args.window} tokens, held-out "
          f"{len(held)} x {args.window}; dense ppl calib {base_c:.3f} held {base_h:.3f}")
    shares = {s: len(layers) * p / dense for s, p in site_params.items()}
    print("weight share of a step (fp32 build): " + ", ".join(f"{s} {v:.1%}" for s, v in shares.items())
          + f", head {head / dense:.1%}")
    print("\n| site | keep | calib ppl ratio | held-out ppl ratio | bound fp32 | bound 4-bit (8-bit head) |")
    print("|---|---:|---:|---:|---:|---:|")
    for s in SITES:
        for f in (float(v) for v in args.levels.split(",")):
            keep.clear()
            keep.update({(i, s): f for i in range(len(layers))})
            print(f"| {s} | {f:g} | {ppl(calib) / base_c:.4f} | {ppl(held) / base_h:.4f} | {bound():.3f}x "
                  f"| {bound(2.0):.3f}x |", flush=True)

    keep.clear()
    cost = []
    for i in range(len(layers)):
        for s in SITES:
            keep[(i, s)] = args.probe
            cost.append(((ppl(calib) / base_c - 1.0) / (site_params[s] * (1 - args.probe)), (i, s)))
            del keep[(i, s)]
    cost.sort()

    def take(n: int) -> float:
        keep.clear()
        keep.update({key: args.probe for _, key in cost[:n]})
        return ppl(calib) / base_c

    lo, hi = 0, len(cost)
    while lo < hi:  # largest prefix within the budget on calibration text
        mid = (lo + hi + 1) // 2
        if take(mid) <= args.budget:
            lo = mid
        else:
            hi = mid - 1
    r_c = take(lo)
    r_h = ppl(held) / base_h
    by_site = {s: sum(1 for _, (_, t) in cost[:lo] if t == s) for s in SITES}
    print(f"\nranked per-layer choice at keep {args.probe:g} within calib ppl ratio <= {args.budget}: {lo} of "
          f"{len(cost)} (layer, site) pairs ({', '.join(f'{s} {n}' for s, n in by_site.items())}); calib "
          f"{r_c:.4f}, held-out {r_h:.4f}; weights skipped {saved_params() / dense:.1%} of a dense step; bound "
          f"{bound():.3f}x (fp32 build), {bound(2.0):.3f}x (4-bit layers, 8-bit head)  [{time.time() - t0:.0f} s]")


if __name__ == "__main__":
    main()
