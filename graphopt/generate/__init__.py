"""The generation runtime for decoder graphs with a KV cache: signature, cache, sampling, chat, batch, loop.

``generate(session_or_path, prompt_ids | Batch, ...)`` (``loop``) is the entry point; the other modules hold one
concept each. onnxruntime and transformers load only inside functions that need them.
"""

from __future__ import annotations
