"""graphopt serve end to end: Triton's own HTTP client against the server on a loopback port.

Every answer is compared with a direct ONNX Runtime run of the original MiniLM export on the same real
tokens (one unpadded row), within the tolerance of the lossless pipeline.
"""

from __future__ import annotations

import concurrent.futures
import http.client
import json
import os
import random
import signal
import subprocess
import sys
import time

import numpy as np
import pytest
from servekit import INPUTS, ThreadServer, feed, free_port, remove_padding_minilm, token_rows

pytest.importorskip("starlette", reason="the serve extra (installed by the dev extra)")
httpclient = pytest.importorskip("tritonclient.http", reason="the dev extra installs tritonclient[http]")

ATOL = 1e-4  # cleanup, fuse, remove-padding are lossless (verified to 1e-4 by the pipeline)
NAME = "minilm"


@pytest.fixture(scope="module")
def models(minilm):
    """(original export, remove-padding model, reference session of the original)."""
    from graphopt.runtime import session as runtime

    src = minilm("dynamo", "sdpa")
    rp = remove_padding_minilm(str(src))
    return src, rp, runtime.make_session(src, spinning=False)


@pytest.fixture(scope="module")
def server(models):
    from graphopt.serve import Runner

    runner = Runner(models[1], name=NAME)
    srv = ThreadServer(runner, max_batch=16, max_delay_ms=10, max_body=1 << 20)
    yield srv
    srv.stop()


def _expected(ref, ids):
    return ref.run(["last_hidden_state"], feed(ids))[0]


def _inputs(ids, *, binary=True, dtype="INT64", drop=None, rename=None):
    out = []
    for name, arr in feed(ids).items():
        if name == drop:
            continue
        if dtype != "INT64":
            arr = arr.astype(np.int32)
        i = httpclient.InferInput(rename if (rename and name == "input_ids") else name, list(arr.shape), dtype)
        i.set_data_from_numpy(arr, binary_data=binary)
        out.append(i)
    return out


def test_health_and_metadata(server):
    c = httpclient.InferenceServerClient(server.url)
    assert c.is_server_live() and c.is_server_ready() and c.is_model_ready(NAME)
    meta = c.get_model_metadata(NAME)
    assert meta["name"] == NAME and meta["versions"] == ["1"]
    assert [(t["name"], t["datatype"], t["shape"]) for t in meta["inputs"]] == [(n, "INT64", [-1, -1]) for n in INPUTS]
    assert meta["outputs"] == [{"name": "last_hidden_state", "datatype": "FP32", "shape": [-1, -1, 384]}]
    assert "binary_tensor_data" in c.get_server_metadata()["extensions"]
    with pytest.raises(httpclient.InferenceServerException, match="unknown model 'nope'"):
        c.get_model_metadata("nope")


@pytest.mark.parametrize("binary", [False, True], ids=["json", "binary"])
def test_infer_matches_original_model(server, models, binary):
    c = httpclient.InferenceServerClient(server.url)
    ids = token_rows()[5]
    res = c.infer(NAME, _inputs(ids, binary=binary), request_id="r5",
                  outputs=[httpclient.InferRequestedOutput("last_hidden_state", binary_data=binary)])
    got = res.as_numpy("last_hidden_state")
    assert got.shape == (1, len(ids), 384) and res.get_response()["id"] == "r5"
    np.testing.assert_allclose(got, _expected(models[2], ids), atol=ATOL)


def test_many_concurrent_clients_random_lengths(server, models):
    """24 clients, 72 requests of random real sentences: every answer right, and requests were batched."""
    rows = token_rows()
    rng = random.Random(1)
    jobs = [rows[rng.randrange(len(rows))] for _ in range(72)]
    def counts():
        st = httpclient.InferenceServerClient(server.url).get_inference_statistics(NAME)["model_stats"][0]
        return st["execution_count"], st["inference_count"]

    before = counts()

    def client(part):
        c = httpclient.InferenceServerClient(server.url)
        return [c.infer(NAME, _inputs(ids, binary=bool(k % 2))).as_numpy("last_hidden_state") for k, ids in part]

    indexed = list(enumerate(jobs))
    parts = [indexed[i::24] for i in range(24)]
    with concurrent.futures.ThreadPoolExecutor(24) as pool:
        answers = list(pool.map(client, parts))
    for part, outs in zip(parts, answers):
        for (_, ids), got in zip(part, outs):
            np.testing.assert_allclose(got, _expected(models[2], ids), atol=ATOL)
    after = counts()
    batches, requests = after[0] - before[0], after[1] - before[1]
    assert requests == 72 and batches < requests  # several lengths shared one run
    assert len({len(ids) for ids in jobs}) > 10


