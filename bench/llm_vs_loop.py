"""LLM batch throughput: the `llm` workload against a hand-written generate loop.

Both sides, in the same process and run, on the same device, over the same chat prompts
(an OpenAI batch file: `--prompts` user messages of `--min-chars` to `--max-chars`
characters, greedy unless `--temperature`, `--max-tokens` each), the same model (the
built-in tiny chat model, or a wider and deeper random one with `--layers` / `--hidden`,
built by `e31_worker.workloads.tinymodels` so that compute dominates) and the same batch
size:

- `--engine transformers` (CPU): the hand loop reads the file, applies the chat template,
  tokenizes each batch of `--batch-size` prompts in file order with left padding, calls
  `model.generate` under `torch.inference_mode`, decodes and writes one JSON row per
  request. The workload (`e31_worker.workloads.llm:run`, in-process with a JobContext on
  fresh temporary directories) does that and more: it checks every request, sorts each
  window of requests by length, writes OpenAI's batch output rows and commits them to
  checkpoint segments.
- `--engine vllm` (a CUDA GPU with vLLM installed; bench/gpu_check.sh): the hand side hands
  every prompt to `vllm.LLM.generate` at once; the workload runs with `backend: vllm`. Each
  side runs in a process of its own (`--side`), since vLLM does not give its GPU memory back
  to a process that starts a second engine.

Tokens per second = completion tokens / seconds. "generation" time runs from the first to
the last progress report of the workload (after its model is loaded) and, on the hand side,
from after the load to the last row written; "total" includes loading. Repetition 0 warms
up (imports, caches) and is not counted; later ones alternate the order; medians.

    python bench/llm_vs_loop.py --prompts 256 --layers 4 --hidden 256 --repeats 3
    python bench/llm_vs_loop.py --engine vllm --prompts 4096 --layers 8 --hidden 1024
    python bench/llm_vs_loop.py --smoke --out llm.json   # the suite's: 8 prompts, tiny model
"""

from __future__ import annotations

import argparse
import json
import random
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from e31_worker.child.context import JobContext
from e31_worker.workloads import llm
from e31_worker.workloads.tinymodels import build

from report import parse, save

SMOKE = {"prompts": 8, "max_tokens": 4, "batch_size": 4, "repeats": 1, "layers": 2,
         "hidden": 128}
SHOWN_CHARS = 4_000   # the end of a failed side's output
WORDS = ("the", "batch", "of", "prompts", "runs", "overnight", "on", "a", "shared", "pool",
         "model", "answers", "each", "request", "with", "tokens")


def write_requests(path: Path, n: int, min_chars: int, max_chars: int, max_tokens: int,
                   temperature: float = 0.0) -> None:
    """`n` chat requests whose messages have `min_chars` to `max_chars` characters."""
    rng = random.Random(0)
    with open(path, "w") as f:
        for i in range(n):
            words: list[str] = []
            target = rng.randint(min_chars, max_chars)
            while len(" ".join(words)) < target:
                words.append(rng.choice(WORDS))
            body = {"model": "bench", "temperature": temperature, "max_tokens": max_tokens,
                    "messages": [{"role": "user", "content": " ".join(words)[:target]}]}
            f.write(json.dumps({"custom_id": f"r-{i}", "method": "POST",
                                "url": "/v1/chat/completions", "body": body}) + "\n")


def read_prompts(src: Path, tokenizer: Any) -> list[tuple[str, str]]:
    """(custom_id, templated prompt text) per request, as one would do by hand."""
    out = []
    for line in src.read_text().splitlines():
        req = json.loads(line)
        text = tokenizer.apply_chat_template(req["body"]["messages"],
                                             add_generation_prompt=True, tokenize=False)
        out.append((req["custom_id"], text))
    return out


