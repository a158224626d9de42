"""Per-op-type cost of one decode step (batch 1) of decoder ONNX files, from ONNX Runtime's profiler.

Each model gets a session with ``enable_profiling`` (1 thread, spinning off unless ``--threads``), a prefill of
``--prompt`` tokens and ``--steps`` decode steps through graphopt's runtime (``Decoder`` + ``KVCache``); only the
node events of the decode steps are counted (the prefill and the first ``--skip`` steps are dropped; ``--prefill``: the
``--prompt``-token prefill instead, run ``--steps`` times into fresh caches; ``--batch N``: N rows a step). Printed per
model: ms per step by op type (kernel time summed over nodes), node count per step, and the step's wall time.
Works on any graph ``graphopt.generate.signature.read_signature`` accepts (graphopt builds, ONNX Runtime GenAI's
``model.onnx``).

    python tools/profile_decode.py q4-int4.onnx ~/.cache/graphopt/models/genai/*int4*/model.onnx --steps 24
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import statistics
import sys
import tempfile
import time

import numpy as np


def _signature(sess, path: str):
    """graphopt's signature of the session; a GenAI ``model.onnx`` (symbolic head size, the buffer shared by
    past and present as its ``genai_config.json`` says) gets the head size and sharing from that config."""
    from types import SimpleNamespace

    from graphopt.generate.signature import KV_CACHE_KEY, read_signature

    cfg = os.path.join(os.path.dirname(path), "genai_config.json")
    if not os.path.isfile(cfg):
        return read_signature(sess, name=path)
    with open(cfg) as f:
        c = json.load(f)
    head = c["model"]["decoder"]["head_size"]
    shared = c.get("search", {}).get("past_present_share_buffer", False)

    def fix(a):
        shape = list(a.shape)
        if a.name.startswith(("past_key_values.", "present.")) and len(shape) == 4:
            shape[3] = head
        return SimpleNamespace(name=a.name, shape=shape, type=a.type)

    meta = {KV_CACHE_KEY: "shared-buffer"} if shared else {}
    return read_signature([fix(a) for a in sess.get_inputs()], [fix(a) for a in sess.get_outputs()],
                          name=path, metadata=meta)


def profile(path: str, *, prompt: int, steps: int, skip: int, threads: int, prefill: bool = False,
            batch: int = 1) -> dict:
    import onnxruntime as ort

    from graphopt.generate.cache import KVCache
    from graphopt.generate.loop import Decoder

    so = ort.SessionOptions()
    so.intra_op_num_threads = threads
    so.inter_op_num_threads = 1
    so.add_session_config_entry("session.intra_op.allow_spinning", "0")
    so.enable_profiling = True
    so.profile_file_prefix = os.path.join(tempfile.mkdtemp(prefix="profile_decode."), "p")
    sess = ort.InferenceSession(path, so, providers=["CPUExecutionProvider"])
    dec = Decoder(sess, _signature(sess, path))
    b = batch  # rows of the same length: row r's prompt is shifted by r token ids
    cache = KVCache(dec.sig, b, prompt + steps + 1)
    ids = (np.arange(prompt, dtype=np.int64)[None, :] + np.arange(b, dtype=np.int64)[:, None]) % 97 + 3
    pos = np.broadcast_to(np.arange(prompt, dtype=np.int64), (b, prompt))
    logits = dec.step(cache, ids, np.ones((b, prompt), np.int64), pos)
    walls = []
    for _ in range(steps if prefill else 0):  # --prefill: the prompt again into a fresh cache, each run counted
        cache = KVCache(dec.sig, b, prompt + 1)
        t0 = time.perf_counter()
        dec.step(cache, ids, np.ones((b, prompt), np.int64), pos)
        walls.append(time.perf_counter() - t0)
    for s in range(0 if prefill else steps):
        tok = np.argmax(logits, axis=-1).reshape(b, 1).astype(np.int64)
        t0 = time.perf_counter()
        logits = dec.step(cache, tok, np.ones((b, prompt + s + 1), np.int64),
                          np.full((b, 1), prompt + s, np.int64))
        walls.append(time.perf_counter() - t0)
    trace = sess.end_profiling()
    with open(trace) as f:
        events = json.load(f)
    runs = sorted((e for e in events if e.get("name") == "model_run"), key=lambda e: e["ts"])
    keep = runs[1 + skip:]  # the first prefill, then the warm-up steps (decode steps or, --prefill, prefills)
    if not keep:
        raise SystemExit(f"{path}: no decode step left to count (steps {steps}, skip {skip})")
    spans = [(e["ts"], e["ts"] + e["dur"]) for e in keep]
    per_op: dict[str, float] = collections.defaultdict(float)
    count: dict[str, int] = collections.defaultdict(int)
    per_node: dict[str, float] = collections.defaultdict(float)
    for e in events:
        if e.get("cat") != "Node" or not e.get("name", "").endswith("_kernel_time"):
            continue
        ts = e["ts"]
        if any(a <= ts <= b for a, b in spans):
            op = e.get("args", {}).get("op_name", "?")
            per_op[op] += e["dur"]
            per_node[f"{op} {e['name'][:-len('_kernel_time')]}"] += e["dur"]
            count[op] += 1
    n = len(keep)
    run_ms = statistics.median(e["dur"] for e in keep) / 1e3
    return {"model": path, "steps": n, "wall_ms": 1e3 * statistics.median(walls[skip:] or walls),
            "run_ms": run_ms,
            "ops": {op: {"ms": per_op[op] / n / 1e3, "nodes": count[op] // n}
                    for op in sorted(per_op, key=per_op.get, reverse=True)},
            "nodes": {k: per_node[k] / n / 1e3 for k in sorted(per_node, key=per_node.get, reverse=True)}}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("models", nargs="+")
    ap.add_argument("--prompt", type=int, default=16)
    ap.add_argument("--steps", type=int, default=24)
    ap.add_argument("--skip", type=int, default=4)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--top", type=int, default=0, help="also print the N costliest nodes")
    ap.add_argument("--prefill", action="store_true",
                    help="count the prefill of --prompt tokens (run --steps times) instead of decode steps")
    ap.add_argument("--batch", type=int, default=1, help="rows per step (equal lengths)")
    ap.add_argument("--json")
    a = ap.parse_args(argv)
    out = []
    for m in a.models:
        r = profile(m, prompt=a.prompt, steps=a.steps, skip=a.skip, threads=a.threads, prefill=a.prefill,
                    batch=a.batch)
        out.append(r)
        total = sum(o["ms"] for o in r["ops"].values())
        print(f"\n{m}: {'prefill' if a.prefill else 'decode step'} wall {r['wall_ms']:.2f} ms, model_run {r['run_ms']:.2f} ms, "
              f"kernels {total:.2f} ms, {sum(o['nodes'] for o in r['ops'].values())} nodes")
        for op, o in r["ops"].items():
            print(f"  {op:34s} {o['ms']:8.3f} ms  {o['nodes']:5d} nodes  {100 * o['ms'] / total:5.1f}%")
        for k, ms in list(r["nodes"].items())[:a.top]:
            print(f"    {ms:8.3f} ms  {k}")
    if a.json:
        with open(a.json, "w") as f:
            json.dump(out, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
