"""Medusa drafts: the graph's own extra heads guess the next tokens from the last verified position.

A graph made by the ``speculative-heads`` pass returns, beside ``logits``, ``medusa_logits`` [batch, sequence,
K, vocab]: head k at position t guesses the token at t + k + 2 (the LM head guesses t + 1). After a forward, the
last verified position is the one whose logits chose the newest token; the top-1 of its K heads is the draft::

    step:  [last, d1 .. dk] ──forward──▶ logits (verify: a drafts kept, new token at position a)
                                         medusa_logits[a] ──argmax per head──▶ next step's drafts

The draft needs no model and no search: it reads what the previous forward returned (``Decoder.extras``). The
speculative loop checks every draft, so greedy tokens stay plain decoding's.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from graphopt.errors import UsageError
from graphopt.generate.lookup import Draft

#: the output the pass adds, and the metadata key saying how many heads (``medusa:K``)
OUTPUT, METADATA_KEY = "medusa_logits", "graphopt.speculative"


def heads_of(session) -> int:
    """How many Medusa heads the graph of ``session`` carries (0: none)."""
    if OUTPUT not in {o.name for o in session.get_outputs()}:
        return 0
    tag = dict(session.get_modelmeta().custom_metadata_map).get(METADATA_KEY, "")
    if tag.startswith("medusa:") and tag[7:].isdigit():
        return int(tag[7:])
    shape = next(o.shape for o in session.get_outputs() if o.name == OUTPUT)
    return int(shape[2]) if len(shape) == 4 and isinstance(shape[2], int) else 0


class MedusaDraft(Draft):
    """Top-1 chain of the graph's Medusa heads at the last verified position (read from the decoder's last step)."""

    name = "heads"
    priors = {"heads": 0.5}

    def __init__(self, decoder):
        self.k = heads_of(decoder.session)
        if not self.k:
            raise UsageError(f"--speculative heads: the graph carries no Medusa heads (no '{OUTPUT}' output)",
                             hint="add them with graphopt optimize --passes speculative-heads, or use "
                                  "--speculative lookup")
        self.decoder = decoder
        if OUTPUT not in decoder.extra_outputs:
            decoder.extra_outputs = (*decoder.extra_outputs, OUTPUT)
        self._seen: int | None = None

    def reset(self) -> None:
        self._seen = None

    def propose(self, context: Sequence[int], k: int) -> list[int]:
        heads = self.decoder.extras.get(OUTPUT)
        seen, self._seen = self._seen, len(context)
        if heads is None or k < 1:
            return []
        # the newest token came from position (tokens added by the last step) - 1; the prefill: its last position
        index = -1 if seen is None else len(context) - seen - 1
        if not -heads.shape[1] <= index < heads.shape[1]:
            return []
        return np.argmax(heads[0, index, :k], axis=-1).astype(np.int64).tolist()
