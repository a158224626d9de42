"""Serving generation: continuous batching (every row equals the request run alone, greedy, while others join
and leave), the OpenAI-compatible endpoints through the real ``openai`` client and curl, the OIP generate
extension, refusals (400 / 404 / 429), client disconnects and the SIGTERM drain. Tiny Llama (decoder recipe:
GroupQueryAttention, one shared cache buffer) and a word-level tokenizer (``w5 w17`` ...)."""

from __future__ import annotations

import concurrent.futures
import json
import os
import random
import shutil
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request

import pytest

from conftest import load_models_module

pytest.importorskip("onnxruntime")
pytest.importorskip("transformers")
pytest.importorskip("starlette", reason="the serve extra (installed by the dev extra)")
openai = pytest.importorskip("openai", reason="the dev extra installs openai")

from servekit import ThreadServer, free_port  # noqa: E402
from test_generate_cli import save_tokenizer  # noqa: E402

CONTEXT = 128  # the tiny config's max_position_embeddings


@pytest.fixture(scope="module")
def tiny():
    return load_models_module("tiny")


@pytest.fixture(scope="module")
def gqa_dir(tiny, tmp_path_factory):
    """The tiny Llama through the decoder recipe, with its tokenizer and config files beside it."""
    from graphopt import io
    from graphopt.engine.options import OptimizeOptions
    from graphopt.engine.pipeline import optimize

    d = tmp_path_factory.mktemp("tiny-gqa")
    result = optimize(tiny.build("llama", "causal-lm-with-past"), OptimizeOptions())
    assert result.ok and result.report.recipe == "decoder"
    io.save(result.model, d / "model.onnx")
    for f in ("config.json", "generation_config.json"):
        shutil.copy(tiny.build_folder("llama", "causal-lm-with-past") / f, d / f)
    save_tokenizer(d)
    return d


def _prompts(n: int, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(4, 1000) for _ in range(rng.randrange(1, 30))] for _ in range(n)]


def _drive(sched, work, rng):
    """Add ``work`` (Sequences) at random steps while the scheduler runs; the number of steps."""
    pending, steps = list(work), 0
    while pending or not sched.idle:
        if pending and rng.random() < 0.4:
            sched.add(pending.pop(0))
        sched.step()
        steps += 1
    return steps


def test_rows_joining_and_leaving_equal_each_request_alone(gqa_dir):
    from graphopt.generate.loop import generate, open_decoder
    from graphopt.generate.scheduler import Scheduler, Sequence

    dec = open_decoder(gqa_dir / "model.onnx")
    rng = random.Random(1)
    prompts = _prompts(24)
    limits = [rng.randrange(1, 30) for _ in prompts]
    stops = frozenset({2, 500})
    alone = [generate(dec, p, max_new_tokens=m, stop_ids=stops).token_ids for p, m in zip(prompts, limits)]
    sched = Scheduler(dec, slots=4, context=CONTEXT)
    assert sched.batched and sched.slots == 4
    seqs = [Sequence(p, m, stop_ids=stops) for p, m in zip(prompts, limits)]
    _drive(sched, seqs, rng)
    assert [s.tokens for s in seqs] == alone
    assert all(s.finish in ("stop", "length") for s in seqs)
    # batched: fewer decode runs than rows decoded, never more rows at once than slots
    assert sched.decode_rows > 1.5 * sched.decode_runs
    assert sched.prefills == len(prompts)


def test_cancel_frees_the_slot_and_the_rest_are_unchanged(gqa_dir):
    from graphopt.generate.loop import generate, open_decoder
    from graphopt.generate.scheduler import Scheduler, Sequence

    dec = open_decoder(gqa_dir / "model.onnx")
    prompts = _prompts(3, seed=2)
    sched = Scheduler(dec, slots=2, context=CONTEXT)
    a, b, c = (sched.add(Sequence(p, 20)) for p in prompts)
    sched.step()
    assert sched.active == 2 and list(sched.waiting) == [c]
    sched.cancel(a)
    sched.step()  # a leaves, c takes its slot
    assert a.finish == "cancelled" and len(a.tokens) == 1 and c.slot == 0
    while not sched.idle:
        sched.step()
    assert b.tokens == generate(dec, prompts[1], max_new_tokens=20).token_ids
    assert c.tokens == generate(dec, prompts[2], max_new_tokens=20).token_ids


