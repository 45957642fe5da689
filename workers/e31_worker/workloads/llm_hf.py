"""The transformers backend of the `llm` workload: `model.generate` over padded batches.

Completions: every (request, prompt, choice) is one row; rows are sorted by (max_tokens,
prompt length) and cut into batches of `batch_size`, left-padded, and generated greedily
under `torch.inference_mode`. When a batch holds only greedy rows with one `max_tokens`
(the common case: a file of `temperature: 0` requests), that is all: the same call one would
write by hand. Otherwise a logits processor (`llm_sampling.RowSampler`) gives each row its own
temperature, top_p, seed, `max_tokens` and stop strings (it ends a row with the end-of-turn
token), and the completion is cut before its first stop string.

Embeddings: rows sorted by length, right-padded (positions start at 0 for every row), the
last hidden state mean-pooled over the attention mask and L2-normalised.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from e31_worker.workloads.llm_requests import Choice, Request, Sampling
from e31_worker.workloads.llm_sampling import RowSampler, stop_cut


@dataclass(frozen=True)
class _Row:
    """One completion to generate: choice `choice` of prompt `prompt` of request `request`."""

    request: int
    prompt: int
    choice: int
    ids: tuple[int, ...]
    sampling: Sampling


class HFBackend:
    """A transformers model on `device`, with its tokenizer."""

    name = "transformers"

    def __init__(self, *, model: Any, tokenizer: Any, device: str, batch_size: int) -> None:
        self._model = model
        self._tok = tokenizer
        self._device = device
        self._batch_size = max(1, batch_size)
        config = getattr(model, "generation_config", None)
        eos = getattr(config, "eos_token_id", None)
        if eos is None:
            eos = tokenizer.eos_token_id
        self._eos = [eos] if isinstance(eos, int) else list(eos or [])
        pad = getattr(config, "pad_token_id", None)
        self._pad = pad if pad is not None else (tokenizer.pad_token_id or self._eos[0])

    @classmethod
    def load(cls, model_dir: Path, *, tokenizer: Any, device: str, embed: bool,
             batch_size: int) -> HFBackend:
        """Load the model in `model_dir` (offline) for generation or, with `embed`, pooling."""
        import transformers
        from transformers import AutoModel, AutoModelForCausalLM

        transformers.utils.logging.disable_progress_bar()  # not a job log's business
        kwargs: dict[str, Any] = {}
        if device == "cuda":  # the checkpoint's own dtype; on CPU float32 (bf16 is slow there)
            major_minor = tuple(int(p) for p in transformers.__version__.split(".")[:2])
            kwargs["dtype" if major_minor >= (4, 56) else "torch_dtype"] = "auto"
        auto: Any = AutoModel if embed else AutoModelForCausalLM
        model = auto.from_pretrained(str(model_dir), local_files_only=True, **kwargs)
        return cls(model=model.to(device).eval(), tokenizer=tokenizer, device=device,
                   batch_size=batch_size)

    def complete(self, requests: Sequence[Request]) -> list[list[list[Choice]]]:
        """For each request, for each of its prompts, its `n` choices."""
        rows = [_Row(r, p, c, ids, req.sampling) for r, req in enumerate(requests)
                for p, ids in enumerate(req.prompts) for c in range(req.sampling.n)]
        rows.sort(key=lambda row: (row.sampling.max_tokens, len(row.ids)))
        out: list[list[list[Choice]]] = [
            [[] for _ in req.prompts] for req in requests]
        done: dict[tuple[int, int, int], Choice] = {}
        for start in range(0, len(rows), self._batch_size):
            batch = rows[start:start + self._batch_size]
            for row, choice in zip(batch, self._generate(batch), strict=True):
                done[(row.request, row.prompt, row.choice)] = choice
        for (r, p, _), choice in sorted(done.items()):
            out[r][p].append(choice)
        return out

    def embed(self, requests: Sequence[Request]) -> list[list[list[float]]]:
        """For each request, one unit vector per input."""
        items = sorted(((r, i, ids) for r, req in enumerate(requests)
                        for i, ids in enumerate(req.prompts)), key=lambda t: len(t[2]))
        vectors: dict[tuple[int, int], list[float]] = {}
        for start in range(0, len(items), self._batch_size):
            batch = items[start:start + self._batch_size]
            ids, mask = self._padded([t[2] for t in batch], left=False)
            with torch.inference_mode():
                hidden = self._model(input_ids=ids, attention_mask=mask).last_hidden_state
                weights = mask.unsqueeze(-1).to(hidden.dtype)
                pooled = (hidden * weights).sum(1) / weights.sum(1).clamp(min=1.0)
                unit = torch.nn.functional.normalize(pooled.float(), dim=-1)
            for (r, i, _), vector in zip(batch, unit.cpu().tolist(), strict=True):
                vectors[(r, i)] = vector
        return [[vectors[(r, i)] for i in range(len(req.prompts))]
                for r, req in enumerate(requests)]

    def _generate(self, batch: list[_Row]) -> list[Choice]:
        ids, mask = self._padded([row.ids for row in batch], left=True)
        width = ids.shape[1]
        limits = [row.sampling.max_tokens for row in batch]
        processors = None
        if (len(set(limits)) > 1
                or any(row.sampling.temperature > 0 or row.sampling.stop for row in batch)):
            from transformers import LogitsProcessorList
            processors = LogitsProcessorList([RowSampler(
                [row.sampling for row in batch], [row.choice for row in batch],
                prompt_width=width, eos_id=self._eos[0], device=self._device,
                decode=self._decode)])
        from transformers import GenerationConfig
        config = GenerationConfig(max_new_tokens=max(limits), do_sample=False,
                                  pad_token_id=self._pad, eos_token_id=self._eos)
        with torch.inference_mode():
            out = self._model.generate(input_ids=ids, attention_mask=mask,
                                       generation_config=config, logits_processor=processors)
        return [self._choice(tokens, row.sampling)
                for tokens, row in zip(out[:, width:].tolist(), batch, strict=True)]

    def _choice(self, tokens: list[int], sampling: Sampling) -> Choice:
        """The completion in `tokens` (generated ids, padded after the end of turn)."""
        limit = sampling.max_tokens
        end = next((i for i, t in enumerate(tokens) if t in self._eos), None)
        if end is None:
            tokens, finish = tokens[:limit], "length"
        else:  # an end of turn at `limit` was forced there by RowSampler (or a stop string)
            tokens, finish = tokens[:end], ("length" if end >= limit else "stop")
        decode = self._decode
        text = decode(tokens)
        if sampling.stop:
            cut = stop_cut(tokens, text, sampling.stop, decode)
            if cut is not None:
                text, count = cut
                return Choice(text=text, completion_tokens=count, finish_reason="stop")
        return Choice(text=text, completion_tokens=len(tokens), finish_reason=finish)

    def _decode(self, tokens: list[int]) -> str:
        return str(self._tok.decode(tokens, skip_special_tokens=True))

    def _padded(self, seqs: list[tuple[int, ...]], *,
                left: bool) -> tuple[torch.Tensor, torch.Tensor]:
        width = max(len(s) for s in seqs)
        ids = torch.full((len(seqs), width), self._pad, dtype=torch.long)
        mask = torch.zeros((len(seqs), width), dtype=torch.long)
        for i, s in enumerate(seqs):
            cols = slice(width - len(s), width) if left else slice(0, len(s))
            ids[i, cols] = torch.tensor(s, dtype=torch.long)
            mask[i, cols] = 1
        return ids.to(self._device), mask.to(self._device)
