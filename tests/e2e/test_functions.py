"""`@e31.function` on a real `e31 up` stack, driven as users drive it: a script whose
`__main__` defines the functions, with a helper module beside it, run as its own process;
and a notebook executed headless with nbclient (docs/notebooks.md)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from tests.docblocks import doc, output_matches, python_shown_output, run_command
from tests.e2e.conftest import Stack

HELPER = """
import numpy

def square(x):
    return int(numpy.int64(x) * x)
"""

MAP_SCRIPT = """
import json, time
import e31
from helper import square

# retries: on this shared test machine about 1 attempt in 500 is killed at its start by a
# fault of the pool's (docs/performance.md, "A map of tiny Python calls"), which the worker
# still records as the job's error; a retry keeps the test about the map, not that fault.
@e31.function(timeout_s=120, retries={"max": 2, "backoff_s": 1})
def score(x):
    return square(x) + 1

if __name__ == "__main__":
    values = list(score.map(range(1000)))
    out = {"values": values, "array": score.last_array.id,
           "size": len(score.last_array.job_ids),
           "sent": [[s.field, s.uploaded] for s in score.last_sent]}
    out["again"] = sorted(score.map(range(3), order="completed"))
    out["sent_again"] = [[s.field, s.uploaded] for s in score.last_sent]
    print(json.dumps(out))
"""

VALUES_SCRIPT = """
import dataclasses, json
import numpy
import e31
from helper import square

@dataclasses.dataclass
class Scored:
    x: int
    y: int

@e31.function()
def scored(x):
    return Scored(x, square(x))

@e31.function()
def table(n):
    return numpy.arange(n, dtype=numpy.float32).reshape(2, -1)

@e31.function()
def lookup(i, table):
    return float(table[i])

@e31.function()
def picky(x):
    if x == 2:
        raise ValueError(f"item {x} is bad")
    return x

if __name__ == "__main__":
    out = {}
    s = scored.remote(7)
    out["scored"] = [type(s).__name__, s.x, s.y, isinstance(s, Scored)]
    t = table.remote(6)
    out["table"] = [type(t).__module__, t.shape, t.dtype.name, t.tolist()]
    out["submitted"] = scored.submit(3).wait()["state"]
    table = numpy.arange(1_000_000, dtype=numpy.float64)     # 8 MB, shared by every item
    out["lookup"] = list(lookup.map([5, 999_999, 7], kwargs={"table": table}))
    out["lookup_sent"] = [[s.field, s.size_bytes] for s in lookup.last_sent if s.uploaded]
    try:
        picky.remote(2)
    except ValueError as exc:
        out["remote_raised"] = [str(exc), "\\n".join(exc.__notes__)]
    got = list(picky.map(range(4), return_exceptions=True))
    out["with_exceptions"] = [repr(v) for v in got]
    try:
        list(picky.map(range(4)))
    except ValueError as exc:
        out["map_raised"] = [str(exc), "\\n".join(exc.__notes__)]
    print(json.dumps(out))
"""

RETRY_SCRIPT = """
import json, os, sys
import e31

MARK = sys.argv[1]

@e31.function()
def wait_for_mark(x):
    if x == 3 and not os.path.exists(MARK):
        raise RuntimeError("the mark is missing")
    return x * 10

if __name__ == "__main__":
    try:
        list(wait_for_mark.map(range(5)))
    except RuntimeError as exc:
        print(json.dumps({"array": wait_for_mark.last_array.id, "notes": exc.__notes__}))
"""


VERSIONS_SCRIPT = """
import json
import idna, numpy
import e31
import fakepkg
from e31.core.errors import FunctionError

@e31.function()
def uses_fake(x):
    return fakepkg.VALUE + x

@e31.function()
def uses_idna(x):
    return idna.encode(x).decode()

@e31.function()
def doubles(x):
    return int(numpy.int64(x) * 2)

