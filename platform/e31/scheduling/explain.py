"""Why a job waits and how the queues stand: `e31 status JOB` (its `pending` object) and
`e31 queue`. Pure: the service reads the store and the heartbeats, this shapes the answer.

A queued job's reason, strongest first: a dependency not finished; retry back-off; the broker
(Redis, where the pool's heartbeats live) could not be read (`broker_unreachable`); no
registered node has as many GPUs of its class as it asks for (`no_node`, a job stored with
`allow_pending`: e31.scheduling.placement); no live worker consumes its queue at all
(`no_workers`); published and waiting for its worker to claim
it; a tenant quota below what the job needs (`quota`, which no amount of waiting ends); no
scheduler leads, so nothing is published (`no_scheduler`: the leader's lock is not held); else what
the scheduler last wrote for it (no_capacity, quota, reserved_for); else, for a job beyond the
heads the scheduler reads, `quota` if its tenant is at quota for the class, otherwise
`no_capacity`. Where nothing but a change by a person (a worker started, a quota raised, Redis
back) will start the job, there is no estimated start, and `no_estimate` says why.

No answer names another tenant's job or tenant (docs/security.md, "What one tenant can see of
another"): a reservation held for another tenant's job reads `others`, and so does every other
tenant in the queue view of a tenant that is not an admin.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Callable, Mapping, Sequence
from datetime import UTC, datetime
from typing import Any

from e31.core.records import JobRecord, QueueLoad, QueuePosition, SchedulingView, iso
from e31.core.sizeclasses import SizeClass
from e31.ops.heartbeat import WorkerInfo, gpu_ids
from e31.scheduling import placement
from e31.scheduling.fairshare import Pending, Reason, Tenant, estimated_start_s, position_in_queue

PUBLISHED = "published"     # not a policy reason: the job's message waits for a worker
NO_WORKERS = "no_workers"   # read live from the heartbeats: no worker consumes the job's queue
BROKER_DOWN = "broker_unreachable"   # the heartbeats could not be read: nothing is published
NO_NODE = "no_node"         # no registered node has the GPUs it asks for (allow_pending)
NO_SCHEDULER = "no_scheduler"   # read live from Redis: no scheduler holds the leader's lock
OTHERS = "others"           # how a non-admin sees every tenant but its own
FOREIGN_RESERVATION = "GPUs reserved for another tenant's waiting multi-GPU job"


def pending(job: JobRecord, pos: QueuePosition, load: QueueLoad, tenants: Mapping[str, Tenant], *,
            now: datetime, half_life_s: float, owns: Callable[[str], bool],
            workers: Sequence[WorkerInfo] | None,
            nodes: placement.Shapes | None = None,
            scheduler: bool | None = None) -> dict[str, Any]:
    """The `pending` object of a queued job's status, as its tenant may read it: `owns` says
    whether a job id is that tenant's; `workers` are the live heartbeats, None when they could
    not be read (the broker is down), which is not the same as none; `nodes` the registered
    node shapes (`placement.shapes`), None when not known; `scheduler` whether a scheduler
    leads (False: none does, so nothing is published; None: not known)."""
    place: int | None = None
    start: datetime | None = None
    no_estimate: str | None = None
    quota = tenants.get(pos.tenant_id, Tenant(pos.tenant_id)).quotas.get(job.size_class)
    if pos.first_dependency is not None:
        reason, detail = Reason.DEPENDENCY.value, pos.first_dependency
        text = Pending(Reason.DEPENDENCY, detail).text()
        no_estimate = "it starts once its dependency has succeeded"
    elif job.not_before is not None and job.not_before > now:
        reason, detail = Reason.BACKOFF.value, job.not_before.isoformat()
        text, start = Pending(Reason.BACKOFF, detail).text(), job.not_before
    elif tenants.get(pos.tenant_id, Tenant(pos.tenant_id)).disabled:
        reason, detail = Reason.TENANT_DISABLED.value, ""
        text = Pending(Reason.TENANT_DISABLED, detail).text()
        no_estimate = "the tenant is disabled; it starts only after an admin enables it"
    elif workers is None:
        reason, detail = BROKER_DOWN, job.queue
        text = "the broker (Redis) is unreachable: nothing is published until it is back"
        no_estimate = "the broker is unreachable"
    elif (impossible := placement.missing(job.size_class, job.gpus, nodes or {})) is not None:
        reason, detail, text = NO_NODE, f"{job.gpus} × {job.size_class}", impossible
        no_estimate = (f"no registered node has {job.gpus} {job.size_class} GPUs; it starts "
                       "only once such a node joins the pool")
    elif not any(job.queue in w.queues for w in workers):
        reason, detail = NO_WORKERS, job.queue
        text = f"no worker serves {job.queue}: {_no_worker_of(job)}"
        no_estimate = "no worker of its class is running; one must be started"
    elif pos.published:
        reason, detail, place = PUBLISHED, job.queue, 0
        text = f"published to {job.queue}; waiting for a worker to claim it"
        no_estimate = "published; a worker claims it within seconds"
    elif quota is not None and quota < job.gpus:
        reason, detail = Reason.QUOTA.value, job.size_class
        text = (f"tenant quota for {job.size_class} is {quota} GPUs and the job needs "
                f"{job.gpus}: it starts only after an admin raises the quota")
        no_estimate = f"the tenant's {job.size_class} quota ({quota} GPUs) is below what it needs"
    elif scheduler is False:
        reason, detail = NO_SCHEDULER, job.queue
        text = ("no scheduler is running: nothing is published until one is "
                "(`e31 up` runs one; on a pool, `e31 scheduler`)")
        no_estimate = "no scheduler is running; one must be started"
    else:
        if pos.stored_reason in {r.value for r in Reason}:
            p = Pending(Reason(pos.stored_reason), pos.stored_detail or "", job.gpus)
        elif not tenants.get(pos.tenant_id, Tenant(pos.tenant_id)).fits_quota(job.size_class,
                                                                               job.gpus):
            p = Pending(Reason.QUOTA, job.size_class, job.gpus)
        else:
            p = Pending(Reason.NO_CAPACITY, job.size_class, job.gpus)
        reason, detail, text = as_seen_by_owner(p, owns)
        place = position_in_queue(tenant=pos.tenant_id, priority=job.priority,
                                  older_own=pos.older_own, backlog=load.backlog,
                                  tenants=tenants, half_life_s=half_life_s)
        per_min = load.starts_recent * 60.0 / load.window_s
        at_s = estimated_start_s(now.timestamp(), place, per_min)
        start = datetime.fromtimestamp(at_s, UTC) if at_s is not None else None
        no_estimate = None if start else "no recent starts in its queue"
    return {"reason": reason, "detail": detail, "text": text, "position": place,
            "estimated_start": iso(start), "no_estimate": None if start else no_estimate}


def _no_worker_of(job: JobRecord) -> str:
    if job.gpus > 1:
        return f"no worker with {job.gpus} {job.size_class} GPUs is running"
    return f"no {job.size_class} worker is running"


def as_seen_by_owner(p: Pending, owns: Callable[[str], bool]) -> tuple[str, str, str]:
    """(reason, detail, text) of `p` for the tenant of the job that waits: a reservation held
    for another tenant's job says so without naming it."""
    if p.reason is Reason.RESERVED_FOR and not owns(p.detail):
        return p.reason.value, OTHERS, FOREIGN_RESERVATION
    return p.reason.value, p.detail, p.text()


