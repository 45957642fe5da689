"""The shipping stage: an attempt's log, checkpoints and outputs, copied to the artifact store.

Its setup restores the checkpoints of the job's earlier attempts; while the child runs, each
beat of the lease starts a background copy of what changed (`Shipper.poke`); once it ended,
the record stores its files and then its outcome (`e31_worker.attempt.record`).
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Callable
from typing import Any

from e31.core.errors import SetupTransient
from e31.core.records import Claim
from e31.edge.localwalk import Refused, refusal, scan_tree
from e31.edge.logview import log_name
from e31_worker.attempt.plan import AttemptPlan
from e31_worker.attempt.services import AttemptServices
from e31_worker.attempt.stages import Attempt, Stage
from e31_worker.attempt.transient import is_transient

log = logging.getLogger(__name__)

UPLOAD_TRIES = 3            # outputs and checkpoints: an upload is retried this often
UPLOAD_BACKOFF_S = 1.0      # doubled after each failed try
NOTE_LINES_MAX = 100        # the worker's notes (refused files) added to one attempt's log
NOTE_LINE_MAX_CHARS = 512   # one note; a longer one (a deep path) is cut


class ShippingStage(Stage):
    """The shipping stage's setup: the checkpoints of the job's earlier attempts, restored
    into the attempt's `checkpoints` directory (and so needing no upload)."""

    def setup(self, attempt: Attempt) -> None:
        svc, claim, plan = attempt.svc, attempt.claim, attempt.plan
        try:
            restored = svc.artifacts.get_tree(claim.tenant_id, claim.job_id, "checkpoints",
                                              plan.checkpoint_dir)
        except Exception as exc:   # the artifact store's (the pool's), of any backend
            if not is_transient(exc):
                raise   # the worker's error (`worker_crashed`)
            raise SetupTransient(f"checkpoints cannot be restored for now: {exc}") from exc
        if restored:
            log.info("checkpoint_restored job=%s attempt=%d files=%d", claim.job_id,
                     claim.attempt, restored)
        attempt.shipper.mark_checkpoints()  # what came down needs no upload