def hand_transformers(model_dir: Path, src: Path, out: Path, batch_size: int,
                      max_tokens: int, temperature: float) -> tuple[int, float]:
    """The loop one would write with transformers; (completion tokens, generation seconds)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer
    tok = AutoTokenizer.from_pretrained(model_dir, local_files_only=True)
    tok.padding_side = "left"
    model = AutoModelForCausalLM.from_pretrained(model_dir, local_files_only=True).eval()
    started = time.perf_counter()
    tokens = 0
    prompts = read_prompts(src, tok)
    with open(out / "results.jsonl", "w") as f, torch.inference_mode():
        for start in range(0, len(prompts), batch_size):
            batch = prompts[start:start + batch_size]
            enc = tok([t for _, t in batch], return_tensors="pt", padding=True,
                      add_special_tokens=False)
            sampling = ({"do_sample": True, "temperature": temperature, "top_k": 0}
                        if temperature > 0 else {"do_sample": False})
            gen = model.generate(**enc, max_new_tokens=max_tokens, **sampling,
                                 pad_token_id=tok.pad_token_id)
            new = gen[:, enc["input_ids"].shape[1]:]
            tokens += int((new != tok.pad_token_id).sum())
            for (cid, _), text in zip(batch, tok.batch_decode(new, skip_special_tokens=True),
                                      strict=True):
                f.write(json.dumps({"custom_id": cid, "text": text}) + "\n")
    return tokens, time.perf_counter() - started


def hand_vllm(model_dir: Path, src: Path, out: Path, batch_size: int,
              max_tokens: int, temperature: float) -> tuple[int, float]:
    """`vllm.LLM.generate` over every prompt at once; (completion tokens, generation s)."""
    import vllm
    from transformers import AutoTokenizer
    tok = AutoTokenizer.from_pretrained(model_dir, local_files_only=True)
    engine = vllm.LLM(model=str(model_dir), seed=0, max_model_len=llm.context_of(model_dir))
    started = time.perf_counter()
    prompts = read_prompts(src, tok)
    params = vllm.SamplingParams(temperature=temperature, max_tokens=max_tokens)
    results = engine.generate([t for _, t in prompts], params, use_tqdm=False)
    tokens = 0
    with open(out / "results.jsonl", "w") as f:
        for (cid, _), res in zip(prompts, results, strict=True):
            tokens += len(res.outputs[0].token_ids)
            f.write(json.dumps({"custom_id": cid, "text": res.outputs[0].text}) + "\n")
    return tokens, time.perf_counter() - started


def workload(model_dir: Path, src: Path, root: Path, batch_size: int, engine: str,
             threads: int) -> tuple[int, float]:
    """The entrypoint's own function in-process; (completion tokens, generation seconds)."""
    dirs = {name: root / name for name in ("output", "checkpoints", "work")}
    for d in dirs.values():
        d.mkdir(parents=True)
    ctx = JobContext(job_id="bench", attempt=1, params={}, output_dir=dirs["output"],
                     checkpoint_dir=dirs["checkpoints"], work_dir=dirs["work"],
                     progress_path=root / "progress.json", gpus="0" if engine == "vllm" else "")
    reports: list[float] = []
    report = ctx.progress

    def timed(done: float, total: float | None = None) -> None:
        reports.append(time.perf_counter())
        report(done, total)

    ctx.progress = timed  # type: ignore[method-assign]
    result = llm.run(ctx, requests=str(src), model=str(model_dir), model_name="bench",
                     endpoint="/v1/chat/completions", batch_size=batch_size, backend=engine,
                     cpu_threads=threads)
    assert result["failed"] == 0, result
    return int(result["completion_tokens"]), reports[-1] - reports[0]


def run_side(args: argparse.Namespace, side: str, model_dir: Path, src: Path,
             out: Path) -> tuple[int, float]:
    """One side, once, in this process: (completion tokens, generation seconds)."""
    if side == "workload":
        return workload(model_dir, src, out, args.batch_size, args.engine, args.threads)
    hand: Callable[..., tuple[int, float]] = (hand_vllm if args.engine == "vllm"
                                              else hand_transformers)
    return hand(model_dir, src, out, args.batch_size, args.max_tokens, args.temperature)