def test_prefill_budget_spreads_a_burst_of_newcomers_over_steps(gqa_dir):
    from graphopt.generate.loop import open_decoder
    from graphopt.generate.scheduler import Scheduler, Sequence

    sched = Scheduler(open_decoder(gqa_dir / "model.onnx"), slots=8, context=CONTEXT, prefill_tokens=25)
    seqs = [sched.add(Sequence([5] * 10, 30)) for _ in range(6)] + [sched.add(Sequence([6] * 40, 30))]
    admitted = []
    for _ in range(5):
        sched.step()
        admitted.append(sched.active)
    assert admitted == [2, 4, 6, 7, 7]  # 2 x 10 tokens fit in 25; the 40-token prompt goes alone
    assert all(len(s.tokens) >= 1 for s in seqs)


def test_newcomers_share_one_prefill_in_place_or_staged_and_equal_each_request_alone(gqa_dir):
    from graphopt.generate.loop import generate, open_decoder
    from graphopt.generate.scheduler import Scheduler, Sequence

    dec = open_decoder(gqa_dir / "model.onnx")
    rng = random.Random(4)
    prompts = [[rng.randrange(4, 1000) for _ in range(n)] for n in (20, 19, 20, 18, 21, 20, 7)]
    limits = [1, 12, 1, 12, 12, 12, 12]
    sched = Scheduler(dec, slots=4, context=CONTEXT)
    seqs = [Sequence(p, m) for p, m in zip(prompts, limits)]
    for s in seqs[:4]:
        sched.add(s)
    sched.step()  # one forward over slots 0-3 (in place); the two of max_new 1 leave slots 0 and 2
    assert sched.prefill_runs == 1 and sched.prefills == 4 and sched.running[0] is sched.running[2] is None
    for s in seqs[4:]:
        sched.add(s)
    sched.step()  # 21 and 20 tokens into slots 0 and 2: one staged forward, copied into the slots
    assert (seqs[4].slot, seqs[5].slot) == (0, 2) and sched.prefill_runs == 2 and sched.prefills == 6
    while not sched.idle:
        sched.step()
    assert [s.tokens for s in seqs] == [generate(dec, p, max_new_tokens=m).token_ids for p, m in zip(prompts, limits)]
    assert sched.prefill_runs == 3  # the 7-token prompt: padded to 20 it would waste too much; alone


def test_prompts_that_begin_alike_reuse_the_stored_positions_and_equal_each_request_alone(gqa_dir):
    """A shared beginning of >= MIN_PREFIX tokens is copied from the prefix store, not prefilled; the tokens are
    those of each request alone, and the continued prefill's logits those of a prefill from the start."""
    import numpy as np

    from graphopt.generate.cache import KVCache
    from graphopt.generate.loop import generate, open_decoder
    from graphopt.generate.scheduler import MIN_PREFIX, Scheduler, Sequence

    dec = open_decoder(gqa_dir / "model.onnx")
    rng = random.Random(7)
    system = [rng.randrange(4, 1000) for _ in range(24)]
    tails = [[rng.randrange(4, 1000) for _ in range(n)] for n in (9, 1, 14, 0, 5)]
    prompts = [system + t for t in tails] + [system[:MIN_PREFIX - 1] + [7, 8, 9]]
    prompts.insert(2, list(prompts[0]))  # the same prompt again: all but its last two positions reused
    alone = [generate(dec, p, max_new_tokens=10).token_ids for p in prompts]
    sched = Scheduler(dec, slots=3, context=CONTEXT)
    seqs = [Sequence(p, 10) for p in prompts]
    sched.add(seqs[0])
    sched.step()  # the first prompt prefilled from its start, then kept
    assert sched.prefixes.hits == 0 and sched.prefixes.tokens[0] is not None
    _drive(sched, seqs[1:], random.Random(3))
    assert [s.tokens for s in seqs] == alone
    # each later prompt but the last reuses its common beginning with a stored one, at most its length - 2:
    # system + 1 token: 23; the repeated prompt: 31 of 33; system + 14: 24; system alone: 22; system + 5: 24;
    # the last shares only MIN_PREFIX - 1 tokens and is prefilled from its start
    assert sched.prefixes.hits == 5
    assert sched.prefixes.reused == 23 + 31 + 24 + 22 + 24
    # the continued forward's logits against a prefill from the start, for one prompt
    p = prompts[1]
    full = KVCache(dec.sig, 1, CONTEXT)
    ref = dec.step(full, np.array([p]), np.ones((1, len(p)), np.int64), np.arange(len(p))[None, :])
    part = KVCache(dec.sig, 1, CONTEXT)
    m = 24
    dec.step(part, np.array([p[:m]]), np.ones((1, m), np.int64), np.arange(m)[None, :])
    got = dec.step(part.rows(0, 1), np.array([p[m:]]), np.ones((1, len(p)), np.int64),
                   np.arange(m, len(p))[None, :])
    np.testing.assert_allclose(got, ref, rtol=0, atol=1e-4)


