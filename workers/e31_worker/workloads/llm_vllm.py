"""The vLLM backend of the `llm` workload: vLLM's engine with continuous batching, on CUDA.

The requests arrive already tokenized (`llm_requests.Prompter`, the same chat template and
context check as the transformers backend), so vLLM gets token-id prompts
(`{"prompt_token_ids": ...}`) with one `SamplingParams` per request: `n`, `temperature`,
`top_p`, `seed`, `max_tokens` and `stop` are vLLM's own, and vLLM schedules the whole window
of requests at once. Embeddings go through `LLM.embed` in pooling mode; the pooling is the
model's sentence-transformers configuration where it has one (the built-in
`e31-tiny-embed` says mean pooling, normalised), and the vectors are normalised here again.

Written against vLLM's offline `LLM` API (0.6 and later; the pooling-runner argument has
changed names over the versions, so both are tried). It runs where a GPU and vLLM are; the
test suite has neither, so bench/gpu_check.sh is where it is exercised.
"""

from __future__ import annotations

import math
import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from e31_worker.workloads.llm_requests import Choice, Request

WINDOW_REQUESTS = 1024    # requests handed to the engine at once: it batches them itself
GPU_MEMORY_FRACTION = 0.9  # vLLM's default share of the GPU for weights and KV cache


class VllmBackend:
    """A `vllm.LLM` over the model directory."""

    name = "vllm"

    def __init__(self, llm: Any) -> None:
        self._llm = llm

    @classmethod
    def load(cls, model_dir: Path, *, context_tokens: int, embed: bool) -> VllmBackend:
        """Start vLLM's engine on the model (offline: a local directory, nothing downloaded)."""
        import vllm

        # ctx.device asked torch about CUDA in this process already; vLLM's workers must not
        # be forked from it (CUDA does not survive a fork), so they are spawned.
        os.environ.setdefault("VLLM_WORKER_MULTIPROC_METHOD", "spawn")
        base = {"model": str(model_dir), "max_model_len": context_tokens, "seed": 0,
                "gpu_memory_utilization": GPU_MEMORY_FRACTION}
        if not embed:
            return cls(vllm.LLM(**base))
        for extra in ({"runner": "pooling"}, {"task": "embed"}, {}):
            try:
                return cls(vllm.LLM(**base, **extra))
            except TypeError:  # this vLLM does not know that argument: try the older one
                continue
        raise RuntimeError("this vLLM cannot run the model for embeddings")

    @staticmethod
    def window(batch_size: int) -> int:
        """Requests per engine call (and so per commit at most): the engine batches inside."""
        return max(batch_size, WINDOW_REQUESTS)

    def complete(self, requests: Sequence[Request]) -> list[list[list[Choice]]]:
        """For each request, for each of its prompts, its `n` choices."""
        from vllm import SamplingParams

        prompts: list[dict[str, list[int]]] = []
        params = []
        for req in requests:
            s = req.sampling
            # Greedy choices are all the same, and older vLLMs refuse n > 1 when greedy
            # (best_of follows n): one choice, copied n times below.
            sp = SamplingParams(n=s.n if s.temperature > 0 else 1, temperature=s.temperature,
                                top_p=s.top_p, seed=s.seed, max_tokens=s.max_tokens,
                                stop=list(s.stop) or None)
            for ids in req.prompts:
                prompts.append({"prompt_token_ids": list(ids)})
                params.append(sp)
        outputs = iter(self._llm.generate(prompts, sampling_params=params, use_tqdm=False))
        answers = []
        for req in requests:
            per_prompt = []
            for _ in req.prompts:
                choices = [_choice(o) for o in sorted(next(outputs).outputs,
                                                      key=lambda o: o.index)]
                per_prompt.append(choices * (req.sampling.n // len(choices)))
            answers.append(per_prompt)
        return answers

    def embed(self, requests: Sequence[Request]) -> list[list[list[float]]]:
        """For each request, one unit vector per input."""
        prompts = [{"prompt_token_ids": list(ids)} for req in requests for ids in req.prompts]
        run = getattr(self._llm, "embed", None) or self._llm.encode
        outputs = iter(run(prompts, use_tqdm=False))
        return [[_unit(list(next(outputs).outputs.embedding)) for _ in req.prompts]
                for req in requests]


def _choice(output: Any) -> Choice:
    finish = "length" if output.finish_reason == "length" else "stop"
    return Choice(text=output.text, completion_tokens=len(output.token_ids),
                  finish_reason=finish)


def _unit(vector: list[float]) -> list[float]:
    norm = math.sqrt(sum(x * x for x in vector)) or 1.0
    return [float(x) / norm for x in vector]