def queue_overview(*, classes: Sequence[SizeClass], workers: Sequence[WorkerInfo] | None,
                   view: SchedulingView, tenants: Mapping[str, Tenant],
                   queued: Mapping[tuple[str, str], int],
                   running: Mapping[str, Mapping[str, int]], viewer: str | None) -> dict[str, Any]:
    """Per size class: GPUs and busy GPUs (heartbeats), queued jobs and slots running per
    tenant (`running`: tenant id -> class -> slots held, `running_gpus(..., slots=True)`: a
    GPU class's GPUs, a CPU class's jobs, one slot each) with each one's share of the class's
    running slots against its share of weight; `running_gpus` is the GPUs alone (0 on a CPU
    class). `viewer` (a tenant id) sees other tenants as one `others` row; None every name.
    `workers` None: the heartbeats could not be read; `broker` says so ("unreachable", else
    "ok"), and the GPU counts (0 then) mean unknown, not none."""
    broker = "ok" if workers is not None else "unreachable"
    workers = workers or []
    names = {t.id: t.name for t in view.tenants}
    busy = {r.node for r in view.running if r.lease_live and r.node}
    # a gang worker counts the GPU it watches, busy while a job holds it (on any worker)
    held = {g for r in view.running if r.lease_live and r.node
            for g in gpu_ids(r.node, r.held_gpus)}

    def is_busy(w: WorkerInfo) -> bool:
        if w.gang:
            return bool(w.gpu_ids & held)
        return w.busy_job is not None or w.node in busy

    def who(tenant_id: str) -> str:
        return names.get(tenant_id, tenant_id) if viewer in (None, tenant_id) else OTHERS

    out = []
    for c in classes:
        mine = [w for w in workers if w.own_class == c.name]
        gpus = sum(w.gpu_count or (0 if c.gpu_mem_gb else 1) for w in mine)
        busy_gpus = sum(w.gpu_count or (0 if c.gpu_mem_gb else 1) for w in mine if is_busy(w))
        rows = _tenant_rows(c, queued=queued, running=running)
        if not rows and not mine:
            continue
        total_w = sum(tenants[t].weight if t in tenants else 1.0 for t in rows) or 1.0
        total_run = sum(r["running"] for r in rows.values()) or 1
        merged: dict[str, dict[str, Any]] = {}
        for tenant_id, r in rows.items():
            m = merged.setdefault(who(tenant_id), {"tenant": who(tenant_id), "queued": 0,
                                                   "running": 0, "running_gpus": 0,
                                                   "weight": 0.0, "quota": None})
            m["queued"] += int(r["queued"])
            m["running"] += int(r["running"])
            m["running_gpus"] += int(r["running_gpus"])
            m["weight"] += tenants[tenant_id].weight if tenant_id in tenants else 1.0
            if who(tenant_id) != OTHERS and tenant_id in tenants:
                m["quota"] = tenants[tenant_id].quotas.get(c.name)
        for m in merged.values():
            m["weight_share"] = round(m["weight"] / total_w, 3)
            m["used_share"] = round(m["running"] / total_run, 3)
        out.append({"size_class": c.name, "gpus": gpus, "busy_gpus": busy_gpus,
                    # what `gpus` counts: GPUs, or a CPU class's workers (one slot each)
                    "slot_kind": "gpu" if c.gpu_mem_gb else "cpu",
                    "workers": len(mine), "queued": sum(m["queued"] for m in merged.values()),
                    # how its workers run jobs (docs/security.md); "unknown": an older worker
                    "isolation": sorted({w.isolation or "unknown" for w in mine}),
                    # its jobs' network (job_network; a process worker's jobs share its own)
                    "network": sorted({w.network or "unknown" for w in mine}),
                    "tenants": sorted(merged.values(), key=lambda m: m["tenant"])})
    return {"classes": out, "tenants": _standing(tenants, who, set(queued_tenants(queued))),
            "broker": broker}