def test_the_prefill_budget_counts_the_positions_that_run(gqa_dir):
    """Positions taken from the prefix store do not count against --prefill-tokens."""
    from graphopt.generate.loop import open_decoder
    from graphopt.generate.scheduler import Scheduler, Sequence

    dec = open_decoder(gqa_dir / "model.onnx")
    rng = random.Random(9)
    system = [rng.randrange(4, 1000) for _ in range(24)]
    prompts = [system + [rng.randrange(4, 1000) for _ in range(16)] for _ in range(4)]
    admitted = {}
    for cache in (4, 0):
        sched = Scheduler(dec, slots=8, context=CONTEXT, prefill_tokens=40, prefix_cache=cache)
        sched.add(Sequence(prompts[0], 30))
        sched.step()
        for p in prompts[1:]:
            sched.add(Sequence(p, 30))
        sched.step()
        admitted[cache] = sched.active
    assert admitted == {4: 3, 0: 2}  # 16 positions run per newcomer with the store (2 fit in 40), 40 without


def test_no_prefix_store_when_disabled_and_short_prompts_are_not_kept(gqa_dir):
    from graphopt.generate.loop import open_decoder
    from graphopt.generate.scheduler import MIN_PREFIX, Scheduler, Sequence

    dec = open_decoder(gqa_dir / "model.onnx")
    assert Scheduler(dec, slots=2, context=CONTEXT, prefix_cache=0).prefixes is None
    sched = Scheduler(dec, slots=2, context=CONTEXT)
    for _ in range(2):
        sched.add(Sequence([5] * (MIN_PREFIX - 1), 3))
    while not sched.idle:
        sched.step()
    assert sched.prefixes.hits == 0 and all(t is None for t in sched.prefixes.tokens)


def test_prefill_groups_bound_the_padding():
    from graphopt.generate.scheduler import prefill_groups

    assert prefill_groups([10, 10, 10]) == [[0, 1, 2]]
    assert prefill_groups([10, 30, 9, 29, 5]) == [[1, 3], [0, 2], [4]]  # 2 x 30 <= 1.1 x 59; 3 x 10 > 1.1 x 24
    assert prefill_groups([8, 8], waste=0.0) == [[0, 1]] and prefill_groups([8, 7], waste=0.0) == [[0], [1]]


def test_cache_row_views_bind_their_rows_only(gqa_dir):
    from graphopt.errors import UsageError
    from graphopt.generate.cache import KVCache
    from graphopt.generate.loop import open_decoder

    sig = open_decoder(gqa_dir / "model.onnx").sig
    cache = KVCache(sig, 3, 16)
    assert cache.rows(1, 2).values[0].shape() == [2, sig.kv_heads, 16, sig.head_dim]
    assert cache.rows(1, 2).values[0] is cache.rows(1, 2).values[0]  # made once
    with pytest.raises(UsageError, match="outside"):
        cache.rows(2, 2)
    src = KVCache(sig, 1, 4)
    src._shared[0][0] = 1.0
    cache.copy_row(src, 0, 2, 3)
    assert cache._shared[0][2, :, :3].min() == 1.0 and cache._shared[0][2, :, 3:].max() == 0.0
    assert cache._shared[0][:2].max() == 0.0


def test_graph_without_shared_buffer_runs_one_request_at_a_time(tiny):
    from graphopt.generate.loop import generate, open_decoder
    from graphopt.generate.scheduler import Scheduler, Sequence

    dec = open_decoder(tiny.build("llama", "causal-lm-with-past"))
    sched = Scheduler(dec, slots=8, context=CONTEXT)
    assert not sched.batched and sched.slots == 1
    prompts = _prompts(4, seed=3)
    seqs = [Sequence(p, 12) for p in prompts]
    _drive(sched, seqs, random.Random(0))
    assert [s.tokens for s in seqs] == [generate(dec, p, max_new_tokens=12).token_ids for p in prompts]
    assert sched.decode_rows == sched.decode_runs  # one row per run


