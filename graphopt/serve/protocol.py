"""The Open Inference Protocol's infer request and response bodies, JSON and the binary tensor extension.

A binary request carries the JSON header's byte length in ``Inference-Header-Content-Length``; the tensors
whose ``parameters.binary_data_size`` is set follow the header in input order, raw little-endian. A
response puts an output in binary when the request asks (``outputs[i].parameters.binary_data`` or the
request's ``parameters.binary_data_output``), the same way.
"""

from __future__ import annotations

import dataclasses
import json
import math
from typing import Any

import numpy as np

from graphopt.deploy import DATATYPES
from graphopt.serve.runner import InferError

HEADER_LENGTH = "Inference-Header-Content-Length"
#: Open Inference Protocol datatype -> numpy dtype
NP_TYPES = {oip: np.dtype(np_t) for _, oip, np_t in DATATYPES.values()}
OIP_TYPES = {v: k for k, v in NP_TYPES.items()}


@dataclasses.dataclass
class InferRequest:
    id: str | None
    inputs: dict[str, np.ndarray]
    outputs: list[str]
    binary: dict[str, bool]  # output name -> binary in the response


def _shape(tensor: dict, name: str) -> list[int]:
    shape = tensor.get("shape")
    if not isinstance(shape, list) or not all(isinstance(d, int) and not isinstance(d, bool) and d >= 0
                                              for d in shape):
        raise InferError(f"input {name!r}: 'shape' must be a list of non-negative integers, got {shape!r}")
    return shape


def parse_request(body: bytes, header_length: str | None) -> InferRequest:
    """Decode an infer request body; ``InferError`` (400) names the first problem."""
    if header_length is not None:
        try:
            n = int(header_length)
        except ValueError:
            raise InferError(f"{HEADER_LENGTH} is not an integer: {header_length!r}") from None
        if not 0 < n <= len(body):
            raise InferError(f"{HEADER_LENGTH} {n} is outside the body ({len(body)} bytes)")
        head, rest = body[:n], memoryview(body)[n:]
    else:
        head, rest = body, memoryview(b"")
    try:
        req = json.loads(head)
    except (ValueError, UnicodeDecodeError) as e:
        raise InferError(f"malformed JSON request: {e}") from None
    if not isinstance(req, dict) or not isinstance(req.get("inputs"), list) or not req["inputs"]:
        raise InferError("the request must be a JSON object with a non-empty 'inputs' list")
    params = req.get("parameters") or {}
    if not isinstance(params, dict):
        raise InferError("'parameters' must be an object")
    inputs: dict[str, np.ndarray] = {}
    offset = 0
    for t in req["inputs"]:
        if not isinstance(t, dict) or not isinstance(t.get("name"), str):
            raise InferError("each input must be an object with a 'name'")
        name = t["name"]
        if name in inputs:
            raise InferError(f"input {name!r} given twice")
        shape = _shape(t, name)
        datatype = t.get("datatype")
        if datatype not in NP_TYPES:
            raise InferError(f"input {name!r}: datatype {datatype!r} is not supported "
                             f"(supported: {', '.join(NP_TYPES)})")
        dtype = NP_TYPES[datatype]
        count = math.prod(shape)  # Python ints: no overflow on absurd shapes
        size = (t.get("parameters") or {}).get("binary_data_size")
        if size is not None:
            if not isinstance(size, int) or size != count * dtype.itemsize:
                raise InferError(f"input {name!r}: binary_data_size {size!r}, shape {shape} {datatype} needs "
                                 f"{count * dtype.itemsize} bytes")
            if offset + size > len(rest):
                raise InferError(f"input {name!r}: binary data runs past the end of the body")
            arr = np.frombuffer(rest[offset:offset + size], dtype=dtype.newbyteorder("<")).astype(dtype, copy=True)
            offset += size
        else:
            if "data" not in t:
                raise InferError(f"input {name!r} has neither 'data' nor parameters.binary_data_size")
            try:
                arr = np.asarray(t["data"], dtype=dtype).reshape(-1)
            except (TypeError, ValueError, OverflowError) as e:
                raise InferError(f"input {name!r}: data is not {datatype}: {e}") from None
            if arr.size != count:
                raise InferError(f"input {name!r}: {arr.size} values for shape {shape} ({count} needed)")
        inputs[name] = arr.reshape(shape)
    if offset != len(rest):
        raise InferError(f"{len(rest) - offset} bytes of binary data are not claimed by any input")
    default_binary = bool(params.get("binary_data_output", False))
    outputs, binary = [], {}
    for o in req.get("outputs") or []:
        if not isinstance(o, dict) or not isinstance(o.get("name"), str):
            raise InferError("each requested output must be an object with a 'name'")
        outputs.append(o["name"])
        binary[o["name"]] = bool((o.get("parameters") or {}).get("binary_data", default_binary))
    rid = req.get("id")
    return InferRequest(str(rid) if rid is not None else None, inputs, outputs,
                        binary if outputs else {"*": default_binary})


def encode_response(model: str, version: str, req: InferRequest, results: dict[str, np.ndarray]
                    ) -> tuple[bytes, dict[str, str]]:
    """The response body and extra headers."""
    outs: list[dict[str, Any]] = []
    blobs: list[bytes] = []
    for name, arr in results.items():
        entry: dict[str, Any] = {"name": name, "datatype": OIP_TYPES[arr.dtype], "shape": list(arr.shape)}
        if req.binary.get(name, req.binary.get("*", False)):
            raw = arr.astype(arr.dtype.newbyteorder("<"), copy=False).tobytes()
            entry["parameters"] = {"binary_data_size": len(raw)}
            blobs.append(raw)
        else:
            entry["data"] = arr.reshape(-1).tolist()
        outs.append(entry)
    body: dict[str, Any] = {"model_name": model, "model_version": version, "outputs": outs}
    if req.id is not None:
        body["id"] = req.id
    head = json.dumps(body).encode()
    if not blobs:
        return head, {"content-type": "application/json"}
    return b"".join([head, *blobs]), {"content-type": "application/octet-stream", HEADER_LENGTH: str(len(head))}
