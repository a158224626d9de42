"""`graphopt generate`: run a decoder with its KV cache on a prompt, streaming the new tokens.

A thin command: parse, call ``graphopt.generate``, render. onnxruntime and transformers load only when it runs.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Annotated

import typer

from graphopt.cli.options import Json, Threads


def command(
    model: Annotated[Path, typer.Argument(help="Decoder exported with --task causal-lm-with-past (.onnx).")],
    prompt: Annotated[str, typer.Option("--prompt", help="The prompt text.")],
    chat: Annotated[bool, typer.Option("--chat", help="Wrap the prompt in the tokenizer's chat template.")] = False,
    max_new_tokens: Annotated[int, typer.Option("--max-new-tokens", help="Most new tokens.", min=1)] = 64,
    threads: Threads = 0,
    temperature: Annotated[float, typer.Option("--temperature", help="0: greedy; above 0: sample.", min=0)] = 0.0,
    top_k: Annotated[int, typer.Option("--top-k", help="Sample among the K likeliest tokens (0: all).", min=0)] = 0,
    top_p: Annotated[float, typer.Option("--top-p", help="Sample among the likeliest tokens up to probability P.")] = 1.0,
    seed: Annotated[int | None, typer.Option("--seed", help="Seed of the sampler (reproducible runs).")] = None,
    ignore_eos: Annotated[bool, typer.Option("--ignore-eos", help="Never stop at an end-of-sequence token: "
                                             "generate exactly --max-new-tokens.")] = False,
    tokenizer: Annotated[Path | None, typer.Option("--tokenizer", help="Folder of the tokenizer (default: the "
                                                   "model's folder), e.g. the Hugging Face folder exported.")] = None,
    json_out: Json = False,
) -> None:
    """Generate text with a decoder and its KV cache: prefill the prompt, then one decode step per token.

    The tokenizer (and config.json / generation_config.json, for the maximum length and the stop tokens) come
    from the model's folder or --tokenizer DIR. Streams the text; --json prints one object instead.
    """
    from graphopt.errors import MissingFileError
    from graphopt.generate import chat as text
    from graphopt.generate.loop import generate, open_decoder
    from graphopt.generate.sampling import Sampling

    if not model.is_file():
        raise MissingFileError(f"{model}: no such file" if not model.exists() else f"{model}: is a folder, not an ONNX file")
    folder = text.tokenizer_folder(model, tokenizer)
    tok = text.load_tokenizer(folder)
    prompt_ids = text.encode(tok, prompt, chat=chat)
    folders = (folder, model.parent)
    stops = text.stop_ids(tok, *folders)
    sampling = Sampling(temperature=temperature, top_k=top_k, top_p=top_p, seed=seed)
    if ignore_eos:
        sampling, stops = sampling.masking(stops), []
    decoder = open_decoder(model, threads=threads or None)
    stream = None if json_out else _Stream(tok)
    result = generate(decoder, prompt_ids, max_new_tokens=max_new_tokens, sampling=sampling, stop_ids=stops,
                      on_token=stream, max_length=text.max_positions(tok, *folders), pad_id=text.pad_id(tok))
    new_text = tok.decode(result.token_ids, skip_special_tokens=True)
    if json_out:
        import json

        typer.echo(json.dumps({"prompt_ids": result.prompt_ids[0], "token_ids": result.token_ids, "text": new_text,
                               "prefill_ms": round(result.prefill_ms, 3),
                               "decode_tokens_per_s": None if result.decode_tokens_per_s is None
                               else round(result.decode_tokens_per_s, 2)}, indent=2))
        return
    stream.finish(new_text)
    rate = "n/a" if result.decode_tokens_per_s is None else f"{result.decode_tokens_per_s:.1f} tokens/s"
    typer.echo(f"{len(result.token_ids)} tokens ({result.finish}): prefill {result.prefill_ms:.1f} ms, "
               f"decode {rate}", err=True)


class _Stream:
    """Prints the text of the new tokens as they come (whole characters only: a token may end mid-character)."""

    def __init__(self, tokenizer):
        self.tokenizer, self.ids, self.shown = tokenizer, [], ""

    def __call__(self, row: int, token: int) -> None:
        self.ids.append(token)
        text = self.tokenizer.decode(self.ids, skip_special_tokens=True)
        if text.endswith("\ufffd") or not text.startswith(self.shown):
            return
        sys.stdout.write(text[len(self.shown):])
        sys.stdout.flush()
        self.shown = text

    def finish(self, text: str) -> None:
        if text.startswith(self.shown):
            sys.stdout.write(text[len(self.shown):])
        sys.stdout.write("\n")
        sys.stdout.flush()
