"""`graphopt generate`: run a decoder with its KV cache on a prompt, streaming the new tokens.

A thin command: parse, call ``graphopt.generate``, render. onnxruntime and transformers load only when it runs.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Annotated

import typer

from graphopt.cli.options import Threads

Json = Annotated[bool, typer.Option("--json", help="Print one JSON object (prompt_ids, token_ids, text, prefill_ms, "
                                     "decode_tokens_per_s) instead of streaming the text.")]


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
                                             "generate --max-new-tokens (within the model's maximum length).")] = False,
    tokenizer: Annotated[Path | None, typer.Option("--tokenizer", help="Folder of the tokenizer (default: the "
                                                   "model's folder), e.g. the Hugging Face folder exported.")] = None,
    json_out: Json = False,
    speculative: Annotated[str, typer.Option("--speculative", help="Draft tokens and check them in one forward "
                                             "(greedy tokens are plain decoding's; batch 1): lookup (prompt lookup), "
                                             "heads (the graph's Medusa heads, pass speculative-heads), layer-skip "
                                             "(the graph's first layers and exit head, pass layer-skip-draft), auto "
                                             "(the draft decoder NAME.draft.onnx beside NAME.onnx with lookup first, "
                                             "else heads, else layer-skip when the graph carries them, else "
                                             "lookup), or off.")] = "off",
    draft: Annotated[Path | None, typer.Option("--draft", help="A draft decoder (.onnx, the same tokenizer: a "
                                               "smaller model, or this model's int4 build, which runs on the "
                                               "model's KV cache) that drafts tokens for the model to check "
                                               "(implies speculative decoding; with --speculative lookup, prompt "
                                               "lookup where the text repeats).")] = None,
) -> None:
    """Generate text with a decoder and its KV cache: prefill the prompt, then one decode step per token.

    The tokenizer (and config.json / generation_config.json, for the maximum length and the stop tokens) come
    from the model's folder or --tokenizer DIR. Streams the text; --json prints one object instead.
    """
    from graphopt.generate.sampling import Sampling
    from graphopt.generate.text import generate_text

    def stream(delta: str) -> None:
        sys.stdout.write(delta)
        sys.stdout.flush()

    result = generate_text(model, prompt, max_new_tokens=max_new_tokens, chat=chat, ignore_eos=ignore_eos,
                           sampling=Sampling(temperature=temperature, top_k=top_k, top_p=top_p, seed=seed),
                           tokenizer=tokenizer, threads=threads or None, on_text=None if json_out else stream,
                           speculative=speculative, draft=draft)
    g = result.generation
    if json_out:
        import json

        d = result.as_dict()
        d["prefill_ms"] = round(d["prefill_ms"], 3)
        if d["decode_tokens_per_s"] is not None:
            d["decode_tokens_per_s"] = round(d["decode_tokens_per_s"], 2)
        typer.echo(json.dumps(d, indent=2))
        return
    sys.stdout.write("\n")
    rate = "n/a" if g.decode_tokens_per_s is None else f"{g.decode_tokens_per_s:.1f} tokens/s"
    spec = f", {g.accepted_per_step:.2f} drafted tokens accepted per step ({g.draft})" if hasattr(g, "draft") else ""
    typer.echo(f"{len(g.token_ids)} tokens ({g.finish}): prefill {g.prefill_ms:.1f} ms, decode {rate}{spec}", err=True)