def side_process(args: argparse.Namespace, side: str, model_dir: Path,
                 src: Path) -> tuple[int, float]:
    """One side, once, in a fresh process (its GPU memory goes back when it exits)."""
    cmd = [sys.executable, __file__, "--engine", args.engine, "--side", side,
           "--model-dir", str(model_dir), "--requests", str(src),
           "--batch-size", str(args.batch_size), "--max-tokens", str(args.max_tokens),
           "--temperature", str(args.temperature),
           "--threads", str(args.threads)]
    done = subprocess.run(cmd, capture_output=True, text=True)
    if done.returncode:
        sys.exit(f"the {side} side failed:\n{done.stderr[-SHOWN_CHARS:]}")
    tokens, seconds = json.loads(done.stdout.strip().splitlines()[-1])
    return int(tokens), float(seconds)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--engine", choices=("transformers", "vllm"), default="transformers")
    parser.add_argument("--prompts", type=int, default=256)
    parser.add_argument("--min-chars", type=int, default=20)
    parser.add_argument("--max-chars", type=int, default=200)
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--temperature", type=float, default=0.0,
                        help="0: greedy, both sides write the same tokens; above 0 both sample "
                             "(the workload through its per-row sampler), and may end early")
    parser.add_argument("--batch-size", type=int, default=16)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, default=1, help="torch intra-op threads, both sides")
    parser.add_argument("--side", choices=("hand", "workload"), default=None,
                        help="run only this side once, over --model-dir and --requests, and "
                             "print its (tokens, seconds) as JSON: how --engine vllm runs each")
    parser.add_argument("--model-dir", type=Path, default=None)
    parser.add_argument("--requests", type=Path, default=None)
    args = parse(parser, SMOKE)
    torch.set_num_threads(args.threads)
    if args.side:
        out = Path(tempfile.mkdtemp(prefix="e31-bench-llm-side-"))
        try:
            print(json.dumps(run_side(args, args.side, args.model_dir, args.requests, out)))
        finally:
            shutil.rmtree(out, ignore_errors=True)
        return
    tmp = Path(tempfile.mkdtemp(prefix="e31-bench-llm-"))
    try:
        figures = measure(args, tmp)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    save(args, figures)


def measure(args: argparse.Namespace, tmp: Path) -> dict[str, Any]:
    """Both sides `repeats` times (after a warm-up); prints and returns the medians."""
    model_dir = build(tmp / "model", "chat", layers=args.layers, hidden=args.hidden)
    src = tmp / "requests.jsonl"
    write_requests(src, args.prompts, args.min_chars, args.max_chars, args.max_tokens,
                   args.temperature)
    gen_s: dict[str, list[float]] = {"hand": [], "workload": []}
    total_s: dict[str, list[float]] = {"hand": [], "workload": []}
    tokens: dict[str, int] = {}
    for rep in range(args.repeats + 1):  # repetition 0 warms up and is not counted
        for side in (("hand", "workload") if rep % 2 == 0 else ("workload", "hand")):
            out = tmp / f"{side}-{rep}"
            out.mkdir()
            start = time.perf_counter()
            if args.engine == "vllm":
                count, seconds = side_process(args, side, model_dir, src)
            else:
                count, seconds = run_side(args, side, model_dir, src, out)
            elapsed = time.perf_counter() - start
            if args.temperature == 0:
                assert tokens.setdefault(side, count) == count, (side, count)
            tokens[side] = count
            if rep:
                gen_s[side].append(seconds)
                total_s[side].append(elapsed)
            shutil.rmtree(out)
    assert args.temperature > 0 or tokens["hand"] == tokens["workload"], tokens
    med = {side: (statistics.median(gen_s[side]), statistics.median(total_s[side]))
           for side in gen_s}
    rate = {side: tokens[side] / med[side][0] for side in med}  # the last round's tokens
    ratio = rate["workload"] / rate["hand"]
    print(f"engine={args.engine} prompts={args.prompts} chars={args.min_chars}-{args.max_chars} "
          f"max_tokens={args.max_tokens} temperature={args.temperature:g} "
          f"batch_size={args.batch_size} layers={args.layers} hidden={args.hidden} "
          f"repeats={args.repeats} torch_threads={torch.get_num_threads()}")
    for side, label in (("hand", "hand-written loop"), ("workload", "llm workload")):
        print(f"{label:18} generation {med[side][0]:.3f} s  {rate[side]:,.0f} tokens/s  "
              f"(total with load {med[side][1]:.3f} s)")
    print(f"ratio workload/hand (tokens/s): {ratio:.3f}")
    return {"engine": args.engine, "prompts": args.prompts, "completion_tokens": tokens["hand"],
            "temperature": args.temperature, "batch_size": args.batch_size,
            "layers": args.layers, "hidden": args.hidden,
            "repeats": args.repeats, "torch_threads": torch.get_num_threads(),
            "hand_s": med["hand"][0], "workload_s": med["workload"][0],
            "hand_total_s": med["hand"][1], "workload_total_s": med["workload"][1],
            "hand_tokens_per_s": rate["hand"], "workload_tokens_per_s": rate["workload"],
            "ratio_workload_over_hand": ratio}


if __name__ == "__main__":
    main()