def test_prompt_checks(gqa_dir):
    from graphopt.errors import UsageError
    from graphopt.generate.loop import open_decoder
    from graphopt.generate.scheduler import Scheduler

    sched = Scheduler(open_decoder(gqa_dir / "model.onnx"), slots=2, context=CONTEXT)
    assert sched.check([5] * 100, 64) == 28  # prompt and new tokens within the context
    with pytest.raises(UsageError, match="the prompt is 128 tokens; the model takes at most 128"):
        sched.check([5] * 128, 1)
    with pytest.raises(UsageError, match="token id 1000 is outside the model's vocabulary of 1000"):
        sched.check([5, 1000], 1)
    with pytest.raises(UsageError, match="at most 4096 positions"):
        Scheduler(sched.decoder, context=5000)


def test_text_stream_holds_back_partial_stop_strings():
    from graphopt.serve.textstream import TextStream

    class Words:  # id -> "wN", joined by spaces
        def decode(self, ids, skip_special_tokens=True):
            return " ".join(f"w{i}" for i in ids)

    s = TextStream(Words(), ["w7 w8"])
    assert s.push(5) == "w5"
    assert s.push(7) == " "  # "w7" may start the stop string: held back
    assert s.push(9) == "w7 w9"
    assert s.push(7) == " " and s.push(8) == "" and s.stopped
    assert s.text == "w5 w7 w9 " and s.flush() == ""
    plain = TextStream(Words())
    assert "".join([plain.push(4), plain.push(5), plain.flush()]) == "w4 w5"


class _Server(ThreadServer):
    """The generation app on a loopback port, in a thread, and an ``openai`` client of it."""

    def __init__(self, folder, **options):
        from graphopt.serve.genapp import make_generation_app
        from graphopt.serve.generation import DecoderService

        self.service = DecoderService.load(folder / "model.onnx", **options)
        super().__init__(app=make_generation_app(self.service))
        self.url = f"http://127.0.0.1:{self.port}"
        self.client = openai.OpenAI(base_url=self.url + "/v1", api_key="none", max_retries=0)

    def stats(self) -> dict:
        return json.loads(urllib.request.urlopen(f"{self.url}/v2/models/model/stats").read())


@pytest.fixture(scope="module")
def server(gqa_dir):
    srv = _Server(gqa_dir, slots=4, context=CONTEXT, max_queue=64)
    yield srv
    srv.stop()


def _alone(gqa_dir, text, n, *, chat=False):
    from graphopt.generate.text import generate_text

    return generate_text(gqa_dir / "model.onnx", text, max_new_tokens=n, chat=chat)


def test_openai_completions_chat_and_streams_equal_the_request_alone(server, gqa_dir):
    c = server.client
    assert [m.id for m in c.models.list().data] == ["model"]
    want = _alone(gqa_dir, "w5 w17 w99", 12)
    r = c.completions.create(model="model", prompt="w5 w17 w99", max_tokens=12, temperature=0)
    assert r.choices[0].text == want.text and r.choices[0].finish_reason == want.generation.finish
    assert (r.usage.prompt_tokens, r.usage.completion_tokens) == (3, len(want.generation.token_ids))
    chunks = list(c.completions.create(model="model", prompt="w5 w17 w99", max_tokens=12, temperature=0,
                                       stream=True))
    assert len(chunks) > 3 and "".join(ch.choices[0].text for ch in chunks) == want.text
    assert chunks[-1].choices[0].finish_reason == want.generation.finish

    chat = _alone(gqa_dir, "w40 w41", 10, chat=True)
    r = c.chat.completions.create(model="model", messages=[{"role": "user", "content": "w40 w41"}],
                                  max_tokens=10, temperature=0)
    assert r.choices[0].message.content == chat.text and r.choices[0].message.role == "assistant"
    parts = list(c.chat.completions.create(model="model", messages=[{"role": "user", "content": "w40 w41"}],
                                           max_tokens=10, temperature=0, stream=True,
                                           stream_options={"include_usage": True}))
    assert "".join(p.choices[0].delta.content or "" for p in parts if p.choices) == chat.text
    assert parts[0].choices[0].delta.role == "assistant"
    assert parts[-1].usage.completion_tokens == len(chat.generation.token_ids)