if __name__ == "__main__":
    client = e31.Client()
    newest = [j["id"] for j in client.list(limit=1)]
    out = {"refused": {}}
    calls = {"remote": lambda: uses_fake.remote(1), "submit": lambda: uses_fake.submit(1),
             "map": lambda: list(uses_fake.map(range(3))), "idna": lambda: uses_idna.remote("a")}
    for name, call in calls.items():
        try:
            call()
        except FunctionError as exc:
            out["refused"][name] = str(exc)
    out["stored"] = [j["id"] for j in client.list(limit=1)] != newest
    out["sent"] = len(uses_fake.last_sent) + len(uses_idna.last_sent)
    out["doubled"] = doubles.remote(21)
    answer = client.environments()
    out["numpy_here"] = numpy.__version__
    out["numpy_there"] = [e["packages"].get("numpy") for e in answer["environments"]]
    out["unknown"] = answer["unknown"]
    print(json.dumps(out))
"""


UNPACKAGED_SCRIPT = """
import json, sqlite3, sys
import e31
import bare_e31_mod
from e31.core.errors import FunctionError, JobFailed
from e31.functions import versions

DB = sys.argv[1]

@e31.function()
def uses_bare(x):
    return bare_e31_mod.VALUE + x

def jobs():
    with sqlite3.connect(DB, timeout=30) as db:
        return db.execute("SELECT count(*) FROM jobs").fetchone()[0]

if __name__ == "__main__":
    out = {"jobs_before": jobs()}
    try:
        uses_bare.remote(1)
    except FunctionError as exc:
        out["refused"] = str(exc)
    out["jobs_after"], out["sent"] = jobs(), len(uses_bare.last_sent)
    answer = e31.Client().environments()
    out["listed"] = [isinstance(e.get("modules"), list) for e in answer["environments"]]
    # The same call, checked against the same workers' environments as if they had the module
    with_it = dict(answer, environments=[dict(e, modules=[*e["modules"], "bare_e31_mod"])
                                         for e in answer["environments"]])
    versions._environments = lambda client, resources: with_it
    job = uses_bare.submit(1)
    out["jobs_stored"] = jobs() - out["jobs_after"]
    try:
        job.wait(timeout=120)
    except JobFailed as exc:
        out["worker_error"] = exc.status.get("error") or ""
    print(json.dumps(out))
