"""Decoder budget metrics: ``ppl_ratio`` and ``greedy_match`` parsed, measured on text, and reported."""

from __future__ import annotations

import json

import numpy as np
import pytest

from graphopt.data.metrics import Comparison, parse_budget
from graphopt.errors import UsageError
from graphopt.generate import quality
from graphopt.generate.cache import new_cache
from rewrites.common.budget import share


def test_parse_decoder_terms():
    b = parse_budget("ppl_ratio<=1.05,greedy_match>=0.9,cosine>=0.99")
    assert [t.metric for t in b.terms] == ["ppl_ratio", "greedy_match", "cosine"]
    assert b.decoder and not b.without_decoder().decoder
    assert [t.decoder for t in b.terms] == [True, True, False]
    # only a share of the slack: ratio terms shrink towards 1, not towards 0
    assert str(share(parse_budget("ppl_ratio<=1.1"), 0.5)) == "ppl_ratio<=1.05"


@pytest.mark.parametrize("spec, words", [
    ("ppl_ratio>=1.05", "bound it from above"),
    ("ppl_ratio<=0.9", "value >= 1"),
    ("greedy_match>=1.5", "fraction"),
    ("greedy_match<=0.5", "from below"),
    ("perplexity<=1.05", "unknown budget metric"),
])
def test_bad_decoder_budgets(spec, words):
    with pytest.raises(UsageError, match=words):
        parse_budget(spec)


def test_unmeasured_decoder_term_fails():
    b = parse_budget("ppl_ratio<=1.05")
    assert b.failures(Comparison({})) == ["ppl_ratio<=1.05 not measured (a decoder metric: it needs a decoder "
                                          "with past and text)"]
    assert b.failures(Comparison({}, decoder={"ppl_ratio": 1.04})) == []
    assert b.failures(Comparison({}, decoder={"ppl_ratio": 1.06}))[0].startswith("ppl_ratio<=1.05 not met")


def test_rows_are_disjoint():
    ids = list(range(1000))
    rows = quality.split_tokens(ids, window=50, prompt_tokens=10, new_tokens=4)
    calib = {t for w in rows.windows["calib"] for t in w}
    held = {t for w in rows.windows["held"] for t in w}
    assert calib and held and not calib & held
    assert len(rows.windows["calib"]) == len(rows.windows["held"]) == 10
    assert {t for p in rows.prompts["held"] for t in p} <= held
    assert {t for p in rows.prompts["calib"] for t in p} <= calib
    with pytest.raises(UsageError, match="at least 100"):
        quality.split_tokens(ids[:99], window=50)


def test_common_prefix_fraction():
    assert quality.common_prefix_fraction([[1, 2, 3, 4]], [[1, 2, 3, 4]], 4) == 1.0
    # the same tokens after a difference do not count: the continuations start from different texts
    assert quality.common_prefix_fraction([[1, 9, 3, 4], [5, 6, 7, 8]], [[1, 2, 3, 4], [0, 6, 7, 8]], 4) == 0.125


def test_a_model_against_itself(tiny_llama):
    check = quality.decoder_check(tiny_llama)
    m = check.measure(tiny_llama, quality.HELD)
    assert m["ppl_ratio"] == 1.0 and m["greedy_match"] == 1.0
    # the perplexity is the teacher-forced one: one window by hand, token by token through the cache
    dec = quality.open_decoder(tiny_llama)
    w = check.rows.windows["held"][0]
    cache = new_cache(dec.sig, 1, len(w))
    nll = 0.0
    for i in range(len(w) - 1):
        logits = dec.step(cache, np.array([[w[i]]]), np.ones((1, i + 1), np.int64), np.array([[i]]))[0]
        logits = logits.astype(np.float64) - logits.max()
        nll += np.log(np.exp(logits).sum()) - logits[w[i + 1]]
    np.testing.assert_allclose(quality.perplexity(dec, [w]), np.exp(nll / (len(w) - 1)), rtol=1e-5)


def test_verify_reports_decoder_metrics(run_cli, tiny_llama, tmp_path):
    text = tmp_path / "text.txt"
    text.write_text("The quick brown fox jumps over the lazy dog. " * 20)
    code, out, _ = run_cli("verify", tiny_llama, tiny_llama, "--calib", text, "--budget",
                           "ppl_ratio<=1.0,greedy_match>=1", "--json")
    d = json.loads(out)
    assert code == 0 and d["ok"], d["failures"]
    assert d["summary"]["ppl_ratio"] == 1.0 and d["summary"]["greedy_match"] == 1.0
    assert str(text) in d["text"] and "UTF-8 bytes" in d["text"]


def test_decoder_budget_usage_errors(run_cli, tiny_llama, mlp_path, tmp_path):
    code, _, err = run_cli("verify", tiny_llama, tiny_llama, "--budget", "ppl_ratio>=2")
    assert code == 2 and "ppl_ratio" in err and len(err.strip().splitlines()) <= 2
    # a decoder metric on a model that is not a decoder with past: one line, exit 2
    code, _, err = run_cli("verify", mlp_path, mlp_path, "--budget", "ppl_ratio<=1.05")
    assert code == 2 and "not a decoder with past" in err
    code, _, err = run_cli("verify", tiny_llama, tiny_llama, "--budget", "ppl_ratio<=1.05", "--calib",
                           tmp_path / "missing.txt")
    assert code == 2


def test_search_refuses_decoder_budgets(run_cli, tiny_llama, tmp_path):
    code, _, err = run_cli("optimize", tiny_llama, "-o", tmp_path / "o.onnx", "--search", "--budget", "ppl_ratio<=1.05")
    assert code == 2 and "not searched" in err and not (tmp_path / "o.onnx").exists()