def test_concurrent_streams_each_equal_the_request_alone(server, gqa_dir):
    """16 streaming clients at once on 4 slots: requests queue, join and leave the batch; every answer is
    the one the request gets alone."""
    rng = random.Random(5)
    jobs = [(" ".join(f"w{t}" for t in p), rng.randrange(4, 40)) for p in _prompts(16, seed=6)]
    want = [_alone(gqa_dir, text, n).text for text, n in jobs]
    before = server.stats()

    def one(job):
        text, n = job
        stream = server.client.completions.create(model="model", prompt=text, max_tokens=n, temperature=0,
                                                  stream=True)
        return "".join(ch.choices[0].text for ch in stream)

    with concurrent.futures.ThreadPoolExecutor(16) as pool:
        got = list(pool.map(one, jobs))
    assert got == want
    after = server.stats()
    assert after["finished"] - before["finished"] == 16 and after["running"] == 0 and after["queued"] == 0
    runs, rows = after["decode_runs"] - before["decode_runs"], after["decode_rows"] - before["decode_rows"]
    # the rows decoded together (how full the batch gets depends on how fast the client threads submit: on a
    # loaded machine 1.7 rows a run, 2.5+ on a quiet one; one row a run would mean no batching at all)
    assert rows > 1.3 * runs
    assert after["prefills"] - before["prefills"] == 16
    assert 1 <= after["prefill_runs"] - before["prefill_runs"] <= 16


def test_sampling_is_seeded_and_stop_strings_cut_the_text(server):
    c = server.client
    kw = dict(model="model", prompt="w5 w6", max_tokens=20, temperature=1.0, top_p=0.9)
    a, b = (c.completions.create(seed=7, **kw).choices[0].text for _ in range(2))
    assert a == b and a != c.completions.create(seed=8, **kw).choices[0].text
    greedy = c.completions.create(model="model", prompt="w5 w17 w99", max_tokens=12, temperature=0).choices[0].text
    stop = greedy.split(" ")[3]
    r = c.completions.create(model="model", prompt="w5 w17 w99", max_tokens=12, temperature=0, stop=[stop])
    assert r.choices[0].finish_reason == "stop" and r.choices[0].text == greedy[:greedy.index(stop)]
    s = c.completions.create(model="model", prompt="w5 w17 w99", max_tokens=12, temperature=0, stop=stop,
                             stream=True)
    assert "".join(ch.choices[0].text for ch in s) == greedy[:greedy.index(stop)]


@pytest.mark.parametrize(("kwargs", "status", "message"), [
    ({"model": "nope"}, 404, "unknown model 'nope'; this server serves 'model'"),
    ({"max_tokens": 0}, 400, "'max_tokens' must be >= 1"),
    ({"temperature": 3}, 400, "'temperature' must be >= 0 and <= 2"),
    ({"top_p": 0}, 400, "'top_p' must be > 0"),
    ({"n": 2}, 400, "'n' must be 1"),
    ({"stop": ["a", "b", "c", "d", "e"]}, 400, "'stop' must be a string or a list of at most 4"),
    ({"prompt": " ".join(["w5"] * 128)}, 400, "the prompt is 128 tokens; the model takes at most 128"),
    ({"echo": True}, 400, "'echo' is not supported"),
])
def test_bad_requests_get_4xx_with_one_line(server, kwargs, status, message):
    body = {"model": "model", "prompt": "w5", "max_tokens": 3} | kwargs
    with pytest.raises(openai.APIStatusError) as e:
        server.client.completions.create(**body)
    assert e.value.status_code == status and message in e.value.message and "\n" not in e.value.message