def test_instances_run_batches_at_once_on_their_own_sessions(models, tmp_path):
    """Two instances: two single-thread sessions; 32 concurrent clients are all answered right, and
    both instances ran batches. A deploy entry with --instances 2 serves the same way."""
    from graphopt import deploy
    from graphopt.serve import Runner, load_runner

    runner = Runner(models[1], name=NAME, instances=2)
    assert runner.instances == 2 and runner.threads == 1 and len({id(s) for s in runner.sessions}) == 2
    srv = ThreadServer(runner, max_batch=4, max_delay_ms=2)
    try:
        rows = token_rows()
        jobs = [rows[i % len(rows)] for i in range(64)]

        def client(part):
            c = httpclient.InferenceServerClient(srv.url)
            return [c.infer(NAME, _inputs(ids)).as_numpy("last_hidden_state") for ids in part]

        parts = [jobs[i::32] for i in range(32)]
        with concurrent.futures.ThreadPoolExecutor(32) as pool:
            answers = list(pool.map(client, parts))
        for part, outs in zip(parts, answers):
            for ids, got in zip(part, outs):
                np.testing.assert_allclose(got, _expected(models[2], ids), atol=ATOL)
        assert srv.batcher.requests == 64 and min(srv.batcher.instance_batches) > 0, srv.batcher.instance_batches
    finally:
        srv.stop()
    entry = deploy.deploy(models[1], tmp_path / "repo", name=NAME, instances=2)
    served = load_runner(entry)
    assert (served.instances, served.threads) == (2, 1)
    with pytest.raises(Exception, match="instances"):
        Runner(models[1], name=NAME, instances=0)


def _raw(url, body: bytes, headers=None, path=f"/v2/models/{NAME}/infer"):
    host, port = url.split(":")
    conn = http.client.HTTPConnection(host, int(port), timeout=30)
    conn.request("POST", path, body=body, headers=headers or {"Content-Type": "application/json"})
    resp = conn.getresponse()
    data = resp.read()
    conn.close()
    return resp.status, json.loads(data)


def test_bad_requests_get_4xx_and_the_server_stays_up(server, models):
    c = httpclient.InferenceServerClient(server.url)
    ids = token_rows()[0]
    cases = [
        (dict(rename="ids"), "unknown input 'ids'"),
        (dict(drop="token_type_ids"), "missing input 'token_type_ids'"),
        (dict(dtype="INT32"), "datatype INT32, the model takes INT64"),
    ]
    for kwargs, message in cases:
        with pytest.raises(httpclient.InferenceServerException, match=message) as e:
            c.infer(NAME, _inputs(ids, **kwargs))
        assert e.value.status() == "400"
    too_long = np.full(600, 1000, dtype=np.int64)
    with pytest.raises(httpclient.InferenceServerException, match="sequence length 600 exceeds the maximum 512"):
        c.infer(NAME, _inputs(too_long))
    with pytest.raises(httpclient.InferenceServerException, match="unknown output 'pooled'"):
        c.infer(NAME, _inputs(ids), outputs=[httpclient.InferRequestedOutput("pooled")])

    def tensor(name, shape, data):
        return {"name": name, "datatype": "INT64", "shape": shape, "data": data}

    good = [tensor(n, [1, 3], [101, 2000, 102] if n == "input_ids" else [1, 1, 1]) for n in INPUTS]
    assert _raw(server.url, json.dumps({"inputs": good}).encode())[0] == 200
    raw_cases = [
        (b"{not json", 400, "malformed JSON"),
        (json.dumps({"inputs": []}).encode(), 400, "non-empty 'inputs'"),
        (json.dumps({"inputs": [tensor("input_ids", [1, 3], [1, 2])] + good[1:]}).encode(), 400,
         "2 values for shape [1, 3]"),
        (json.dumps({"inputs": [tensor("input_ids", [3], [1, 2, 3])] + good[1:]}).encode(), 400,
         "shape [3], the model takes [-1, -1]"),
        (json.dumps({"inputs": [tensor("input_ids", [1, 3], ["a", "b", "c"])] + good[1:]}).encode(), 400,
         "data is not INT64"),
        (json.dumps({"inputs": [tensor("input_ids", [2**40, 2**40], [])] + good[1:]}).encode(), 400,
         "0 values for shape [1099511627776, 1099511627776]"),
        (b"x" * (2 << 20), 413, "exceeds the limit"),
    ]
    for body, status, message in raw_cases:
        got_status, err = _raw(server.url, body)
        assert (got_status, message in err["error"]) == (status, True), err
    status, err = _raw(server.url, json.dumps({"inputs": good}).encode(), path="/v2/models/other/infer")
    assert status == 404 and "unknown model 'other'" in err["error"]
    status, err = _raw(server.url, b'{"inputs": []}', headers={"Inference-Header-Content-Length": "999"})
    assert status == 400 and "outside the body" in err["error"]
    # still serving, and right
    assert c.is_server_ready()
    got = c.infer(NAME, _inputs(ids)).as_numpy("last_hidden_state")
    np.testing.assert_allclose(got, _expected(models[2], ids), atol=ATOL)