class Shipper:
    """Copies the attempt's log, and its checkpoints when they changed, to the artifact store.

    Heartbeats start a copy in the background, one at a time (a thread that survives any
    failure: `_ship_all`), so a slow store never delays the lease renewal; a checkpoint
    saved mid-run is therefore safe before the attempt ends (a SIGKILLed worker's job
    resumes from it). Only a tick that still holds the lease
    starts a copy: a fenced-off attempt must not overwrite its successor's files.
    """

    def __init__(self, svc: AttemptServices, claim: Claim, plan: AttemptPlan) -> None:
        self._svc, self._claim, self._plan = svc, claim, plan
        self._log_bytes = -1
        self._checkpoints: dict[str, tuple[int, int]] = {}
        self._thread: threading.Thread | None = None
        self._refusals_noted = False

    def poke(self) -> None:
        """Start a background copy of what changed, unless one is still running."""
        if self._thread is not None and self._thread.is_alive():
            return
        self._thread = threading.Thread(target=self._ship_all, name=f"ship-{self._claim.job_id}",
                                        daemon=True)
        self._thread.start()

    def finish(self) -> None:
        """Wait for a copy in flight (the final copies follow it)."""
        if self._thread is not None:
            self._thread.join()

    def mark_checkpoints(self) -> None:
        """What is in the checkpoint directory now needs no upload (it came down from the store)."""
        self._checkpoints = self._fingerprints()

    def has_files_to_store(self) -> bool:
        """Whether the attempt left an output, or a checkpoint that changed since its last
        upload: what `store_files` would copy. An attempt without any (most tiny jobs) needs no
        lease check before its outcome, and no store call for its files."""
        return bool(scan_tree(self._plan.output_dir).files) or \
            self._fingerprints() != self._checkpoints

    def store_files(self, tries: int = UPLOAD_TRIES) -> tuple[list[dict[str, Any]], str | None]:
        """Upload checkpoints (what changed) and outputs, each tried `tries` times; returns
        (outputs, what failed or None). Outputs beyond the job's or the tenant's quota are not
        stored, and the attempt's log says which and why; the job's outcome stays what it was.
        Without any output, neither the store's listing nor the tenant's total is read."""
        claim, plan = self._claim, self._plan
        if not self._refusals_noted:      # a store_files tried again notes them once
            self.note_refused()
            self._refusals_noted = True
        outputs: list[dict[str, Any]] = []
        failed: list[str] = []
        try:
            charged = self.admit_outputs()
        except Exception as exc:  # noqa: BLE001 - the store or any fsspec backend's error
            error = f"{type(exc).__name__}: {exc}"
            log.warning("outputs_quota_unknown job=%s: %s", claim.job_id, error)
            return [], f"its outputs could not be stored: {error}"
        steps: list[tuple[str, Callable[[], list[dict[str, Any]] | None]]] = [
            ("checkpoints", self.ship_checkpoints)]
        if charged:
            steps.append(("outputs", lambda: self._svc.artifacts.put_tree(
                plan.output_dir, claim.tenant_id, claim.job_id, "outputs")))
        for what, upload in steps:
            delay = UPLOAD_BACKOFF_S
            for attempt in range(1, tries + 1):
                try:
                    files = upload()
                except Exception as exc:  # noqa: BLE001 - any fsspec backend's error
                    error = f"{type(exc).__name__}: {exc}"
                    log.warning("upload_failed job=%s what=%s try=%d: %s", claim.job_id, what,
                                attempt, error)
                    if attempt == tries:
                        failed.append(f"its {what} could not be stored: {error}")
                        if what == "outputs":     # give the tenant back what was not stored
                            self._settle_charge(charged, [])
                    else:
                        time.sleep(delay)
                        delay *= 2
                    continue
                if files is not None:
                    outputs = files
                    self._settle_charge(charged, outputs)
                break
        return outputs, "; ".join(failed) or None

    def admit_outputs(self) -> dict[str, tuple[int, int]]:
        """Decide which outputs fit the job's quota (`job_outputs_max_bytes`, counting what
        earlier attempts stored) and then the tenant's (its running total, charged here in
        one store transaction); remove the others from the attempt's directory, so they are
        not uploaded, and say so in its log. Returns (size, bytes charged) per admitted path (a
        file replacing a stored one of the same path is charged the difference)."""
        svc, claim, plan = self._svc, self._claim, self._plan
        files = scan_tree(plan.output_dir).files
        if not files:
            return {}
        stored = {o["path"]: int(o["size"]) for o in
                  svc.artifacts.list_outputs(claim.tenant_id, claim.job_id)}
        job_max = svc.settings.job_outputs_max_bytes
        job_bytes = sum(stored.values())
        refused: list[Refused] = []
        wanted: list[tuple[str, int, int]] = []        # (path, size, delta)
        for rel, st in files.items():
            delta = st.st_size - stored.get(rel, 0)
            if delta > 0 and job_bytes + delta > job_max:
                refused.append(Refused(rel, f"{st.st_size} bytes: over the job's outputs quota "
                                            f"(job_outputs_max_bytes={job_max})"))
                continue
            job_bytes += delta
            wanted.append((rel, st.st_size, delta))
        charge = svc.repo.charge_outputs(claim.tenant_id, [d for _, _, d in wanted],
                                         default_max_bytes=svc.artifacts.outputs_cap_bytes(
                                             svc.settings.tenant_outputs_max_bytes))
        charged: dict[str, tuple[int, int]] = {}
        for (rel, size, delta), ok in zip(wanted, charge.accepted, strict=True):
            if ok:
                charged[rel] = (size, delta)
            else:
                refused.append(Refused(rel, f"{size} bytes: over the tenant's outputs quota "
                                            f"({charge.max_bytes} bytes, {charge.used_bytes} "
                                            f"in use)"))
        for item in refused:
            (plan.output_dir / item.path).unlink(missing_ok=True)  # never a link's target
        if refused:
            log.warning("outputs_refused job=%s attempt=%d files=%d: over quota", claim.job_id,
                        claim.attempt, len(refused))
            self._append_to_log([f"output refused: {item}\n" for item in refused])
        return charged

    def _settle_charge(self, charged: dict[str, tuple[int, int]],
                       stored: list[dict[str, Any]]) -> None:
        """Bring the tenant's total to what was stored: give back the charge of an admitted
        file that was not stored (replaced by a link since), and add what a file grew by
        since it was admitted. A failed correction is only logged."""
        sizes = {o["path"]: int(o["size"]) for o in stored}
        deltas = [sizes[rel] - size if rel in sizes else -delta
                  for rel, (size, delta) in charged.items()]
        if not any(deltas):
            return
        try:
            self._svc.repo.charge_outputs(self._claim.tenant_id, deltas, default_max_bytes=0,
                                          force=True)
        except Exception as exc:  # noqa: BLE001 - the store's error: the total stays off
            log.warning("outputs_charge_unsettled job=%s: %s", self._claim.job_id, exc)

    def _ship_all(self) -> None:
        """The background copy's thread (one per `poke`). It survives anything: a failure is
        logged and the next beat's copy tries again (the attempt's end copies everything,
        retried), so an upload thread never dies with an exception unsaid."""
        try:
            self.ship_log()
        except Exception:  # ship_log logs its store's errors itself: this is unexpected
            log.exception("ship_error job=%s what=log: the next beat tries again",
                          self._claim.job_id)
        try:
            self.ship_checkpoints()
        except Exception as exc:  # noqa: BLE001 - the next beat tries again; the end retries too
            log.warning("checkpoint_upload_failed job=%s: %s", self._claim.job_id, exc)

    def ship_checkpoints(self) -> None:
        """Upload the checkpoint files that changed since the last upload, in name order (a job
        may rely on that order), each atomically; raises when one cannot be stored."""
        current = self._fingerprints()
        changed = sorted(rel for rel, mark in current.items() if self._checkpoints.get(rel) != mark)
        for rel in changed:
            self._svc.artifacts.put_file(self._plan.checkpoint_dir / rel, self._claim.tenant_id,
                                         self._claim.job_id, f"checkpoints/{rel}",
                                         base=self._plan.checkpoint_dir)
            self._checkpoints[rel] = current[rel]
        if changed:
            log.info("checkpoint_stored job=%s attempt=%d files=%d", self._claim.job_id,
                     self._claim.attempt, len(changed))

    def _fingerprints(self) -> dict[str, tuple[int, int]]:
        """Each checkpoint file's (mtime, size); hidden names (a save in progress) are skipped."""
        root = self._plan.checkpoint_dir
        marks: dict[str, tuple[int, int]] = {}
        for path in root.rglob("*"):
            rel = path.relative_to(root)
            if any(part.startswith(".") for part in rel.parts):
                continue
            try:
                st = path.lstat()  # a link is never followed, nor uploaded
                if refusal(st) is None:
                    marks[rel.as_posix()] = (st.st_mtime_ns, st.st_size)
            except OSError:  # replaced while we looked: the next beat looks again
                continue
        return marks

    def note_refused(self) -> None:
        """Say in the attempt's log which outputs and checkpoints are not stored, and why: a
        link, a hard link, a FIFO (docs/security.md)."""
        plan = self._plan
        scanned = (("output", plan.output_dir), ("checkpoint", plan.checkpoint_dir))
        self._append_to_log([f"{what} refused: {refused}\n"
                             for what, where in scanned for refused in scan_tree(where).refused])

    def _append_to_log(self, lines: list[str]) -> None:
        """Add the worker's notes to the attempt's log, at most NOTE_LINES_MAX lines of at most
        NOTE_LINE_MAX_CHARS each (then a count of the rest), so that a job cannot grow its log
        past its cap through them (a million links, a path of 4 KiB)."""
        if not lines:
            return
        kept = [line if len(line) <= NOTE_LINE_MAX_CHARS
                else line[:NOTE_LINE_MAX_CHARS - 6] + " [cut]\n"
                for line in lines[:NOTE_LINES_MAX]]
        if len(lines) > NOTE_LINES_MAX:
            kept.append(f"[e31: and {len(lines) - NOTE_LINES_MAX} more refused]\n")
        flags = os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC
        try:
            with os.fdopen(os.open(self._plan.log_path, flags, 0o644), "a") as out:
                out.write("".join(kept))
        except OSError as exc:  # the log itself was replaced by a link: the worker's log says it
            log.warning("refusals_not_logged job=%s: %s; %s", self._claim.job_id, exc, kept)

    def ship_log(self) -> None:
        """Copy the log if it grew since the last copy; a failed copy is only logged."""
        try:
            size = self._plan.log_path.stat().st_size
        except OSError:
            return
        if size == self._log_bytes:
            return
        try:
            self._svc.artifacts.put_file(self._plan.log_path, self._claim.tenant_id,
                                         self._claim.job_id, log_name(self._claim.attempt))
            self._log_bytes = size
        except Exception as exc:  # noqa: BLE001 - a log copy is never worth failing the job for
            log.warning("log_upload_failed job=%s: %s", self._claim.job_id, exc)


def earlier_log_bytes(svc: AttemptServices, claim: Claim) -> int:
    """What the logs of the job's other attempts hold in the store: the new attempt's log
    gets what is left of `job_log_max_bytes`. A store that cannot say counts as nothing (the
    attempt's own cap still holds). A first attempt has no others: the store is not asked."""
    if claim.attempt <= 1:
        return 0
    try:
        sizes = svc.artifacts.log_sizes(claim.tenant_id, claim.job_id)
    except Exception as exc:  # noqa: BLE001 - any fsspec backend's error
        log.warning("log_sizes_unknown job=%s: %s", claim.job_id, exc)
        return 0
    return sum(size for n, size in sizes.items() if n != claim.attempt)
