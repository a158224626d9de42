"""The OpenAI-compatible request and response bodies: ``/v1/completions``, ``/v1/chat/completions``, ``/v1/models``.

Requests: ``model`` (must name the served model: 404 otherwise), ``prompt`` (a string, or a list of one string
or of token ids) or ``messages`` (``role`` and ``content``: a string or a list of text parts),
``max_tokens`` (completions default 16; chat: up to the context), ``temperature`` (default 1, as OpenAI),
``top_p``, ``seed``, ``stop``, ``stream`` (server-sent events, ``data: [DONE]`` last), ``stream_options``
(``include_usage``: a last chunk with the token counts). ``n`` > 1, ``echo``, ``logprobs``, ``suffix``, tools
are refused (400), never ignored. Errors are OpenAI's shape: ``{"error": {"message", "type", "param", "code"}}``.
"""

from __future__ import annotations

import json
import uuid

from graphopt.serve.generation import ApiError, Chunk, Params

_TYPES = {400: "invalid_request_error", 404: "not_found_error", 429: "rate_limit_error",
          500: "server_error", 503: "server_error"}
_UNSUPPORTED = ("echo", "suffix", "tools", "functions", "tool_choice", "logit_bias", "response_format")
COMPLETION_MAX_TOKENS = 16  # OpenAI's default for /v1/completions


def error_body(e: ApiError) -> dict:
    return {"error": {"message": e.message, "type": _TYPES.get(e.status, "invalid_request_error"),
                      "param": e.param, "code": e.code}}


def _common(body, service) -> tuple[bool, bool]:
    """Checks shared by both endpoints; (stream, include_usage)."""
    if not isinstance(body, dict):
        raise ApiError("the request body must be a JSON object")
    model = body.get("model")
    if model is not None and model != service.name:
        raise ApiError(f"unknown model {model!r}; this server serves {service.name!r}", 404, "model",
                       "model_not_found")
    n = body.get("n", 1)
    if n not in (1, None):
        raise ApiError(f"'n' must be 1 (got {n!r}): one choice per request", param="n")
    for key in _UNSUPPORTED:
        if body.get(key) not in (None, False, [], {}):
            raise ApiError(f"'{key}' is not supported by this server", param=key)
    if body.get("logprobs") not in (None, False, 0) or body.get("top_logprobs") not in (None, 0):
        raise ApiError("'logprobs' is not supported by this server", param="logprobs")
    stream = body.get("stream", False)
    if not isinstance(stream, bool):
        raise ApiError(f"'stream' must be true or false (got {stream!r})", param="stream")
    opts = body.get("stream_options") or {}
    if not isinstance(opts, dict):
        raise ApiError("'stream_options' must be an object", param="stream_options")
    return stream, bool(opts.get("include_usage", False))


def completion_request(body, service) -> tuple[list[int], Params, bool, bool]:
    """(prompt ids, params, stream, include_usage) of a /v1/completions body."""
    stream, usage = _common(body, service)
    prompt = body.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
        prompt = prompt[0]
    if isinstance(prompt, str):
        ids = service.encode(prompt)
    elif isinstance(prompt, list) and prompt and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
        ids = list(prompt)
    elif isinstance(prompt, list) and len(prompt) > 1:
        raise ApiError("'prompt' must be one prompt (a string or token ids); send one request per prompt",
                       param="prompt")
    else:
        raise ApiError(f"'prompt' must be a string or a list of token ids (got {type(prompt).__name__})",
                       param="prompt")
    params = Params.parse(body, max_tokens=COMPLETION_MAX_TOKENS, temperature=1.0, context=service.context)
    return ids, params, stream, usage