def _post(url, body, timeout=30):
    req = urllib.request.Request(url, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"})
    return urllib.request.urlopen(req, timeout=timeout)


def test_oip_generate_and_generate_stream(server, gqa_dir):
    want = _alone(gqa_dir, "w5 w17 w99", 9)
    got = json.loads(_post(f"{server.url}/v2/models/model/generate",
                           {"text_input": "w5 w17 w99", "parameters": {"max_tokens": 9}}).read())
    assert got["text_output"] == want.text and got["details"]["completion_tokens"] == 9
    raw = _post(f"{server.url}/v2/models/model/generate_stream", {"text_input": "w5 w17 w99", "max_tokens": 9}).read()
    events = [json.loads(line[6:]) for line in raw.decode().splitlines() if line.startswith("data: ")]
    assert "".join(e["text_output"] for e in events) == want.text
    assert events[-1]["details"]["finish_reason"] == "length"
    with pytest.raises(urllib.error.HTTPError) as e:
        _post(f"{server.url}/v2/models/other/generate", {"text_input": "w5"})
    assert e.value.code == 404 and "unknown model 'other'" in json.loads(e.value.read())["error"]
    with pytest.raises(urllib.error.HTTPError) as e:
        _post(f"{server.url}/v2/models/model/generate", {"parameters": {}})
    assert e.value.code == 400 and "text_input" in json.loads(e.value.read())["error"]


@pytest.mark.skipif(shutil.which("curl") is None, reason="curl is not installed")
def test_curl_streams_server_sent_events(server, gqa_dir):
    want = _alone(gqa_dir, "w8 w9", 6)
    out = subprocess.run(["curl", "-sN", f"{server.url}/v1/completions", "-H", "Content-Type: application/json",
                          "-d", json.dumps({"prompt": "w8 w9", "max_tokens": 6, "temperature": 0, "stream": True})],
                         capture_output=True, text=True, timeout=60, check=True).stdout
    lines = [x[6:] for x in out.splitlines() if x.startswith("data: ")]
    assert lines[-1] == "[DONE]"
    assert "".join(json.loads(x)["choices"][0]["text"] for x in lines[:-1]) == want.text


def test_a_client_that_goes_away_frees_its_slot(server, monkeypatch):
    # The tiny model makes 120 tokens in tens of milliseconds, faster than a loaded machine notices the closed
    # socket: each step is slowed to a real decoder's pace (20 ms) so the disconnect lands mid-request.
    sched = server.service.engine.scheduler
    step = sched.step

    def slow_step():
        time.sleep(0.02)
        return step()

    monkeypatch.setattr(sched, "step", slow_step)
    before = server.stats()
    stream = server.client.completions.create(model="model", prompt="w5", max_tokens=120, temperature=0,
                                              stream=True, extra_body={"ignore_eos": True})
    next(iter(stream))
    stream.close()
    deadline = time.monotonic() + 10
    while server.stats()["running"]:
        assert time.monotonic() < deadline, "the slot was not freed"
        time.sleep(0.02)
    assert server.stats()["tokens"] - before["tokens"] < 120


def test_full_queue_is_429_not_a_crash(gqa_dir):
    srv = _Server(gqa_dir, slots=1, context=CONTEXT, max_queue=1)
    try:
        body = {"prompt": "w5", "max_tokens": 120, "temperature": 0, "ignore_eos": True}
        with concurrent.futures.ThreadPoolExecutor(4) as pool:
            futs = [pool.submit(lambda: _post(f"{srv.url}/v1/completions", body).status) for _ in range(4)]
            codes = []
            for f in futs:
                try:
                    codes.append(f.result())
                except urllib.error.HTTPError as e:
                    assert "the server is busy" in json.loads(e.read())["error"]["message"]
                    assert e.headers["Retry-After"] == "1"
                    codes.append(e.code)
        assert codes.count(200) == 2 and codes.count(429) == 2  # one running, one queued, two refused
        assert srv.stats()["refused"] == 2
    finally:
        srv.stop()


def test_cli_serve_routes_a_decoder_and_drains_on_sigterm(gqa_dir):
    """`graphopt serve DECODER` in a subprocess: SIGTERM while two streams run; both finish whole."""
    port = free_port()
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    proc = subprocess.Popen([sys.executable, "-m", "graphopt.cli.main", "serve", str(gqa_dir / "model.onnx"),
                             "--port", str(port), "--slots", "2"],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, env=env, text=True)
    try:
        url = f"http://127.0.0.1:{port}"
        deadline = time.monotonic() + 60
        while True:
            assert proc.poll() is None, proc.stdout.read()
            try:
                if json.loads(urllib.request.urlopen(f"{url}/v2/health/ready").read())["ready"]:
                    break
            except OSError:
                pass
            assert time.monotonic() < deadline, "server did not start"
            time.sleep(0.2)
        client = openai.OpenAI(base_url=url + "/v1", api_key="none", max_retries=0)
        streams = [client.completions.create(model="model", prompt="w5 w6", max_tokens=100, temperature=0,
                                             stream=True, extra_body={"ignore_eos": True}) for _ in range(2)]
        firsts = [next(iter(s)) for s in streams]
        proc.send_signal(signal.SIGTERM)
        texts = [f.choices[0].text + "".join(ch.choices[0].text for ch in s) for f, s in zip(firsts, streams)]
        assert all(len(t.split()) == 100 for t in texts), texts
        assert proc.wait(timeout=30) in (0, 128 + signal.SIGTERM, -signal.SIGTERM)
        out = proc.stdout.read()
        assert "serving 'model' (generation, 2 slots" in out and "Traceback" not in out
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
