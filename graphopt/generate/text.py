"""Text in, text out: a prompt through the tokenizer beside the model, ``loop.generate``, and the new text.

``generate_text`` finds and loads the tokenizer (``chat``), encodes the prompt (through the chat template
with ``chat``), takes the stop ids and the maximum length from the model's folder, runs the loop and decodes
the new tokens. ``on_text`` receives the new text as it grows, whole characters only (a token may end
inside a multi-byte character), for streaming.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from pathlib import Path

from graphopt.generate import chat as tokens
from graphopt.generate.loop import Generation, decoder_file, generate, open_decoder
from graphopt.generate.sampling import GREEDY, Sampling
from graphopt.generate.speculative import speculative_generate


@dataclasses.dataclass
class TextGeneration:
    """The generation (ids, timings) and the new tokens' text (special tokens left out)."""

    generation: Generation
    text: str

    def as_dict(self) -> dict:
        g = self.generation
        d = {"prompt_ids": g.prompt_ids[0], "token_ids": g.token_ids, "text": self.text,
             "prefill_ms": g.prefill_ms, "decode_tokens_per_s": g.decode_tokens_per_s}
        extra = g.as_dict()  # a speculative run adds its draft's figures (accepted_per_step, ...)
        d.update({k: v for k, v in extra.items() if k not in d and k not in ("finish",)})
        return d


class _Deltas:
    """Turns tokens into the text they add, held back while it ends mid-character."""

    def __init__(self, tokenizer, on_text: Callable[[str], None]):
        self.tokenizer, self.on_text, self.ids, self.shown = tokenizer, on_text, [], ""

    def __call__(self, row: int, token: int) -> None:
        self.ids.append(token)
        self.show(self.tokenizer.decode(self.ids, skip_special_tokens=True), final=False)

    def show(self, text: str, *, final: bool) -> None:
        if (text.endswith("\ufffd") and not final) or not text.startswith(self.shown):
            return
        if len(text) > len(self.shown):
            self.on_text(text[len(self.shown):])
            self.shown = text


def generate_text(
    model: str | Path,
    prompt: str,
    *,
    max_new_tokens: int,
    sampling: Sampling = GREEDY,
    chat: bool = False,
    ignore_eos: bool = False,
    tokenizer: str | Path | None = None,
    threads: int | None = None,
    on_text: Callable[[str], None] | None = None,
    speculative: str = "off",
    draft: str | Path | None = None,
) -> TextGeneration:
    """Generate from ``prompt`` with the decoder ``model`` (.onnx); the tokenizer is beside it or in
    ``tokenizer``. ``ignore_eos`` masks the stop ids instead of stopping at them. UsageError (one line) for a
    missing model or tokenizer, a graph that is not a decoder with past, a prompt over the model's maximum.
    ``speculative``: a draft mode of ``speculative.MODES`` (``off``: plain decoding); ``draft``: a draft decoder
    file (speculative decoding with it, whatever ``speculative`` says)."""
    model = decoder_file(model)
    folder = tokens.tokenizer_folder(model, tokenizer)
    tok = tokens.load_tokenizer(folder)
    prompt_ids = tokens.encode(tok, prompt, chat=chat)
    folders = (folder, model.parent)
    stops = tokens.stop_ids(tok, *folders)
    if ignore_eos:
        sampling, stops = sampling.masking(stops), []
    decoder = open_decoder(model, threads=threads)
    deltas = _Deltas(tok, on_text) if on_text is not None else None
    limit = tokens.max_positions(tok, *folders)
    if draft is not None:
        draft = decoder_file(draft)
    if speculative != "off" or draft is not None:
        result = speculative_generate(decoder, prompt_ids, max_new_tokens=max_new_tokens, draft=speculative,
                                      draft_model=draft,
                                      sampling=sampling, stop_ids=stops, on_token=deltas, max_length=limit)
    else:
        result = generate(decoder, prompt_ids, max_new_tokens=max_new_tokens, sampling=sampling, stop_ids=stops,
                          on_token=deltas, max_length=limit, pad_id=tokens.pad_id(tok))
    text = tok.decode(result.token_ids, skip_special_tokens=True)
    if deltas is not None:
        deltas.show(text, final=True)
    return TextGeneration(result, text)
