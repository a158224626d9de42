"""``graphopt deploy``: write a Triton model repository (config.pbtxt, 1/model.onnx, graphopt.json)."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from graphopt.cli.options import Json, Provider, Threads

EPILOG = """\
Examples:

  graphopt deploy minilm.int8.onnx -o repo --name minilm --report report.json

  tritonserver --model-repository repo      # or: graphopt serve repo
"""


def command(
    model: Annotated[Path, typer.Argument(help="Optimized ONNX model.", show_default=False)],
    output: Annotated[Path, typer.Option("--output", "-o", help="Model repository folder (created if missing).")],
    name: Annotated[str | None, typer.Option("--name", help="Model name (default: the file name up to its first dot: minilm.int8.onnx -> minilm).")] = None,
    max_batch: Annotated[int, typer.Option("--max-batch", help="max_batch_size (0: no batching).")] = 32,
    provider: Provider = "cpu",
    instances: Annotated[int, typer.Option("--instances", help="Model instances (instance_group count).")] = 1,
    threads: Threads = 0,
    max_delay_us: Annotated[int, typer.Option("--max-delay-us", help="Dynamic batching: longest wait for a batch.")] = 2000,
    max_length: Annotated[int, typer.Option("--max-length", help="Longest sequence the model takes (manifest).")] = 512,
    report: Annotated[Path | None, typer.Option("--report", help="JSON report of `graphopt optimize` (recipe, passes, verification).", metavar="FILE")] = None,
    external_data: Annotated[bool | None, typer.Option("--external-data/--no-external-data", help="Weights in model.onnx.data; default: only above 2 GB.")] = None,
    force: Annotated[bool, typer.Option("--force", help="Replace REPO/NAME if it exists.")] = False,
    json_: Json = False,
    genai: Annotated[bool, typer.Option(
        "--genai", help="Write an ONNX Runtime GenAI folder instead (OUTPUT/genai_config.json, model.onnx, the "
        "tokenizer files) for a decoder with past.")] = False,
    tokenizer: Annotated[Path | None, typer.Option(
        "--tokenizer", help="With --genai: folder of the tokenizer and config.json (default: beside the model).")] = None,
    verify: Annotated[bool | None, typer.Option(
        "--verify/--no-verify", help="With --genai: load OUTPUT with onnxruntime_genai and check its greedy tokens "
        "equal graphopt generate's (default: when onnxruntime_genai is installed).")] = None,
) -> None:
    """Write REPO/NAME/{config.pbtxt, graphopt.json, 1/model.onnx} for Triton's onnxruntime backend.

    graphopt.json records the recipe and passes, the verification numbers, the minimum ONNX Runtime
    version and the providers the graph's ops need, and the input contract (what padding means).
    """
    from graphopt.cli.console import make_console

    if genai:
        _genai(model, output, tokenizer=tokenizer, force=force, verify=verify, json_=json_)
        return
    from graphopt.deploy import deploy, read_manifest

    dst = deploy(model, output, name=name, max_batch=max_batch, provider=str(provider), instances=instances,
                 threads=threads or None, max_delay_us=max_delay_us, max_length=max_length, report=report,
                 external_data=external_data, force=force)
    man = read_manifest(dst)
    if json_:
        import json

        typer.echo(json.dumps({"path": str(dst), "manifest": man}, indent=2, default=str))
        return
    ort = man["onnxruntime"]
    make_console(highlight=False).print(
        f"wrote {dst}: onnxruntime >= {ort['min_version']} ({', '.join(ort['decided_by'])}), "
        f"providers {', '.join(ort['providers'])}, padding {man['input_contract']['padding']}")


def _genai(model: Path, output: Path, *, tokenizer: Path | None, force: bool, verify: bool | None, json_: bool) -> None:
    import importlib.util
    import json

    from graphopt.cli.console import make_console
    from graphopt.deploy_genai import CONFIG_NAME, deploy_genai, probe_ids, verify_genai
    from graphopt.errors import UsageError

    have = importlib.util.find_spec("onnxruntime_genai") is not None
    if verify and not have:
        raise UsageError("--verify needs onnxruntime_genai", hint="pip install onnxruntime-genai, or --no-verify")
    dst = deploy_genai(model, output, tokenizer=tokenizer, force=force)
    checked = None
    if verify or (verify is None and have):
        checked = verify_genai(dst, probe_ids(dst))
    if json_:
        typer.echo(json.dumps({"path": str(dst), "genai_config": json.loads((dst / CONFIG_NAME).read_text()),
                               "verified_tokens": checked}, indent=2))
        return
    how = (f"onnxruntime_genai's {len(checked)} greedy tokens equal graphopt generate's" if checked is not None
           else "not verified (--no-verify)" if verify is False else "not verified (onnxruntime_genai not installed)")
    make_console(highlight=False).print(f"wrote {dst} for ONNX Runtime GenAI: {how}")
