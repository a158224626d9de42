"""``graphopt serve``: the Open Inference Protocol (KServe v2 REST) over one ONNX Runtime session.

``protocol`` parses and writes requests and responses (JSON and the binary tensor extension), ``runner``
validates requests against the model signature and runs batches, ``batcher`` forms batches from concurrent
requests (bounded delay), ``app`` wires them into a Starlette application served by uvicorn.
Needs the ``serve`` extra (``pip install graphopt[serve]``).
"""

from __future__ import annotations

from graphopt.serve.runner import InferError, Runner, load_runner

__all__ = ["InferError", "Runner", "load_runner"]
