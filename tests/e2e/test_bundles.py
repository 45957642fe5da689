"""Jobs that bring their own code and data, through a real `e31 up` stack: the example project
of examples/byo as an entrypoint, as a command and as a spec file, uploaded once; and with its
own environment, built from the project's requirements file (downloads from the package index:
the one test here that builds an environment is the last, job-env.yaml's)."""

from __future__ import annotations

import importlib.util
import json
import shutil
import tomllib
from pathlib import Path

from .conftest import Stack

WAIT_S = 90
BYO = Path(__file__).parents[2] / "examples" / "byo"
# What examples/byo computes: data/words.txt and inputs/extra.txt together.
EXPECTED = {"words": 11, "top": [["pool", 3], ["the", 3], ["job", 2]]}
# What examples/byo/report.py computes: the words of data/words.txt, in order.
REPORT = {"job": 1, "owner": 1, "pool": 1, "runs": 1, "sent": 1, "the": 3}
ENV_WAIT_S = 180     # a build resolves and downloads from the package index


def copy_of_example(tmp_path: Path) -> Path:
    """The example project in a directory of the test's own (no __pycache__ of another run)."""
    project = tmp_path / "byo"
    shutil.copytree(BYO, project, ignore=shutil.ignore_patterns("__pycache__"))
    return project


def test_a_workdir_job_returns_what_its_code_computed_and_a_second_uploads_nothing(
        stack: Stack, tmp_path: Path) -> None:
    # Given the example project: a module, a helper module, a data file, and a local input
    project = copy_of_example(tmp_path)
    client = stack.client()

    # When its entrypoint is submitted with the project as workdir
    job = client.submit(entrypoint="wordcount:main", workdir=str(project), params={"top": 3},
                        inputs={"extra": str(project / "inputs" / "extra.txt")},
                        resources={"gpus": 0})
    first_sent = client.last_bundles
    status = job.wait(timeout=WAIT_S)

    # Then it ran its own code on its own data and input
    assert status["result"] == EXPECTED
    [counts] = job.download(tmp_path / "out")
    assert json.loads(counts.read_text())["pool"] == 3
    assert [(s.field, s.uploaded) for s in first_sent] == [("workdir", True),
                                                           ("inputs.extra", True)]
    code_digest = first_sent[0].digest
    stored = list((stack.home / "artifacts" / "bundles").rglob(f"{code_digest[7:]}.tar"))
    assert len(stored) == 1
    mtime_ns = stored[0].stat().st_mtime_ns

    # When the same tree is submitted again
    again = client.submit(entrypoint="wordcount:main", workdir=str(project), params={"top": 3},
                          inputs={"extra": str(project / "inputs" / "extra.txt")},
                          resources={"gpus": 0})

    # Then nothing was uploaded: the API held both bundles, whose files were not rewritten
    assert [(s.field, s.held, s.uploaded) for s in client.last_bundles] == \
        [("workdir", True, False), ("inputs.extra", True, False)]
    assert client.last_bundles[0].digest == code_digest
    assert stored[0].stat().st_mtime_ns == mtime_ns
    assert again.wait(timeout=WAIT_S)["result"] == EXPECTED


def test_a_command_job_runs_a_script_of_its_bundle(stack: Stack, tmp_path: Path) -> None:
    project = copy_of_example(tmp_path)
    done = stack.e31("submit", "--workdir", str(project), "--gpus", "0", "--wait", "--json",
                     "--", "python", "train.py", "--epochs", "3", timeout_s=WAIT_S + 30)
    assert done.returncode == 0, done.stderr
    status = json.loads(done.stdout)
    assert status["state"] == "succeeded"
    assert "workdir: sha256:" in done.stderr
    log = stack.client().get(status["id"]).logs()
    assert "epoch 3/3: 8 words seen" in log
    assert '{"epochs": 3, "top": [["the", 3]]}' in log


def test_a_spec_file_names_its_workdir_and_inputs_relative_to_itself(stack: Stack,
                                                                     tmp_path: Path) -> None:
    project = copy_of_example(tmp_path)
    dry = stack.e31("submit", str(project / "job.yaml"), "--dry-run", "--json")
    assert dry.returncode == 0, dry.stderr
    answer = json.loads(dry.stdout)
    assert answer["dry_run"] is True and answer["queue"] == "e31.cpu"
    assert answer["code"].startswith("sha256:")

    done = stack.e31("submit", str(project / "job.yaml"), "--wait", "--json",
                     timeout_s=WAIT_S + 30)
    assert done.returncode == 0, done.stderr
    status = json.loads(done.stdout)
    assert status["result"] == EXPECTED
    # job.yaml asks for no environment of its own, though its directory has a requirements file
    assert "e31: environment " not in stack.client().get(status["id"]).logs()


def test_a_file_url_input_is_read_by_the_worker(stack: Stack, tmp_path: Path) -> None:
    # Given a file beneath the stack's input_file_roots (the tests' temporary directory)
    project = copy_of_example(tmp_path)
    shared = tmp_path / "shared.txt"
    shared.write_text("pool pool job")
    job = stack.client().submit(entrypoint="wordcount:main", workdir=str(project),
                                inputs={"extra": f"file://{shared}"}, resources={"gpus": 0})
    assert job.wait(timeout=WAIT_S)["result"] == EXPECTED


def test_bad_inputs_are_refused_at_submit_with_exit_2(stack: Stack, tmp_path: Path) -> None:
    project = copy_of_example(tmp_path)
    before = {j["id"] for j in stack.client().list(limit=1000)}
    for flag, why in [(f"extra: {tmp_path / 'missing.txt'}", "no such file"),
                      ("extra: gopher://host/x", "unknown scheme")]:
        spec = tmp_path / "bad.yaml"
        spec.write_text(f"entrypoint: wordcount:main\nworkdir: {project}\n"
                        f"resources: {{gpus: 0}}\ninputs:\n  {flag}\n")
        done = stack.e31("submit", str(spec))
        assert done.returncode == 2, done.stderr
        assert "inputs.extra" in done.stderr and why in done.stderr
    assert {j["id"] for j in stack.client().list(limit=1000)} == before


def test_a_spec_file_with_a_requirements_file_runs_in_the_environment_it_asks_for(
        stack: Stack, tmp_path: Path) -> None:
    # Last in this file: it uploads the same tree as the first test, which expects to upload it.
    # Given the example project, whose report.py needs a package the workers' environment lacks
    assert importlib.util.find_spec("tomli_w") is None
    project = copy_of_example(tmp_path)

    # When its job-env.yaml is submitted as a user would
    done = stack.e31("submit", str(project / "job-env.yaml"), "--wait", "--json",
                     timeout_s=ENV_WAIT_S + 30)

    # Then it ran in an environment built from requirements.txt and computed with the package
    assert done.returncode == 0, done.stderr
    status = json.loads(done.stdout)
    assert (status["state"], status["result"]) == ("succeeded", REPORT)
    job = stack.client().get(status["id"])
    assert any(line.startswith("e31: environment ") for line in job.logs().splitlines())
    assert status["attempts"][0]["setup_s"] > 0

    # And the TOML it wrote was stored as its output
    assert [o["path"] for o in status["outputs"]] == ["counts.toml"]
    [toml] = job.download(tmp_path / "out")
    assert toml.name == "counts.toml"
    assert tomllib.loads(toml.read_text()) == {"counts": REPORT}