def _messages(body) -> list[dict]:
    msgs = body.get("messages")
    if not isinstance(msgs, list) or not msgs:
        raise ApiError("'messages' must be a non-empty list of {role, content} objects", param="messages")
    out = []
    for i, m in enumerate(msgs):
        if not isinstance(m, dict) or not isinstance(m.get("role"), str):
            raise ApiError(f"messages[{i}] must be an object with a 'role' and a 'content'", param="messages")
        content = m.get("content")
        if isinstance(content, list):
            if not all(isinstance(p, dict) and p.get("type") == "text" and isinstance(p.get("text"), str)
                       for p in content):
                raise ApiError(f"messages[{i}].content: only text parts are supported", param="messages")
            content = "".join(p["text"] for p in content)
        if not isinstance(content, str):
            raise ApiError(f"messages[{i}].content must be a string or a list of text parts", param="messages")
        out.append({"role": m["role"], "content": content})
    return out


def chat_request(body, service) -> tuple[list[int], Params, bool, bool]:
    """(prompt ids through the chat template, params, stream, include_usage) of a /v1/chat/completions body."""
    stream, usage = _common(body, service)
    ids = service.encode_chat(_messages(body))
    params = Params.parse(body, max_tokens=None, temperature=1.0, context=service.context)
    return ids, params, stream, usage


def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex[:24]}"


def _usage(c: Chunk) -> dict:
    return {"prompt_tokens": c.prompt_tokens, "completion_tokens": c.completion_tokens,
            "total_tokens": c.prompt_tokens + c.completion_tokens}


def completion(rid: str, model: str, created: int, text: str, last: Chunk) -> dict:
    return {"id": rid, "object": "text_completion", "created": created, "model": model,
            "choices": [{"index": 0, "text": text, "finish_reason": last.finish, "logprobs": None}],
            "usage": _usage(last)}


def chat(rid: str, model: str, created: int, text: str, last: Chunk) -> dict:
    return {"id": rid, "object": "chat.completion", "created": created, "model": model,
            "choices": [{"index": 0, "message": {"role": "assistant", "content": text},
                         "finish_reason": last.finish, "logprobs": None}],
            "usage": _usage(last)}


def sse(obj) -> bytes:
    return b"data: " + json.dumps(obj, separators=(",", ":")).encode() + b"\n\n"


DONE = b"data: [DONE]\n\n"


def completion_chunks(rid: str, model: str, created: int, c: Chunk, include_usage: bool) -> list[bytes]:
    """The server-sent events for one Chunk of /v1/completions."""
    base = {"id": rid, "object": "text_completion", "created": created, "model": model}
    out = []
    if c.text or c.finish:
        out.append(sse({**base, "choices": [{"index": 0, "text": c.text, "finish_reason": c.finish,
                                             "logprobs": None}]}))
    if c.finish and include_usage:
        out.append(sse({**base, "choices": [], "usage": _usage(c)}))
    return out


def chat_chunks(rid: str, model: str, created: int, c: Chunk, include_usage: bool, first: bool) -> list[bytes]:
    """The server-sent events for one Chunk of /v1/chat/completions (the first carries the role)."""
    base = {"id": rid, "object": "chat.completion.chunk", "created": created, "model": model}
    out = []
    if first:
        out.append(sse({**base, "choices": [{"index": 0, "delta": {"role": "assistant", "content": ""},
                                             "finish_reason": None, "logprobs": None}]}))
    if c.text:
        out.append(sse({**base, "choices": [{"index": 0, "delta": {"content": c.text}, "finish_reason": None,
                                             "logprobs": None}]}))
    if c.finish:
        out.append(sse({**base, "choices": [{"index": 0, "delta": {}, "finish_reason": c.finish,
                                             "logprobs": None}]}))
        if include_usage:
            out.append(sse({**base, "choices": [], "usage": _usage(c)}))
    return out


def models(service) -> dict:
    return {"object": "list", "data": [model_card(service)]}


def model_card(service) -> dict:
    return {"id": service.name, "object": "model", "created": service.created, "owned_by": "graphopt",
            "max_model_len": service.context}
