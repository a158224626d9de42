"""The default recipe on real ONNX models a user brings: files shipped inside PyPI packages (Silero VAD
with If branches and a sample-rate input, PP-OCR detector/classifier/recognizer, Magika, basic-pitch, a
captcha CRNN, a YOLOv8 detector, Open-NSFW, MTCNN, int8 MiniLM embeddings, dynamic-int8 Arabic BiLSTMs,
skl2onnx surrogates) and tabular ``ai.onnx.ml`` models (ORT's own logreg_iris, scikit-learn pipelines
converted with skl2onnx).

The corpus is ``models/corpus.py``; its packages are pinned in ``tools/corpus-requirements.txt`` and
installed by ``tools/install_test_deps.sh`` (CI runs it). A missing package fails the test under CI and
skips it, with the install command, elsewhere.

For every model: optimize with the default recipe through the Python API (feeds generated from the
signature, as a user with no data gets) and through the CLI (with ``--calib`` real-looking feeds, and
with ``--input-shape``/``--input-value`` hints); the run must succeed with numeric verification and no
pass rolled back (``--strict``), the output must load in a plain ONNX Runtime session and match the
original on real-looking input.
"""

from __future__ import annotations

import os

import numpy as np
import onnxruntime as ort
import pytest

from conftest import load_models_module
from graphopt import io
from graphopt.data import feeds as feeds_mod
from graphopt.data.metrics import find_mask
from graphopt.engine import pipeline

corpus = load_models_module("corpus")
IN_CI = bool(os.environ.get("CI"))


def _params(entries):
    out = []
    for e in entries:
        marks = [pytest.mark.xfail(strict=True, reason=e.known_issue)] if e.known_issue else []
        out.append(pytest.param(e, id=e.name, marks=marks))
    return out


ALL = _params(corpus.ENTRIES)
HINTED = _params([e for e in corpus.ENTRIES if e.input_shape or e.input_value])


def _locate(entry):
    try:
        return entry.locate()
    except corpus.CorpusMissing as e:
        if IN_CI:
            pytest.fail(str(e))
        pytest.skip(str(e))


def _plain_outputs(path, feeds):
    """Outputs from a plain ORT session (default optimizations), not through graphopt."""
    sess = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    names = [o.name for o in sess.get_outputs()]
    return [dict(zip(names, sess.run(None, f))) for f in feeds]


def _assert_close(got, ref, where, feeds=None):
    """Outputs match; with an attention mask, ``[batch, seq, ...]`` outputs are compared on real tokens and
    padded positions must be 0 (``remove-padding`` writes zeros there, as its docstring says)."""
    for i, (g, r) in enumerate(zip(got, ref)):
        mask = find_mask(feeds[i]) if feeds else None
        if mask is not None:
            g, r = dict(g), dict(r)
            for k in r:
                a, b = np.asarray(g[k]), np.asarray(r[k])
                if b.ndim >= 3 and b.shape[:2] == mask.shape and a.shape == b.shape:
                    pad = ~mask.astype(bool)
                    assert not np.any(a[pad]) or np.allclose(a[pad], b[pad], atol=1e-4), f"{where}: {k} padded positions"
                    g[k], r[k] = a[~pad], b[~pad]
        assert set(g) == set(r), where
        for k in r:
            a, b = g[k], r[k]
            if isinstance(b, list):  # sequence outputs (ZipMap: one {label: probability} dict per row)
                assert isinstance(a, list) and len(a) == len(b), f"{where}: {k}"
                for da, db in zip(a, b):
                    assert isinstance(da, dict) and da.keys() == db.keys(), f"{where}: {k}"
                    np.testing.assert_allclose([da[x] for x in db], [db[x] for x in db], rtol=1e-3, atol=1e-6)
                continue
            a, b = np.asarray(a), np.asarray(b)
            assert a.shape == b.shape and a.dtype == b.dtype, f"{where}: {k} {a.shape}{a.dtype} vs {b.shape}{b.dtype}"
            if b.dtype.kind in "fc":
                scale = float(np.max(np.abs(b))) if b.size else 1.0
                np.testing.assert_allclose(a, b, rtol=1e-3, atol=1e-5 * max(1.0, scale), err_msg=f"{where}: {k}")
            else:
                np.testing.assert_array_equal(a, b, err_msg=f"{where}: {k}")