def test_a_request_failing_in_ort_fails_alone(server, models):
    """An out-of-vocabulary token id passes validation and fails inside ONNX Runtime (Gather); in a batch
    with good requests only it fails: the batch is retried request by request."""
    runner = server.batcher.runner
    rows = token_rows()
    bad = rows[2].copy()
    bad[1] = 10**7
    items = [runner.validate(feed(ids), None) for ids in (rows[1], bad, rows[3])]
    results = runner.run(items)
    assert "inference failed" in results[1].message and results[1].status == 400
    for ids, res in zip((rows[1], rows[3]), (results[0], results[2])):
        np.testing.assert_allclose(res["last_hidden_state"], _expected(models[2], ids), atol=ATOL)
    # the same through the server, concurrently
    c_bad = httpclient.InferenceServerClient(server.url)
    with concurrent.futures.ThreadPoolExecutor(6) as pool:
        good = [pool.submit(lambda i=i: httpclient.InferenceServerClient(server.url).infer(
            NAME, _inputs(rows[i])).as_numpy("last_hidden_state")) for i in range(5)]
        with pytest.raises(httpclient.InferenceServerException, match="inference failed"):
            c_bad.infer(NAME, _inputs(bad))
        for i, f in enumerate(good):
            np.testing.assert_allclose(f.result(), _expected(models[2], rows[i]), atol=ATOL)


def test_padded_model_groups_by_length_remove_padding_mixes(models):
    from graphopt.serve import Runner

    padded, packed = Runner(models[0], name="a"), Runner(models[1], name="b")
    assert (padded.sig.padding, packed.sig.padding) == ("padded", "remove-padding")
    lengths = [5, 30, 7, 29, 60]
    items = [padded.validate(feed(np.full(n, 1000, np.int64)), None) for n in lengths]
    assert padded.groups(items) == [[0, 2], [1, 3], [4]]
    assert packed.groups(items) == [[0, 1, 2, 3, 4]]
    rows = token_rows()
    chosen = [rows[i] for i in (0, 7, 9)]
    for runner in (padded, packed):
        res = runner.run([runner.validate(feed(ids), None) for ids in chosen])
        for ids, r in zip(chosen, res):
            np.testing.assert_allclose(r["last_hidden_state"], _expected(models[2], ids), atol=ATOL)


def test_cli_serve_sigterm_drains_in_flight_requests(models, tmp_path):
    """`graphopt serve` in a subprocess: SIGTERM while six requests wait for their batch (5 s delay); every one
    is answered, then the server exits."""
    port = free_port()
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    proc = subprocess.Popen([sys.executable, "-m", "graphopt.cli.main", "serve", str(models[1]), "--name", NAME,
                             "--port", str(port), "--max-batch", "32", "--max-delay-ms", "5000"],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, env=env, text=True)
    try:
        c = httpclient.InferenceServerClient(f"127.0.0.1:{port}")
        deadline = time.monotonic() + 60
        while True:
            assert proc.poll() is None, proc.stdout.read()
            try:
                if c.is_server_ready():
                    break
            except Exception:
                pass
            assert time.monotonic() < deadline, "server did not start"
            time.sleep(0.2)
        rows = token_rows()
        with concurrent.futures.ThreadPoolExecutor(6) as pool:
            futs = [pool.submit(lambda i=i: httpclient.InferenceServerClient(f"127.0.0.1:{port}").infer(
                NAME, _inputs(rows[i])).as_numpy("last_hidden_state")) for i in range(6)]
            deadline = time.monotonic() + 20  # wait until all six are queued, waiting for the batch delay
            while c.get_inference_statistics(NAME)["model_stats"][0]["pending_count"] < 6:
                assert time.monotonic() < deadline, "the requests did not reach the server"
                assert not any(f.done() for f in futs), [f.exception() for f in futs if f.done()]
                time.sleep(0.05)
            proc.send_signal(signal.SIGTERM)
            for i, f in enumerate(futs):
                np.testing.assert_allclose(f.result(timeout=30), _expected(models[2], rows[i]), atol=ATOL)
        # uvicorn (>= 0.29) re-raises the signal after a clean shutdown, and the CLI turns a SIGTERM into exit
        # 143 (graphopt.interrupt); without that handler the process would end by the signal (-15)
        assert proc.wait(timeout=30) in (128 + signal.SIGTERM, -signal.SIGTERM)
        assert "Traceback" not in proc.stdout.read()
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
