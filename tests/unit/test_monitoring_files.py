"""The monitoring files (config/prometheus, config/grafana, docs/runbooks): every alert has a
runbook, the dashboard and the rules query only series that platform/e31/core/metrics.py exports,
and promtool accepts the rules, the scrape configuration and the rules' unit tests."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml

from e31.core import metrics

ROOT = Path(__file__).parents[2]
PROMETHEUS = ROOT / "config" / "prometheus"
GRAFANA = ROOT / "config" / "grafana"
DASHBOARD = GRAFANA / "dashboards" / "e31.json"
RUNBOOKS = ROOT / "docs" / "runbooks"
OPERATIONS = ROOT / "docs" / "operations.md"
ALERT_TESTS = ROOT / "tests" / "monitoring" / "alerts_test.yml"

# The alerts the pool must have, one per condition an operator is paged for.
REQUIRED_ALERTS = {
    "E31JobsWaitingWhileGpusIdle",   # jobs waiting while GPUs of their class idle
    "E31ClassWithoutWorkers",        # a class with no worker
    "E31LeaseExpiriesRising",        # lease expiries rising
    "E31SchedulerNotTicking",        # the scheduler not ticking
    "E31StoreErrors",                # store errors
    "E31BrokerErrors",               # broker errors
    "E31GpuIdleUnderJob",            # a GPU hung at 0 % under a job
    "E31GpuXidError",                # an XID error
    "E31ArtifactStoreFilling",       # the artifact store filling up
    "E31JobsFailedByPool",           # a job failed for the pool's own faults
}
# Series the histograms of a gaugehistogram expose besides its name.
HISTOGRAM_SUFFIXES = ("_bucket", "_gcount", "_gsum")
SELECTOR = re.compile(r"\b(e31_\w+)\s*(?:\{([^}]*)\})?")
MATCHER = re.compile(r"(\w+)\s*(?:=~|!~|!=|=)")
PROMTOOL_MISSING = ("promtool not on PATH: install Debian's `prometheus` package "
                    "(apt-get install prometheus), as .ci/run does")


def rules() -> list[dict[str, Any]]:
    groups = yaml.safe_load((PROMETHEUS / "alerts.yml").read_text())["groups"]
    return [rule for group in groups for rule in group["rules"]]


def alerts() -> list[dict[str, Any]]:
    return [rule for rule in rules() if "alert" in rule]


def panels(dashboard: dict[str, Any]) -> Iterator[dict[str, Any]]:
    for panel in dashboard["panels"]:
        yield panel
        yield from panel.get("panels", [])


def dashboard_exprs() -> list[str]:
    dashboard = json.loads(DASHBOARD.read_text())
    return [t["expr"] for p in panels(dashboard) for t in p.get("targets", [])]


def exported() -> dict[str, metrics.Metric]:
    """Every sample name /metrics may carry, with the metric it belongs to."""
    out: dict[str, metrics.Metric] = {}
    for value in vars(metrics).values():
        if isinstance(value, metrics.Metric):
            out[value.name] = value
            if value.kind == "gaugehistogram":
                out.update({value.name + s: value for s in HISTOGRAM_SUFFIXES})
    return out


def test_the_rules_have_every_alert_the_pool_needs() -> None:
    names = [rule["alert"] for rule in alerts()]
    assert REQUIRED_ALERTS <= set(names), REQUIRED_ALERTS - set(names)
    assert len(names) == len(set(names)), "an alert name is used twice"


@pytest.mark.parametrize("rule", alerts(), ids=lambda r: r["alert"])
def test_every_alert_links_a_runbook_that_says_how_to_confirm_it_and_what_to_do(
        rule: dict[str, Any]) -> None:
    name = rule["alert"]
    assert rule["labels"]["severity"] in {"warning", "critical"}
    assert rule["annotations"]["summary"] and rule["annotations"]["description"]
    assert rule["annotations"]["runbook_url"] == f"docs/runbooks/{name}.md"
    runbook = RUNBOOKS / f"{name}.md"
    assert runbook.is_file(), f"{name}: no runbook {runbook.relative_to(ROOT)}"
    text = runbook.read_text()
    assert name in text.splitlines()[0], f"{runbook.name}: its title names another alert"
    for heading in ("## What it means", "## Confirm it", "## What to do"):
        assert heading in text, f"{runbook.name}: no {heading!r}"
    confirm = text.split("## Confirm it", 1)[1].split("\n## ", 1)[0]
    assert re.search(r"^e31 \w+", confirm, re.M), f"{runbook.name}: no e31 command to confirm"


def test_every_runbook_of_an_alert_belongs_to_an_alert() -> None:
    names = {rule["alert"] for rule in alerts()}
    orphans = {p.stem for p in RUNBOOKS.glob("E31*.md")} - names
    assert not orphans, f"runbooks of no alert: {sorted(orphans)}"


def test_operations_lists_every_alert_with_its_runbook() -> None:
    text = OPERATIONS.read_text()
    for rule in alerts():
        name = rule["alert"]
        assert f"[{name}](runbooks/{name}.md)" in text, f"docs/operations.md: no link to {name}"


@pytest.mark.parametrize(("where", "exprs"), [
    ("config/prometheus/alerts.yml", [rule["expr"] for rule in rules()]),
    ("config/grafana/dashboards/e31.json", dashboard_exprs()),
])
def test_the_rules_and_the_dashboard_query_only_series_and_labels_that_are_exported(
        where: str, exprs: list[str]) -> None:
    known = exported()
    assert exprs
    for expr in exprs:
        for name, matchers in SELECTOR.findall(expr):
            assert name in known, f"{where}: {name} is not in platform/e31/core/metrics.py"
            labels = set(MATCHER.findall(matchers))
            unknown = labels - set(known[name].labels)
            assert not unknown, f"{where}: {name} has no label {sorted(unknown)}"


def test_the_dashboard_is_provisioned_with_the_provisioned_data_source() -> None:
    # Given the provisioned data source, the dashboard provider and the dashboard
    [source] = yaml.safe_load((GRAFANA / "provisioning/datasources/prometheus.yml")
                              .read_text())["datasources"]
    [provider] = yaml.safe_load((GRAFANA / "provisioning/dashboards/e31.yml")
                                .read_text())["providers"]
    dashboard = json.loads(DASHBOARD.read_text())

    # Then every panel and query uses that data source, by its uid
    assert provider["type"] == "file" and source["type"] == "prometheus"
    everything = list(panels(dashboard))
    for panel in everything:
        if panel["type"] != "row":
            assert panel["datasource"]["uid"] == source["uid"], panel["title"]
            assert all(t["datasource"]["uid"] == source["uid"] for t in panel["targets"])
    # And the panels have unique ids and fit Grafana's 24-column grid
    ids = [p["id"] for p in everything]
    assert len(ids) == len(set(ids))
    assert all(p["gridPos"]["x"] + p["gridPos"]["w"] <= 24 for p in everything)
    # And it shows what an operator asks first
    titles = " | ".join(p["title"] for p in everything).lower()
    for topic in ("utilisation", "queued", "wait", "reason", "gpu", "scheduler"):
        assert topic in titles, topic


# -- promtool (Debian's prometheus package) -------------------------------------------------

def promtool(*args: str) -> subprocess.CompletedProcess[str]:
    tool = shutil.which("promtool")
    if tool is None:
        pytest.skip(PROMTOOL_MISSING)
    return subprocess.run([tool, *args], capture_output=True, text=True, timeout=120)


def test_promtool_accepts_the_alert_rules() -> None:
    result = promtool("check", "rules", str(PROMETHEUS / "alerts.yml"))
    assert result.returncode == 0, result.stdout + result.stderr


def test_promtool_accepts_the_scrape_configuration(tmp_path: Path) -> None:
    # The file as compose mounts it: its syntax (the token file exists only in the container)
    result = promtool("check", "config", "--syntax-only", str(PROMETHEUS / "prometheus.yml"))
    assert result.returncode == 0, result.stdout + result.stderr

    # And in full, rule files included, with the token where this machine has one
    token = tmp_path / "metrics_token"
    token.write_text("t0ken\n")
    config = (PROMETHEUS / "prometheus.yml").read_text()
    assert "/run/secrets/metrics_token" in config
    (tmp_path / "prometheus.yml").write_text(config.replace("/run/secrets/metrics_token",
                                                            str(token)))
    shutil.copy(PROMETHEUS / "alerts.yml", tmp_path / "alerts.yml")
    result = promtool("check", "config", str(tmp_path / "prometheus.yml"))
    assert result.returncode == 0, result.stdout + result.stderr


def test_the_alert_rules_pass_their_unit_tests() -> None:
    result = promtool("test", "rules", str(ALERT_TESTS))
    assert result.returncode == 0, result.stdout + result.stderr


def test_promtool_parses_every_dashboard_query(tmp_path: Path) -> None:
    # Given each query of the dashboard as a recording rule, its variables at "all"
    exprs = [e.replace("$class", ".*").replace("$tenant", ".*") for e in dashboard_exprs()]
    records = [{"record": f"dashboard:query_{i}", "expr": e} for i, e in enumerate(exprs)]
    path = tmp_path / "dashboard_rules.yml"
    path.write_text(yaml.safe_dump({"groups": [{"name": "dashboard", "rules": records}]}))

    # Then promtool parses every one
    result = promtool("check", "rules", str(path))
    assert result.returncode == 0, result.stdout + result.stderr
