"""Per-row generation control for the transformers backend: one logits processor that gives
each row of a batch its own sampling, token limit and stop strings.

`model.generate` samples a whole batch with one temperature, one top_p and the global random
generator, and stops it at one `max_new_tokens`. A batch file mixes requests, so
`RowSampler` runs under greedy decoding and decides each row's next token itself: a sampled
row draws from its own softmax (temperature, then top_p) with its own `torch.Generator` when
the request has a seed (its draws then do not depend on its neighbours'), and its choice
becomes the only finite score, which greedy decoding takes; a greedy row keeps its scores.
A row that has had its `max_tokens`, or whose text ends in one of its stop strings, is given
the end-of-turn token, which ends it in `generate` (the caller tells the two apart by where
the end of turn is, and cuts the text before the stop string).
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Sequence

import torch

from e31_worker.workloads.llm_requests import Sampling

NEG_INF = float("-inf")
TAIL_SLACK_TOKENS = 4   # a stop string is looked for in the last len(stop) + this many tokens:
                        # each token writes a character or more, some write none or a part


class RowSampler:
    """A logits processor: each row's own sampling, token limit and stop strings."""

    def __init__(self, samplings: list[Sampling], choices: list[int], *, prompt_width: int,
                 eos_id: int, device: str, decode: Callable[[list[int]], str]) -> None:
        self._width = prompt_width
        self._eos = eos_id
        self._decode = decode
        self._limits = torch.tensor([s.max_tokens for s in samplings], device=device)
        self._stops = {i: s.stop for i, s in enumerate(samplings) if s.stop}
        self._tail = max((len(x) for stops in self._stops.values() for x in stops), default=0)
        self._tail += TAIL_SLACK_TOKENS
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
        ending = self._limits <= input_ids.shape[1] - self._width
        for i in self._stopped(input_ids):
            ending[i] = True
        rows = ending.nonzero().flatten()
        if len(rows):
            scores[rows] = NEG_INF
            scores[rows, self._eos] = 0.0
        return scores

    def _stopped(self, input_ids: torch.Tensor) -> list[int]:
        """The rows whose text now ends in one of their stop strings (each once)."""
        start = max(self._width, input_ids.shape[1] - self._tail)
        if not self._stops or start >= input_ids.shape[1]:
            return []
        rows = list(self._stops)
        tails = input_ids[rows, start:].tolist()
        found = [i for i, tail in zip(rows, tails, strict=True)
                 if any(x in self._decode(tail) for x in self._stops[i])]
        for i in found:
            del self._stops[i]  # it ends here; generate pads it from now on
        return found

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


def choice_seed(seed: int, choice: int) -> int:
    """The generator seed of choice `choice` of a request seeded with `seed`."""
    digest = hashlib.sha256(f"{seed}:{choice}".encode()).digest()
    return int.from_bytes(digest[:8], "little") >> 1


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