#: entry name -> (feeds, the original model's outputs on them): the reference, computed once per model
_REFERENCE: dict[str, tuple[list, list]] = {}


def _check_output(src, out, entry):
    assert out.exists()
    if entry.name not in _REFERENCE:
        feeds = corpus.realistic_feeds(entry, seed=1)
        _REFERENCE[entry.name] = feeds, _plain_outputs(src, feeds)
    feeds, ref = _REFERENCE[entry.name]
    _assert_close(_plain_outputs(out, feeds), ref, f"{entry.name} optimized vs original", feeds)


def _leftovers(folder, keep):
    return sorted(p.name for p in folder.iterdir() if p.name not in keep)


def test_corpus_is_broad():
    """At least ten shipped models, and every kind the issue names."""
    shipped = [e for e in corpus.ENTRIES if e.build is None]
    assert len(shipped) >= 10
    kinds = {e.kind for e in corpus.ENTRIES}
    assert {"audio", "OCR", "tabular", "sequence"} <= kinds
    assert len({e.name for e in corpus.ENTRIES}) == len(corpus.ENTRIES)


def test_corpus_covers_control_flow_and_ml_ops():
    import onnx

    def ops(g):
        for n in g.node:
            yield n.domain or "", n.op_type
            for a in n.attribute:
                for sub in [a.g] if a.HasField("g") else list(a.graphs):
                    yield from ops(sub)

    seen = set()
    for e in corpus.ENTRIES:
        seen |= set(ops(onnx.load(str(_locate(e)), load_external_data=False).graph))
    assert {("", "If"), ("", "Loop"), ("", "Scan"), ("", "LSTM"), ("", "Resize")} <= seen
    assert {op for d, op in seen if d == "ai.onnx.ml"} >= {"TreeEnsembleClassifier", "TreeEnsembleRegressor",
                                                           "ArrayFeatureExtractor", "ZipMap"}


@pytest.mark.parametrize("entry", ALL)
def test_default_recipe_api_generated_feeds(entry, tmp_path):
    """What a user with no data gets: feeds generated from the signature, numeric verification."""
    src = _locate(entry)
    res = pipeline.optimize(src)
    assert res.ok, [(p.name, p.error) for p in res.report.failed()]
    rep = res.report
    # no pass rolled back (the recipe would go on without it and the run still succeed)
    assert [(p.name, p.status) for p in rep.passes if p.status != "ok"] == [], [p.error for p in rep.passes]
    assert rep.numerics == "verified", rep.numerics
    assert rep.verify == "numeric" and rep.feeds not in ("", "none", "no feeds"), rep.feeds
    changed = [p for p in rep.passes if p.modified]
    assert all(p.verification.get("level") == "numeric" for p in changed), [p.verification for p in changed]
    out = io.save(res.model, tmp_path / "opt.onnx")
    _check_output(src, out, entry)


@pytest.mark.parametrize("entry", ALL)
def test_default_recipe_cli_real_feeds(entry, run_cli, tmp_path):
    """The CLI with real-looking feeds (--calib): exit 0, output loads in plain ORT and matches."""
    src = _locate(entry)
    feed_dir = feeds_mod.save_dir(corpus.realistic_feeds(entry), tmp_path / "feeds")
    out_dir = tmp_path / "out"
    out_dir.mkdir()
    out = out_dir / "opt.onnx"
    code, _, err = run_cli("optimize", src, "-o", out, "--calib", feed_dir, "--strict", "-q")
    assert code == 0, err
    assert _leftovers(out_dir, {"opt.onnx"}) == []
    _check_output(src, out, entry)


@pytest.mark.parametrize("entry", HINTED)
def test_default_recipe_cli_input_hints(entry, run_cli, tmp_path):
    """The CLI with the user's shape and value hints (``--input-shape NAME:d,d``, ``--input-value NAME=V``)."""
    src = _locate(entry)
    out = tmp_path / "opt.onnx"
    args = ["optimize", src, "-o", out, "--strict", "-q"]
    for s in entry.input_shape:
        args += ["--input-shape", s]
    for v in entry.input_value:
        args += ["--input-value", v]
    code, _, err = run_cli(*args)
    assert code == 0, err
    assert "numerics unverified" not in err, err
    _check_output(src, out, entry)
