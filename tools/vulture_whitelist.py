"""Names vulture cannot see used, because only a framework or a library uses them.

vulture reads this file (it is on `paths` in pyproject's [tool.vulture]) and counts every name
below as used; nothing imports or runs it. Decorated entry points (FastAPI routes, typer
commands, the Celery task, pydantic validators, SQLAlchemy listeners) are exempted by their
decorators in pyproject instead, so a new route needs no line here. Anything vulture reports
that is not a framework's or a library's entry point is dead code: remove it, do not list it.
docs/development.md says how to run the gate.
"""

# Python: a module-level __getattr__ serves lazy attributes (`from e31 import Client`).
__getattr__

# pydantic: the model class reads its configuration from this attribute.
_.model_config

# SQLAlchemy: TypeDecorator and compiled-construct hooks the engine calls.
_.impl
_.cache_ok
_.process_bind_param
_.process_result_value
_.inherit_cache
# SQLAlchemy: mapped columns only the database schema (and the migrations) use.
_.created_at
# sqlite3: the driver reads the connection's isolation_level that db.py sets.
_.isolation_level

# Alembic: the revision graph and the steps of each migration file.
down_revision
branch_labels
depends_on
upgrade
downgrade

# Job entrypoints, named by "module:function" strings in specs, docs and workloads.
hello  # e31_worker.examples
flaky
matmul
resumable
digits_mlp  # e31_worker.workloads.models
digits_cnn
frame_classifier

# PyAV: stream attributes the encoder and decoder read.
_.pix_fmt
_.thread_type
_.thread_count

# signal.signal calls a handler with (signum, frame), used or not.
signum

# tarfile: the header fields of a bundle's members, which the archive writes.
_.mtime
_.gid
_.uname
_.gname

# A heartbeat's GPU reading (e31.ops.heartbeat.GpuSample): written whole as JSON, and read by
# name by the metrics (e31.ops.pool.gpu_readings) and `e31 top`.
_.mem_total_bytes
_.temperature_c
_.power_w
_.last_xid

# A scratch PostgreSQL database per test session: called by tests/conftest.py and
# bench/scheduler_cost.py, which vulture does not read.
scratch_database

# The API's listener for job ends (e31.api.waits.JobEnds), kept on the app's state so that
# whoever runs the app in-process (the tests) can stop its thread.
_.job_ends

# httpcore: the network backend's interface (e31_worker.attempt.http_inputs.CheckedBackend),
# and the connection pool httpx's transport keeps and sends each request through.
_.connect_unix_socket
_._pool

# Tornado: a request handler's hook it calls before a POST (e31.edge.flowerauth.Unauthorized).
_.check_xsrf_cookie

# A batch's timestamps, read and written by name (e31.core.batches.STAMPED): the batch object
# (e31.api.routes.batches.batch_object) reads each with getattr, BatchEnds sets each as a
# column of its status through BatchStore.move_batch(**{f"{status}_at": now}).
_.in_progress_at
_.completed_at
_.failed_at
_.expired_at
_.cancelled_at

# @e31.function's public surface (e31.functions.decorator.Function): what users call and read,
# `f.remote.aio`, `f.starmap`, `f.using(client)`, `f.last_sent`, `f.last_array`.
_.aio
_.remote
_.starmap
_.using
_.last_sent
_.last_array
