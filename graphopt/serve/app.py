"""The Starlette application: Open Inference Protocol REST endpoints over a ``Runner`` and a ``Batcher``.

===============================================  ===================================================
GET  /v2                                         server metadata (extensions: binary_tensor_data)
GET  /v2/health/live, /v2/health/ready           200 when live / ready
GET  /v2/models/NAME[/versions/V]                model metadata (inputs, outputs, dims -1 dynamic)
GET  /v2/models/NAME[/versions/V]/ready          200 when the model is ready
GET  /v2/models/NAME[/versions/V]/stats          requests answered, session runs, requests queued now
POST /v2/models/NAME[/versions/V]/infer          inference: JSON, or the binary tensor extension
===============================================  ===================================================

Errors are ``{"error": "one line"}`` with a 4xx status for a bad request (400; 404 unknown model or path;
413 body too large) and 500 only for a fault of the server itself.
"""

from __future__ import annotations

import contextlib
import logging

from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

import graphopt
from graphopt.serve.batcher import Batcher
from graphopt.serve.protocol import HEADER_LENGTH, encode_response, parse_request
from graphopt.serve.runner import InferError, Runner

logger = logging.getLogger(__name__)

DEFAULT_MAX_BODY = 16 * 2**20


def _error(message: str, status: int) -> JSONResponse:
    return JSONResponse({"error": message}, status_code=status)


def make_app(runner: Runner, *, max_batch: int = 32, max_delay_ms: float = 5.0,
             max_body: int = DEFAULT_MAX_BODY) -> Starlette:
    """The ASGI application serving ``runner``'s model; batching starts with the app's lifespan."""
    state: dict = {}

    @contextlib.asynccontextmanager
    async def lifespan(app):
        batcher = Batcher(runner, max_batch=max_batch, max_delay_ms=max_delay_ms)
        batcher.start()
        state["batcher"] = app.state.batcher = batcher
        try:
            yield
        finally:  # uvicorn has drained in-flight requests; finish anything still queued
            await batcher.close()

    def _check_model(request: Request) -> JSONResponse | None:
        name = request.path_params["name"]
        version = request.path_params.get("version")
        if name != runner.name:
            return _error(f"unknown model {name!r}; this server serves {runner.name!r}", 404)
        if version not in (None, "", runner.version):
            return _error(f"model {name!r} has no version {version!r} (versions: {runner.version})", 404)
        return None

    async def server_metadata(request: Request):
        return JSONResponse({"name": "graphopt", "version": graphopt.__version__,
                             "extensions": ["binary_tensor_data"]})

    async def live(request: Request):
        return JSONResponse({"live": True})

    async def ready(request: Request):
        return JSONResponse({"ready": "batcher" in state})

    async def model_metadata(request: Request):
        return _check_model(request) or JSONResponse(runner.metadata())

    async def model_ready(request: Request):
        return _check_model(request) or JSONResponse({"name": runner.name, "ready": True})

    async def model_stats(request: Request):
        """Triton's statistics extension, the counts only: requests answered and session runs; graphopt adds
        ``pending_count``, the requests queued for a batch now."""
        bad = _check_model(request)
        if bad is not None:
            return bad
        b = state["batcher"]
        return JSONResponse({"model_stats": [{"name": runner.name, "version": runner.version,
                                              "inference_count": b.requests, "execution_count": b.batches,
                                              "pending_count": b.pending}]})

    async def _body(request: Request) -> bytes:
        declared = request.headers.get("content-length")
        if declared is not None and declared.isdigit() and int(declared) > max_body:
            raise InferError(f"request body of {int(declared)} bytes exceeds the limit of {max_body}", status=413)
        if request.headers.get("content-encoding", "identity") not in ("identity", ""):
            raise InferError(f"Content-Encoding {request.headers['content-encoding']!r} is not supported")
        chunks, size = [], 0
        async for chunk in request.stream():
            size += len(chunk)
            if size > max_body:
                raise InferError(f"request body exceeds the limit of {max_body} bytes", status=413)
            chunks.append(chunk)
        return b"".join(chunks)

    async def infer(request: Request):
        bad = _check_model(request)
        if bad is not None:
            return bad
        try:
            body = await _body(request)
            req = parse_request(body, request.headers.get(HEADER_LENGTH))
            item = runner.validate(req.inputs, req.outputs)
            results = await state["batcher"].submit(item)
            payload, headers = encode_response(runner.name, runner.version, req, results)
        except InferError as e:
            return _error(e.message, e.status)
        media = headers.pop("content-type")
        return Response(payload, media_type=media, headers=headers)

    async def http_error(request: Request, exc: HTTPException):
        return _error(exc.detail if isinstance(exc.detail, str) else str(exc.detail), exc.status_code)

    async def internal_error(request: Request, exc: Exception):
        logger.exception("unhandled error")
        return _error(f"internal error: {type(exc).__name__}", 500)

    model = "/v2/models/{name}"
    versioned = "/v2/models/{name}/versions/{version}"
    routes = [
        Route("/v2", server_metadata),
        Route("/v2/health/live", live),
        Route("/v2/health/ready", ready),
        *(Route(p, model_metadata) for p in (model, versioned)),
        *(Route(p + "/ready", model_ready) for p in (model, versioned)),
        *(Route(p + "/stats", model_stats) for p in (model, versioned)),
        *(Route(p + "/infer", infer, methods=["POST"]) for p in (model, versioned)),
    ]
    return Starlette(routes=routes, lifespan=lifespan,
                     exception_handlers={HTTPException: http_error, Exception: internal_error})


def config(app: Starlette, *, host: str = "127.0.0.1", port: int = 8000, log_level: str = "warning"):
    """A ``uvicorn.Config`` for ``app``; in-flight requests get up to 30 s to finish on shutdown."""
    import uvicorn

    return uvicorn.Config(app, host=host, port=port, log_level=log_level, access_log=False,
                          timeout_graceful_shutdown=30, lifespan="on")


def serve(runner: Runner, *, host: str = "127.0.0.1", port: int = 8000, max_batch: int = 32,
          max_delay_ms: float = 5.0, max_body: int = DEFAULT_MAX_BODY, log_level: str = "warning") -> None:
    """Serve until SIGINT/SIGTERM; shutdown stops accepting, drains in-flight requests, then exits."""
    import uvicorn

    app = make_app(runner, max_batch=max_batch, max_delay_ms=max_delay_ms, max_body=max_body)
    uvicorn.Server(config(app, host=host, port=port, log_level=log_level)).run()
