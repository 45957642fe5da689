"""`e31 batch submit|status|list|cancel|download` and `e31 model add|list|remove`.

Owns: the `batch` and `model` groups and how they print. Batches of requests to language
models, OpenAI-compatible (docs/workloads.md, "From the OpenAI Batch API to your own pool"):
the same `/v1/files` and `/v1/batches` the `openai` client calls, through `Client().batches`.
May import: `e31.cli.common`, `e31.core`, the client (lazily, inside the commands).
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import typer

from e31.cli.common import EXIT_INPUT, JsonOpt, api_client, call, fail, out, print_json

app = typer.Typer(help="Batches of requests to language models (OpenAI's Batch API format): "
                       "submit a JSONL file, watch it, download the completions.",
                  no_args_is_help=True)
models_app = typer.Typer(help="The language models batches may name (an admin adds them).",
                         no_args_is_help=True)
IdArg = typer.Argument(..., metavar="BATCH_ID", help="a batch's id (batch_…)")
FINAL_EXIT = {"completed": 0, "failed": 1, "expired": 1, "cancelled": 1}


def _call(fn: Callable[..., Any]) -> Any:
    """`fn(client)` with the CLI's client, its errors as every job command says them."""
    return call(fn, api_client())


def _line(info: dict[str, Any]) -> str:
    counts = info.get("request_counts") or {}
    usage = info.get("usage") or {}
    return (f"{info['id']}  {info['status']:<11} {counts.get('completed', 0)}/"
            f"{counts.get('total', 0)} done, {counts.get('failed', 0)} failed, "
            f"{usage.get('input_tokens', 0)} tokens in, {usage.get('output_tokens', 0)} out")


def _show(info: dict[str, Any], as_json: bool) -> None:
    if as_json:
        print_json(info)
        return
    out.print(_line(info), highlight=False)
    errors = (info.get("errors") or {}).get("data") or []
    for e in errors:
        where = f"line {e['line']}: " if e.get("line") else ""
        out.print(f"  {where}{e['code']}: {e['message']}", highlight=False)


@app.command("submit")
def submit(path: Path = typer.Argument(..., metavar="FILE", help="JSONL: OpenAI batch "
                                       "requests, or bare bodies ({\"messages\": [...]})"),
           model: str = typer.Option(None, "--model", help="for the lines that name none"),
           endpoint: str = typer.Option(None, "--endpoint", help="/v1/chat/completions, "
                                        "/v1/completions or /v1/embeddings [default: what the "
                                        "lines hold]"),
           window: str = typer.Option("24h", "--window", help="the completion window: the "
                                      "batch expires past it"),
           wait: bool = typer.Option(False, "--wait", help="wait for it to end, showing the "
                                     "counts; exit 0 only if it completed"),
           as_json: bool = JsonOpt) -> None:
    """Submit a file of requests as a batch; prints its id first."""
    if not path.is_file():
        fail(f"{path}: no such file", EXIT_INPUT)
    handle = _call(lambda c: c.batches.submit(path, model=model, endpoint=endpoint,
                                              completion_window=window))
    if not wait:
        _show(handle.info, as_json)
        return
    if not as_json:
        out.print(handle.id, highlight=False)
    last: list[str] = []

    def progress(info: dict[str, Any]) -> None:
        line = _line(info)
        if not as_json and line != (last[-1] if last else None):
            last.append(line)
            out.print(line, highlight=False)

    _call(lambda c: handle.wait(on_progress=progress))
    _show(handle.info, as_json)
    raise typer.Exit(FINAL_EXIT.get(handle.status, 1))


@app.command("status")
def status(batch_id: str = IdArg, as_json: bool = JsonOpt) -> None:
    """A batch's status, request counts and tokens (and why a file failed validation)."""
    _show(_call(lambda c: c.batches.get(batch_id).info), as_json)


@app.command("list")
def list_batches(limit: int = typer.Option(20, "--limit", min=1, max=100,
                                          help="the newest this many"),
                 as_json: bool = JsonOpt) -> None:
    """Your batches, newest first."""
    rows = _call(lambda c: c.batches.list(limit=limit))
    if as_json:
        print_json(rows)
        return
    if not rows:
        out.print("no batches (e31 batch submit FILE --model NAME)", highlight=False)
    for r in rows:
        out.print(_line(r), highlight=False)


@app.command("cancel")
def cancel(batch_id: str = IdArg, as_json: bool = JsonOpt) -> None:
    """Cancel a batch: what its shards finished stays in its output file."""
    _show(_call(lambda c: c.batches.cancel(batch_id).info), as_json)


@app.command("download")
def download(batch_id: str = IdArg,
             output: Path = typer.Option(Path("."), "-o", "--output", help="a directory")
             ) -> None:
    """Write the batch's output and error files into a directory."""
    paths = _call(lambda c: c.batches.get(batch_id).download(output))
    if not paths:
        out.print(f"{batch_id} has no output or error file yet", highlight=False)
    for p in paths:
        out.print(str(p), highlight=False)


@models_app.command("list")
def list_models(as_json: bool = JsonOpt) -> None:
    """The models a request's body.model may name."""
    rows = _call(lambda c: c.batches.models())
    if as_json:
        print_json(rows)
        return
    for m in rows:
        mem = f"{m['gpu_mem_gb']:g} GB" if m.get("gpu_mem_gb") else "-"
        out.print(f"{m['id']:<24} {m['kind']:<6} {mem:<8} {m['path']}", highlight=False)


@models_app.command("add")
def add_model(name: str = typer.Argument(..., metavar="NAME"),
              path: str = typer.Option(..., "--path", help="a Hugging Face-format directory "
                                       "beneath models_dir or input_file_roots, or s3://…"),
              gpu_mem_gb: float = typer.Option(None, "--gpu-mem-gb", help="the GPU memory it "
                                               "needs (its size class)"),
              kind: str = typer.Option(None, "--kind", help="chat or embed [default: read "
                                       "from the directory]"),
              replace: bool = typer.Option(False, "--replace", help="replace a model of that "
                                           "name")) -> None:
    """Register a model by name (an admin's token)."""
    if "://" not in path:
        path = str(Path(path).expanduser().resolve())
    m = _call(lambda c: c.batches.add_model(name, path, kind=kind, gpu_mem_gb=gpu_mem_gb,
                                            replace=replace))
    out.print(f"model {m['id']} ({m['kind']}) at {m['path']}", highlight=False)


@models_app.command("remove")
def remove_model(name: str = typer.Argument(..., metavar="NAME")) -> None:
    """Forget a model (batches that name it fail their lines with model_not_found)."""
    _call(lambda c: c.batches.remove_model(name))
    out.print(f"model {name} removed", highlight=False)