"""


def _fake_site_packages(root: Path) -> Path:
    """A directory named as an interpreter's own (so the function's check counts what it holds
    as installed): the distribution `fakepkg` 9.9 and its module, which no worker has, and
    metadata saying `idna` is 0.0.1 here (the module stays the real one)."""
    site = root / "site-packages"
    (site / "fakepkg").mkdir(parents=True)
    (site / "fakepkg" / "__init__.py").write_text("VALUE = 100\n")
    for name, version in (("fakepkg", "9.9"), ("idna", "0.0.1")):
        info = site / f"{name}-{version}.dist-info"
        info.mkdir()
        (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {name}\n"
                                       f"Version: {version}\n")
        (info / "top_level.txt").write_text(f"{name}\n")
        (info / "RECORD").write_text("")
    return site


def _run(stack: Stack, directory: Path, script: str, *args: str,
         timeout_s: float = 500, path: Path | None = None) -> dict:
    (directory / "helper.py").write_text(HELPER)
    (directory / "main.py").write_text(textwrap.dedent(script))
    env = stack.env if path is None else dict(
        stack.env, PYTHONPATH=os.pathsep.join([str(path), stack.env.get("PYTHONPATH", "")]))
    proc = subprocess.run([sys.executable, "main.py", *args], cwd=directory, env=env,
                          capture_output=True, text=True, timeout=timeout_s)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return dict(json.loads(proc.stdout.strip().splitlines()[-1]))


@pytest.mark.timeout(600)
def test_a_script_maps_its_function_over_1000_items_as_one_array_with_the_values_in_order(
        stack: Stack, tmp_path: Path) -> None:
    # Given a script whose function uses a helper module beside it
    # When it maps the function over 1,000 items
    out = _run(stack, tmp_path, MAP_SCRIPT)
    # Then the values come in input order, from one array of 1,000 jobs
    assert out["values"] == [x * x + 1 for x in range(1000)]
    assert out["size"] == 1000
    assert stack.client().get_array(out["array"]).status(items=False)["succeeded"] == 1000
    # And what went up is one bundle of code (the helper) and one of the 1,000 calls
    assert sorted(f for f, uploaded in out["sent"] if uploaded) == ["call", "code"]
    # And a second map of the same code uploads only its call (the code bundle is held)
    assert out["again"] == [1, 2, 5]
    assert out["sent_again"] == [["code", False], ["call", True]]


@pytest.mark.timeout(300)
def test_remote_brings_back_a_numpy_array_a_dataclass_and_the_exception_an_item_raised(
        stack: Stack, tmp_path: Path) -> None:
    # Given functions returning a dataclass of the script's and a numpy array, and one that
    # raises for item 2
    out = _run(stack, tmp_path, VALUES_SCRIPT)
    # Then .remote gives the Python values, of the caller's own classes
    assert out["scored"] == ["Scored", 7, 49, True]
    assert out["table"] == ["numpy", [2, 3], "float32", [[0, 1, 2], [3, 4, 5]]]
    assert out["submitted"] == "succeeded"
    # And a large keyword argument shared by a map's items went up once, not per item
    assert out["lookup"] == [5.0, 999_999.0, 7.0]
    [(field, size)] = [s for s in out["lookup_sent"] if s[0] == "call"]
    assert 8_000_000 < size < 9_000_000
    # And the exception is re-raised as itself with the remote traceback as a note
    message, notes = out["remote_raised"]
    assert message == "item 2 is bad"
    assert "remote traceback" in notes and "ValueError: item 2 is bad" in notes
    # And a map yields it with return_exceptions, or raises it at its item, naming the array
    assert out["with_exceptions"][:2] == ["0", "1"] and "ValueError" in out["with_exceptions"][2]
    assert out["with_exceptions"][3] == "3"
    message, notes = out["map_raised"]
    assert message == "item 2 is bad" and "item 2 of array a-" in notes and "--failed" in notes


@pytest.mark.timeout(300)
def test_a_package_no_worker_has_at_the_caller_s_version_is_refused_at_the_call_naming_it(
        stack: Stack, tmp_path: Path) -> None:
    # Given a caller whose path holds fakepkg 9.9, which no worker has, and idna at 0.0.1
    site = _fake_site_packages(tmp_path / "env")
    # When its functions using them are called, submitted and mapped
    out = _run(stack, tmp_path, VERSIONS_SCRIPT, path=site)
    # Then each call is refused naming the package, with the worker's side of it
    refused = out["refused"]
    assert sorted(refused) == ["idna", "map", "remote", "submit"]
    for name in ("remote", "submit", "map"):
        assert "package fakepkg 9.9 on the caller's side, not installed on the worker" \
            in refused[name], refused[name]
    assert "package idna 0.0.1 on the caller's side, " in refused["idna"]
    assert "not installed" not in refused["idna"]
    # And nothing was stored or uploaded
    assert out["stored"] is False and out["sent"] == 0
    # And a function whose packages agree with the workers' (checked, not skipped) runs
    assert out["doubled"] == 42
    assert out["unknown"] == 0 and out["numpy_here"] in out["numpy_there"]


@pytest.mark.timeout(300)
def test_a_module_without_package_metadata_the_workers_lack_is_refused_at_the_call_naming_it(
        stack: Stack, tmp_path: Path) -> None:
    # Given a caller whose site-packages holds a bare module, with no package metadata, that
    # no worker can import
    site = tmp_path / "env" / "site-packages"
    site.mkdir(parents=True)
    (site / "bare_e31_mod.py").write_text("VALUE = 100\n")
    # When its function using it is called
    out = _run(stack, tmp_path, UNPACKAGED_SCRIPT, str(stack.home / "e31.db"), path=site)
    # Then the call is refused naming the module, judged on the workers' listed modules
    assert out["listed"] and all(out["listed"])
    assert "refused" in out, out
    assert ("module bare_e31_mod (installed on the caller's side without package metadata) "
            "is not importable on the worker") in out["refused"]
    assert "class cpu" in out["refused"] and "nothing was stored" in out["refused"]
    # And nothing was stored or uploaded
    assert out["jobs_after"] == out["jobs_before"] and out["sent"] == 0
    # And checked against workers listing the module, the same call is not refused: it is
    # stored, and fails only on the worker, which cannot import it (what the check spares)
    assert out["jobs_stored"] == 1
    assert "bare_e31_mod" in out["worker_error"], out


@pytest.mark.timeout(300)
def test_e31_retry_failed_runs_a_failed_map_item_again_and_its_value_can_be_read(
        stack: Stack, tmp_path: Path, shared_tmp: Path) -> None:
    # Given a map whose item 3 failed
    mark = shared_tmp / "mark"
    out = _run(stack, tmp_path, RETRY_SCRIPT, str(mark))
    array_id = out["array"]
    assert f"e31 retry {array_id} --failed" in "\n".join(out["notes"])
    # When the cause is fixed and `e31 retry a-… --failed` runs the failed items again
    mark.write_text("fixed")
    retried = stack.e31("retry", array_id, "--failed")
    assert retried.returncode == 0, retried.stderr
    array = stack.client().get_array(array_id)
    assert array.wait(timeout=120)["succeeded"] == 5
    # Then every item's value is there, read through the ordinary handles
    assert [job.result() for job in array.jobs()] == [0, 10, 20, 30, 40]


NOTEBOOK_CELLS = [
    "import os\nos.environ['E31_URL'] = {url!r}\nos.environ['E31_TOKEN'] = {token!r}",
    "import e31\nfrom helper import square\n\n"
    "@e31.function(retries={{'max': 2, 'backoff_s': 1}})\ndef f(x):\n"
    "    return square(x) - 1",
    "values = list(f.map(range(100)))\nvalues == [x * x - 1 for x in range(100)]",
    "one = await f.remote.aio(5)\none",
    "got = [v async for v in f.map.aio(range(3))]\ngot",
]


@pytest.mark.timeout(300)
def test_a_notebook_maps_a_cell_s_function_headless(stack: Stack, tmp_path: Path) -> None:
    nbformat = pytest.importorskip("nbformat")
    nbclient = pytest.importorskip("nbclient")
    # Given a notebook beside a helper module, whose cell defines the function
    (tmp_path / "helper.py").write_text(HELPER)
    nb = nbformat.v4.new_notebook()
    nb.cells = [nbformat.v4.new_code_cell(c.format(url=stack.url, token=stack.token))
                for c in NOTEBOOK_CELLS]
    # When it is executed headless
    nbclient.NotebookClient(nb, timeout=240, kernel_name="python3",
                            resources={"metadata": {"path": str(tmp_path)}}).execute()
    # Then the map's values, the awaited call and the async map are the cells' outputs
    outputs = [c.outputs[-1]["data"]["text/plain"] for c in nb.cells[2:]]
    assert outputs == ["True", "24", "[-1, 0, 3]"]


@pytest.mark.timeout(300)
@pytest.mark.parametrize(("page", "step"), [("README.md", "functions"),
                                            ("docs/notebooks.md", "functions-tour"),
                                            ("docs/notebooks.md", "functions-failed")])
def test_the_docs_python_blocks_print_what_they_show(stack: Stack, tmp_path: Path, page: str,
                                                     step: str) -> None:
    # Given a page's block, run as a reader runs it: a script fed to python
    [block] = doc(page).run_blocks(step)
    ran = run_command(f"{sys.executable} - <<'PY'\n{block.text}PY", env=stack.env,
                      cwd=tmp_path, timeout_s=240)
    # Then it prints what the page shows
    assert ran.returncode == 0, f"{block.where}\n{ran.output}"
    shown = python_shown_output(block)
    assert output_matches(shown, ran.output), f"{block.where}: {shown}\n{ran.output}"


def test_what_cannot_travel_is_refused_at_the_call_before_any_job_is_stored(
        stack: Stack) -> None:
    import threading
    import types

    import e31
    from e31.core.errors import FunctionError
    client = stack.client()
    before = len(client.list(limit=1000))
    made = types.ModuleType("made_in_memory")
    made.SCALE = 2   # type: ignore[attr-defined]

    @e31.function(client=client)
    def scale(x: object) -> object:
        return x

    @e31.function(client=client)
    def uses_made(x: int) -> int:
        return int(made.SCALE) * x

    # When an argument does not pickle, or the function needs a module no worker can import
    with pytest.raises(FunctionError, match=r"argument 0 \(_thread\.lock\)"):
        scale.remote(threading.Lock())
    with pytest.raises(FunctionError, match=r"argument 0 \(_thread\.lock\) of item 1"):
        scale.map([1, threading.Lock()])
    sys.modules["made_in_memory"] = made
    try:
        with pytest.raises(FunctionError, match="module 'made_in_memory'"):
            uses_made.remote(3)
    finally:
        sys.modules.pop("made_in_memory", None)
    # Then nothing was stored
    assert len(client.list(limit=1000)) == before