def _tenant_rows(c: SizeClass, *, queued: Mapping[tuple[str, str], int],
                 running: Mapping[str, Mapping[str, int]]) -> dict[str, dict[str, float]]:
    """Tenant id -> its queued jobs, running slots and running GPUs in class `c` (its slots
    are its GPUs, or none on a CPU class), for each tenant with any."""
    rows: dict[str, dict[str, float]] = defaultdict(
        lambda: {"queued": 0, "running": 0, "running_gpus": 0, "weight": 0.0})
    for (cls, tenant_id), n in queued.items():
        if cls == c.name:
            rows[tenant_id]["queued"] += n
    for tenant_id, held in running.items():
        if held.get(c.name):
            rows[tenant_id]["running"] += held[c.name]
            rows[tenant_id]["running_gpus"] += held[c.name] if c.gpu_mem_gb else 0
    return rows


def queued_tenants(queued: Mapping[tuple[str, str], int]) -> list[str]:
    return sorted({t for (_cls, t), n in queued.items() if n})


def _standing(tenants: Mapping[str, Tenant], who: Any, active: set[str]) -> list[dict[str, Any]]:
    """Each tenant with work or usage: decayed GPU-seconds' share against weight's share."""
    shown = [t for t in tenants.values()
             if t.name in active or t.usage_gpu_s > 0 or t.running_total() > 0]
    total_u = sum(t.usage_gpu_s for t in shown) or 1.0
    total_w = sum(t.weight for t in shown) or 1.0
    merged: dict[str, dict[str, Any]] = {}
    for t in shown:
        m = merged.setdefault(who(t.name), {"tenant": who(t.name), "weight": 0.0,
                                            "usage_gpu_s": 0.0, "running_gpus": 0})
        m["weight"] += t.weight
        m["usage_gpu_s"] += t.usage_gpu_s
        m["running_gpus"] += t.running_total()
    for m in merged.values():
        m["usage_share"] = round(m["usage_gpu_s"] / total_u, 3)
        m["weight_share"] = round(m["weight"] / total_w, 3)
        m["usage_gpu_s"] = round(m["usage_gpu_s"], 1)
    return sorted(merged.values(), key=lambda m: m["tenant"])
