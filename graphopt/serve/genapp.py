"""The generation server: OpenAI-compatible endpoints and the Open Inference Protocol generate extension.

===============================================  ===================================================
GET  /v1/models, /v1/models/NAME                 the served model (OpenAI's list / model objects)
POST /v1/completions                             a prompt (string or token ids); ``stream`` for SSE
POST /v1/chat/completions                        messages through the tokenizer's chat template
GET  /v2/health/live, /v2/health/ready           200 when live / ready
GET  /v2/models/NAME, /v2/models/NAME/ready      model metadata (text_input -> text_output, BYTES)
GET  /v2/models/NAME/stats                       requests running, queued, finished, refused; decode runs
POST /v2/models/NAME/generate                    ``{"text_input", "parameters": {...}}`` -> ``text_output``
POST /v2/models/NAME/generate_stream             the same as server-sent events, one per text delta
===============================================  ===================================================

Every request joins the engine's continuous batch (``engine``, ``generate/scheduler.py``). Refusals: 400 bad
parameters or a prompt over the context (one line naming it), 404 unknown model, 429 queue full (with
``Retry-After``), 503 shutting down; a client that disconnects cancels its request. The OIP endpoints take
the same parameters (in ``parameters`` or at the top level) with greedy decoding and ``max_tokens`` 16 unless
given.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import time

from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import JSONResponse, StreamingResponse
from starlette.routing import Route

import graphopt
from graphopt.errors import UsageError
from graphopt.serve import openai_api as oa
from graphopt.serve.app import config
from graphopt.serve.engine import Busy, Closing, EngineError
from graphopt.serve.generation import ApiError, DecoderService, Params

logger = logging.getLogger(__name__)

MAX_BODY = 4 * 2**20
OIP_MAX_TOKENS = 16


def _as_api_error(e: Exception) -> ApiError:
    if isinstance(e, ApiError):
        return e
    if isinstance(e, Busy):
        return ApiError(str(e), 429, code="busy")
    if isinstance(e, Closing):
        return ApiError(str(e), 503, code="shutting_down")
    if isinstance(e, EngineError):
        return ApiError(str(e), 500)
    if isinstance(e, UsageError):
        return ApiError(str(e).splitlines()[0])
    raise e


def _headers(e: ApiError) -> dict:
    return {"Retry-After": "1"} if e.status in (429, 503) else {}


async def _json(request: Request):
    declared = request.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > MAX_BODY:
        raise ApiError(f"request body of {declared} bytes exceeds the limit of {MAX_BODY}", 413)
    raw = await request.body()
    if len(raw) > MAX_BODY:
        raise ApiError(f"request body exceeds the limit of {MAX_BODY} bytes", 413)
    try:
        return json.loads(raw)
    except ValueError as e:
        raise ApiError(f"the request body is not JSON: {e}") from None


async def _disconnected(request: Request) -> None:
    while (await request.receive())["type"] != "http.disconnect":
        pass


async def _collect(request: Request, service: DecoderService, stream, params: Params):
    """(text, last chunk) of a request answered in one body; cancelled when the client goes away."""
    async def consume():
        parts, last = [], None
        async with contextlib.aclosing(service.run(stream, params)) as chunks:
            async for c in chunks:
                parts.append(c.text)
                last = c
        return "".join(parts), last

    task = asyncio.create_task(consume())
    watch = asyncio.create_task(_disconnected(request))
    await asyncio.wait({task, watch}, return_when=asyncio.FIRST_COMPLETED)
    watch.cancel()
    if not task.done():
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task
        return None
    return task.result()


def make_generation_app(service: DecoderService) -> Starlette:
    """The ASGI application serving ``service``; the engine thread runs with the app's lifespan."""
    state: dict = {}
    engine = service.engine

    @contextlib.asynccontextmanager
    async def lifespan(app):
        engine.start()
        state["ready"] = True
        app.state.service = service
        try:
            yield
        finally:  # uvicorn has drained in-flight requests; finish anything still queued
            state.pop("ready", None)
            await engine.close()

    def openai_error(e: Exception) -> JSONResponse:
        e = _as_api_error(e)
        return JSONResponse(oa.error_body(e), status_code=e.status, headers=_headers(e))

    def oip_error(e: Exception) -> JSONResponse:
        e = _as_api_error(e)
        return JSONResponse({"error": e.message}, status_code=e.status, headers=_headers(e))

    async def list_models(request: Request):
        return JSONResponse(oa.models(service))

    async def get_model(request: Request):
        if request.path_params["name"] != service.name:
            return openai_error(ApiError(f"unknown model {request.path_params['name']!r}; this server serves "
                                         f"{service.name!r}", 404, "model", "model_not_found"))
        return JSONResponse(oa.model_card(service))

    def openai_endpoint(parse, respond, chunks):
        async def endpoint(request: Request):
            try:
                body = await _json(request)
                ids, params, streaming, usage = parse(body, service)
                stream = service.submit(ids, params)
            except (ApiError, Busy, Closing, UsageError) as e:
                return openai_error(e)
            rid, created = oa.new_id("cmpl" if parse is oa.completion_request else "chatcmpl"), int(time.time())
            if not streaming:
                try:
                    got = await _collect(request, service, stream, params)
                except EngineError as e:
                    return openai_error(e)
                if got is None:
                    return JSONResponse({}, status_code=499)
                return JSONResponse(respond(rid, service.name, created, got[0], got[1]))

            async def events():
                first = True
                try:
                    async with contextlib.aclosing(service.run(stream, params)) as it:
                        async for c in it:
                            for b in chunks(rid, service.name, created, c, usage, first):
                                yield b
                            first = False
                except EngineError as e:
                    yield oa.sse(oa.error_body(_as_api_error(e)))
                yield oa.DONE

            return StreamingResponse(events(), media_type="text/event-stream", headers={"Cache-Control": "no-cache"})
        return endpoint

    def completion_chunks(rid, model, created, c, usage, first):
        return oa.completion_chunks(rid, model, created, c, usage)

    # -- Open Inference Protocol ---------------------------------------------------------------------
    def _check(request: Request) -> None:
        name = request.path_params["name"]
        if name != service.name:
            raise ApiError(f"unknown model {name!r}; this server serves {service.name!r}", 404)

    async def oip_request(request: Request):
        _check(request)
        body = await _json(request)
        if not isinstance(body, dict) or not isinstance(body.get("text_input"), str):
            raise ApiError("the body must be an object with a string 'text_input'")
        extra = body.get("parameters") or {}
        if not isinstance(extra, dict):
            raise ApiError("'parameters' must be an object")
        merged = {k: v for k, v in body.items() if k not in ("text_input", "parameters")} | extra
        params = Params.parse(merged, max_tokens=OIP_MAX_TOKENS, temperature=0.0, context=service.context)
        return service.submit(service.encode(body["text_input"]), params), params

    def details(c) -> dict:
        return {"finish_reason": c.finish, "prompt_tokens": c.prompt_tokens, "completion_tokens": c.completion_tokens}

    async def oip_generate(request: Request):
        try:
            stream, params = await oip_request(request)
            got = await _collect(request, service, stream, params)
        except (ApiError, Busy, Closing, UsageError, EngineError) as e:
            return oip_error(e)
        if got is None:
            return JSONResponse({}, status_code=499)
        return JSONResponse({"model_name": service.name, "model_version": "1", "text_output": got[0],
                             "details": details(got[1])})

    async def oip_generate_stream(request: Request):
        try:
            stream, params = await oip_request(request)
        except (ApiError, Busy, Closing, UsageError) as e:
            return oip_error(e)

        async def events():
            try:
                async with contextlib.aclosing(service.run(stream, params)) as it:
                    async for c in it:
                        out = {"model_name": service.name, "model_version": "1", "text_output": c.text}
                        if c.finish:
                            out["details"] = details(c)
                        yield oa.sse(out)
            except EngineError as e:
                yield oa.sse({"error": str(e)})

        return StreamingResponse(events(), media_type="text/event-stream", headers={"Cache-Control": "no-cache"})

    async def server_metadata(request: Request):
        return JSONResponse({"name": "graphopt", "version": graphopt.__version__, "extensions": ["generate"]})

    async def live(request: Request):
        return JSONResponse({"live": True})

    async def ready(request: Request):
        return JSONResponse({"ready": "ready" in state}, status_code=200 if "ready" in state else 503)

    async def model_metadata(request: Request):
        try:
            _check(request)
        except ApiError as e:
            return oip_error(e)
        return JSONResponse({"name": service.name, "versions": ["1"], "platform": "onnxruntime_onnx",
                             "inputs": [{"name": "text_input", "datatype": "BYTES", "shape": [1]}],
                             "outputs": [{"name": "text_output", "datatype": "BYTES", "shape": [-1]}],
                             "max_model_len": service.context, "slots": engine.scheduler.slots,
                             "continuous_batching": engine.scheduler.batched})

    async def model_ready(request: Request):
        try:
            _check(request)
        except ApiError as e:
            return oip_error(e)
        return JSONResponse({"name": service.name, "ready": "ready" in state})

    async def model_stats(request: Request):
        try:
            _check(request)
        except ApiError as e:
            return oip_error(e)
        s = engine.scheduler
        return JSONResponse({"name": service.name, "running": engine.running, "queued": engine.queued,
                             "finished": engine.finished, "refused": engine.refused, "failed": engine.failures,
                             "tokens": engine.tokens, "prefills": s.prefills, "prefill_runs": s.prefill_runs,
                             "decode_runs": s.decode_runs,
                             "decode_rows": s.decode_rows, "decode_seconds": round(s.decode_seconds, 6),
                             "prefill_seconds": round(s.prefill_seconds, 6), "slots": s.slots,
                             "prefix_hits": s.prefixes.hits if s.prefixes else 0,
                             "prefix_positions_reused": s.prefixes.reused if s.prefixes else 0})

    async def http_error(request: Request, exc: HTTPException):
        return JSONResponse({"error": exc.detail if isinstance(exc.detail, str) else str(exc.detail)},
                            status_code=exc.status_code)

    async def internal_error(request: Request, exc: Exception):
        logger.exception("unhandled error")
        return JSONResponse({"error": f"internal error: {type(exc).__name__}"}, status_code=500)

    m = "/v2/models/{name}"
    routes = [
        Route("/v1/models", list_models),
        Route("/v1/models/{name:path}", get_model),
        Route("/v1/completions", openai_endpoint(oa.completion_request, oa.completion, completion_chunks),
              methods=["POST"]),
        Route("/v1/chat/completions", openai_endpoint(oa.chat_request, oa.chat, oa.chat_chunks), methods=["POST"]),
        Route("/v2", server_metadata),
        Route("/v2/health/live", live),
        Route("/v2/health/ready", ready),
        Route(m, model_metadata),
        Route(m + "/ready", model_ready),
        Route(m + "/stats", model_stats),
        Route(m + "/generate", oip_generate, methods=["POST"]),
        Route(m + "/generate_stream", oip_generate_stream, methods=["POST"]),
    ]
    return Starlette(routes=routes, lifespan=lifespan,
                     exception_handlers={HTTPException: http_error, Exception: internal_error})


def serve_generation(service: DecoderService, *, host: str = "127.0.0.1", port: int = 8000,
                     log_level: str = "warning") -> None:
    """Serve until SIGINT/SIGTERM; shutdown stops accepting, drains in-flight requests, then exits."""
    import uvicorn

    uvicorn.Server(config(make_generation_app(service), host=host, port=port, log_level=log_level)).run()
