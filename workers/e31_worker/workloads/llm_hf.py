"""The transformers backend of the `llm` workload: `model.generate` over padded batches.

Completions: every (request, prompt, choice) is one row; rows are sorted by (max_tokens,
prompt length) and cut into batches of `batch_size`, left-padded, and generated greedily
under `torch.inference_mode`. When a batch holds only greedy rows with one `max_tokens`
(the common case: a file of `temperature: 0` requests), that is all: the same call one would
write by hand. Otherwise a logits processor (`RowSampler`) gives each row its own
temperature, top_p, seed (a `torch.Generator` per seeded row, so that its draws do not
depend on its neighbours') and `max_tokens` (it forces the end-of-turn token when a row has
had its tokens), and turns its choice into the only finite score, which greedy decoding then
takes. A row with stop strings ends when the tail of its text holds one (`StopStrings`), and
the completion is cut before it.

Embeddings: rows sorted by length, right-padded (positions start at 0 for every row), the
last hidden state mean-pooled over the attention mask and L2-normalised.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from e31_worker.workloads.llm_requests import Choice, Request, Sampling

NEG_INF = float("-inf")


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
        if any(row.sampling.temperature > 0 for row in batch) or len(set(limits)) > 1:
            from transformers import LogitsProcessorList
            processors = LogitsProcessorList([RowSampler(
                [row.sampling for row in batch], [row.choice for row in batch],
                prompt_width=width, eos_id=self._eos[0], device=self._device)])
        from transformers import GenerationConfig, StoppingCriteriaList
        stopping = None
        if any(row.sampling.stop for row in batch):
            stopping = StoppingCriteriaList([StopStrings(
                [row.sampling.stop for row in batch], prompt_width=width, decode=self._decode)])
        config = GenerationConfig(max_new_tokens=max(limits), do_sample=False,
                                  pad_token_id=self._pad, eos_token_id=self._eos)
        with torch.inference_mode():
            out = self._model.generate(input_ids=ids, attention_mask=mask,
                                       generation_config=config, logits_processor=processors,
                                       stopping_criteria=stopping)
        return [self._choice(tokens, row.sampling)
                for tokens, row in zip(out[:, width:].tolist(), batch, strict=True)]

    def _choice(self, tokens: list[int], sampling: Sampling) -> Choice:
        """The completion in `tokens` (generated ids, padded after the end of turn)."""
        limit = sampling.max_tokens
        end = next((i for i, t in enumerate(tokens) if t in self._eos), None)
        if end is None:
            tokens, finish = tokens[:limit], "length"
        else:  # an end of turn at `limit` was forced there by RowSampler
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


def stop_cut(tokens: list[int], text: str, stops: Sequence[str],
             decode: Callable[[list[int]], str]) -> tuple[str, int] | None:
    """(the text before the first stop string, the tokens it took to write that string), or
    None when no stop string occurs. The count is the shortest prefix of `tokens` whose text
    holds a stop string (a binary search: holding one only grows with the prefix)."""
    hits = [at for s in stops if (at := text.find(s)) >= 0]
    if not hits:
        return None
    low, high = 1, len(tokens)
    while low < high:
        mid = (low + high) // 2
        if any(s in decode(tokens[:mid]) for s in stops):
            high = mid
        else:
            low = mid + 1
    return text[:min(hits)], low


class StopStrings:
    """A stopping criterion: a row is done once the tail of its text holds one of its stop
    strings (the tail: enough tokens for the longest, since every token writes a character
    or more, plus a few for tokens that write none or part of one)."""

    TAIL_SLACK_TOKENS = 4

    def __init__(self, stops: list[tuple[str, ...]], *, prompt_width: int,
                 decode: Callable[[list[int]], str]) -> None:
        self._stops = stops
        self._width = prompt_width
        self._decode = decode
        self._tail = max((len(s) for row in stops for s in row), default=0)
        self._tail += self.TAIL_SLACK_TOKENS

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor,
                 **kwargs: Any) -> torch.Tensor:
        start = max(self._width, input_ids.shape[1] - self._tail)
        tails = input_ids[:, start:].tolist()
        done = [bool(stops) and any(s in self._decode(tail) for s in stops)
                for stops, tail in zip(self._stops, tails, strict=True)]
        return torch.tensor(done, dtype=torch.bool, device=input_ids.device)


def choice_seed(seed: int, choice: int) -> int:
    """The generator seed of choice `choice` of a request seeded with `seed`."""
    digest = hashlib.sha256(f"{seed}:{choice}".encode()).digest()
    return int.from_bytes(digest[:8], "little") >> 1


class RowSampler:
    """A logits processor: each row's own sampling and token limit, as a one-hot choice."""

    def __init__(self, samplings: list[Sampling], choices: list[int], *, prompt_width: int,
                 eos_id: int, device: str) -> None:
        self._width = prompt_width
        self._eos = eos_id
        self._limits = torch.tensor([s.max_tokens for s in samplings], device=device)
        sampled = [i for i, s in enumerate(samplings) if s.temperature > 0]
        self._sampled = torch.tensor(sampled, dtype=torch.long, device=device)
        self._temps = torch.tensor([[samplings[i].temperature] for i in sampled],
                                   device=device)
        self._top_p = torch.tensor([[samplings[i].top_p] for i in sampled], device=device)
        self._nucleus = any(samplings[i].top_p < 1.0 for i in sampled)
        self._generators: list[torch.Generator | None] = []
        for i in sampled:
            seed = samplings[i].seed
            gen = None
            if seed is not None:
                gen = torch.Generator(device=device).manual_seed(choice_seed(seed, choices[i]))
            self._generators.append(gen)

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        if len(self._sampled):
            scores = self._sample(scores)
        over = (self._limits <= input_ids.shape[1] - self._width).nonzero().flatten()
        if len(over):
            scores[over] = NEG_INF
            scores[over, self._eos] = 0.0
        return scores

    def _sample(self, scores: torch.Tensor) -> torch.Tensor:
        probs = torch.softmax(scores[self._sampled].float() / self._temps, dim=-1)
        if self._nucleus:  # keep the most likely tokens until their mass reaches top_p
            sorted_p, order = probs.sort(dim=-1, descending=True)
            sorted_p = sorted_p.masked_fill(sorted_p.cumsum(-1) - sorted_p > self._top_p, 0.0)
            probs = torch.zeros_like(probs).scatter_(-1, order, sorted_p)
        picked = torch.empty(len(self._sampled), dtype=torch.long, device=probs.device)
        free = [k for k, g in enumerate(self._generators) if g is None]
        if free:
            picked[free] = torch.multinomial(probs[free], 1).flatten()
        for k, gen in enumerate(self._generators):
            if gen is not None:
                picked[k] = torch.multinomial(probs[k], 1, generator=gen)[0]
        scores[self._sampled] = NEG_INF
        scores[self._sampled, picked] = 0.0
        return scores
