"""The demo's batch of prompts (`e31 demo`, `demo-prompts`): twelve chat requests to the
built-in `e31-tiny-chat`, submitted as an OpenAI-style batch through `Client().batches`, so a
newcomer sees the Batch API path run next to the other workloads. Skipped, saying why, on a
stack without the built-in models (the `.[llm]` extra missing).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from e31.client import Client
from e31.client.batches import BatchHandle
from e31.core.batches import FINAL
from e31.core.errors import ClientError

MODEL = "e31-tiny-chat"
PROMPTS = ("What is a GPU?", "Name a colour.", "Count to three.", "Say hello in French.",
           "What is batch inference?", "Describe a cat.", "What is 2 + 2?",
           "Write a haiku about queues.", "Why checkpoint a job?", "What is fair share?",
           "Give a word that rhymes with pool.", "Say goodbye.")
MAX_TOKENS = 16


class DemoPrompts:
    """The demo's batch, followed like its jobs."""

    def __init__(self, client: Client) -> None:
        self._client = client
        self.handle: BatchHandle | None = None
        self.skipped = ""

    def submit(self) -> None:
        models = {m["id"] for m in self._client.batches.models()}
        if MODEL not in models:
            self.skipped = f"skipped: no {MODEL} (pip install -e '.[llm]', then e31 up)"
            return
        rows = [{"custom_id": f"prompt-{i}", "max_tokens": MAX_TOKENS, "temperature": 0,
                 "messages": [{"role": "user", "content": text}]}
                for i, text in enumerate(PROMPTS)]
        self.handle = self._client.batches.submit(rows, model=MODEL, completion_window="1h")

    @property
    def done(self) -> bool:
        return self.handle is None or self.handle.status in FINAL

    def poll(self) -> tuple[int, int, str]:
        """(requests done, total, status) as of now."""
        if self.handle is None:
            return 0, 0, self.skipped
        if not self.done:
            self.handle.refresh()
        counts = self.handle.info.get("request_counts") or {}
        done = int(counts.get("completed", 0)) + int(counts.get("failed", 0))
        return done, int(counts.get("total", 0)), self.handle.status

    def cancel(self) -> None:
        if self.handle is not None and not self.done:
            try:
                self.handle.cancel()
            except ClientError:
                pass

    def status(self, out_dir: Path) -> dict[str, Any]:
        """The step as the demo's summary shows a job: its state, its shard's class and
        times, its result, and the files downloaded into `out_dir`."""
        if self.handle is None:
            return {"state": "skipped", "summary": self.skipped}
        info = self.handle.info
        counts = info.get("request_counts") or {}
        usage = info.get("usage") or {}
        shard = self._shard_status()
        state = "succeeded" if info["status"] == "completed" and not counts.get("failed") \
            else info["status"]
        result = {"requests": counts.get("total"), "completed": counts.get("completed"),
                  "failed": counts.get("failed"), "tokens_in": usage.get("input_tokens"),
                  "tokens_out": usage.get("output_tokens")}
        paths = self.handle.download(out_dir) if info["status"] in FINAL else []
        return {"id": self.handle.id, "state": state, "size_class": shard.get("size_class"),
                "queued_seconds": shard.get("queued_seconds"),
                "run_seconds": shard.get("run_seconds"),
                "gpu_seconds": shard.get("gpu_seconds"), "result": result,
                "outputs": str(out_dir) if paths else None,
                "summary": f"{counts.get('completed')}/{counts.get('total')} answered, "
                           f"{usage.get('input_tokens')} tokens in, "
                           f"{usage.get('output_tokens')} out"}

    def _shard_status(self) -> dict[str, Any]:
        array_id = ((self.handle.info if self.handle else {}).get("e31") or {}).get("array_id")
        if not array_id:
            return {}
        jobs = self._client.get_array(array_id).jobs()
        return jobs[0].status() if jobs else {}
