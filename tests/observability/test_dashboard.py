"""The Grafana dashboard and the Prometheus alert rules (deploy/) against the metric catalogue.

Every PromQL expression may name only metrics ragsite/metrics.py exposes (a histogram through
its ``_bucket``/``_sum``/``_count`` series), or Prometheus' own ``up``; and a web process
really exposes every family the dashboard and the alerts use.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import requests
import yaml

from billing import client_keys
from search.services import collection_create, workspace_create
from tests.search.files import ingest_texts

DEPLOY = Path(__file__).resolve().parents[2] / "deploy"
DASHBOARD = DEPLOY / "grafana" / "ragsite.json"
ALERTS = DEPLOY / "prometheus" / "alerts.yml"

HISTOGRAMS = {
    "ragsite_http_request_duration_seconds",
    "ragsite_search_duration_seconds",
    "ragsite_generation_time_to_first_token_seconds",
    "ragsite_generation_duration_seconds",
}
CATALOGUE = HISTOGRAMS | {
    "ragsite_http_requests_total",
    "ragsite_query_embedding_cache_total",
    "ragsite_documents",
    "ragsite_ingest_documents_total",
    "ragsite_ingest_chunks_total",
    "ragsite_generation_tokens_total",
    "ragsite_generations_total",
    "vllm:spec_decode_num_drafts_total",
    "vllm:spec_decode_num_draft_tokens_total",
    "vllm:spec_decode_num_accepted_tokens_total",
    "vllm:spec_decode_num_accepted_tokens_per_pos_total",
    "ragsite_upstream_keys",
    "ragsite_router_retries_total",
    "ragsite_router_failovers_total",
    "ragsite_canary_percent",
    "ragsite_canary_state",
    "ragsite_canary_rollbacks_total",
    "ragsite_cost_usd",
    "ragsite_client_key_budget_used_ratio",
    "ragsite_celery_queue_length",
    "ragsite_generation_queue_max",
    "ragsite_generation_queue_bound",
    "ragsite_generation_queue_drain_rate",
    "ragsite_celery_workers",
}
PROMETHEUS_OWN = {"up"}

# PromQL words that are not metric names.
FUNCTIONS_AND_KEYWORDS = {
    "sum", "max", "min", "avg", "count", "topk", "bottomk", "by", "without", "on", "ignoring",
    "group_left", "group_right", "and", "or", "unless", "bool", "offset", "rate", "irate",
    "increase", "histogram_quantile", "scalar", "vector", "clamp_min", "clamp_max", "absent",
    "abs", "delta", "deriv", "time", "le",
}  # fmt: skip


def metric_names(expr: str) -> set[str]:
    """The metric names an expression reads: label matchers, grouping clauses, strings,
    ranges, Grafana's variables and numbers removed, what is left are metric names."""
    text = re.sub(r'"(?:[^"\\]|\\.)*"', " ", expr)
    text = re.sub(r"\{[^}]*\}", " ", text)
    text = re.sub(r"\[[^\]]*\]", " ", text)
    text = re.sub(r"\b(?:by|without|on|ignoring|group_left|group_right)\s*\([^)]*\)", " ", text)
    text = re.sub(r"\$\w+", " ", text)
    words = set(re.findall(r"[A-Za-z_:][A-Za-z0-9_:]*", text)) - FUNCTIONS_AND_KEYWORDS
    return {word for word in words if not re.fullmatch(r"\d+(?:\.\d+)?|e\d+", word)}


def family(name: str) -> str:
    """A histogram's series (``_bucket``, ``_sum``, ``_count``) back to its family."""
    for suffix in ("_bucket", "_sum", "_count"):
        if name.endswith(suffix) and name.removesuffix(suffix) in HISTOGRAMS:
            return name.removesuffix(suffix)
    return name


def dashboard_expressions() -> list[str]:
    dashboard = json.loads(DASHBOARD.read_text())
    panels = [panel for panel in dashboard["panels"] if panel["type"] != "row"]
    assert len({panel["id"] for panel in dashboard["panels"]}) == len(dashboard["panels"])
    assert all(panel["targets"] for panel in panels)
    return [target["expr"] for panel in panels for target in panel["targets"]]


def alert_rules() -> list[dict]:
    return [rule for group in yaml.safe_load(ALERTS.read_text())["groups"] for rule in group["rules"]]


def used_families() -> set[str]:
    expressions = dashboard_expressions() + [rule["expr"] for rule in alert_rules()]
    return {family(name) for expr in expressions for name in metric_names(expr)}


def test_metric_names_are_read_from_promql():
    histogram = "rate(ragsite_http_request_duration_seconds_bucket{route!='x', status=~\"5..\"}[5m])"
    assert metric_names(f"histogram_quantile(0.99, sum by (le, route) ({histogram}))") == {
        "ragsite_http_request_duration_seconds_bucket"
    }
    assert metric_names(
        "sum by (model_name) (rate(vllm:spec_decode_num_accepted_tokens_total[$__rate_interval])) / on (model_name) "
        "group_left sum(rate(vllm:spec_decode_num_drafts_total[5m])) > 0.8 * 64"
    ) == {"vllm:spec_decode_num_accepted_tokens_total", "vllm:spec_decode_num_drafts_total"}


def test_dashboard_and_alerts_use_only_catalogued_metrics():
    expressions = dashboard_expressions()
    assert len(expressions) >= 25
    for expr in expressions:
        names = {family(name) for name in metric_names(expr)}
        assert names and names <= CATALOGUE, f"{expr}: {sorted(names - CATALOGUE)}"
    for rule in alert_rules():
        names = {family(name) for name in metric_names(rule["expr"])}
        assert names and names <= CATALOGUE | PROMETHEUS_OWN, f"{rule['alert']}: {sorted(names - CATALOGUE)}"
        assert rule["annotations"]["summary"] and rule["annotations"]["description"], rule["alert"]
        assert rule["labels"]["severity"] in {"critical", "warning", "info"}, rule["alert"]
    # Every family of the catalogue has a panel.
    assert {family(name) for expr in expressions for name in metric_names(expr)} == CATALOGUE


def test_prometheus_scrapes_the_web_tier_with_a_bearer_token_and_loads_the_alerts():
    config = yaml.safe_load((DEPLOY / "prometheus" / "prometheus.yml").read_text())
    (job,) = config["scrape_configs"]
    assert (job["job_name"], job["metrics_path"]) == ("ragsite-web", "/metrics")
    assert job["authorization"]["type"] == "Bearer" and job["authorization"]["credentials_file"]
    assert config["rule_files"] == ["/etc/prometheus/alerts.yml"]
    alerts = {rule["alert"] for rule in alert_rules()}
    assert {r["expr"] for r in alert_rules() if r["alert"] == "RagsiteMetricsDown"} == {'up{job="ragsite-web"} == 0'}
    assert len(alerts) == len(alert_rules())


@pytest.mark.django_db(transaction=True)
def test_a_web_process_exposes_every_family_the_dashboard_uses(start_web, tmp_path):
    workspace = workspace_create(name="Acme", slug="acme")
    collection = collection_create(workspace=workspace, name="Handbook")
    ingest_texts(collection, {"robot.md": "# Atlas-7 robot\n\nThe Atlas-7 robot runs for 10 hours on one charge."})
    _, token = client_keys.client_key_create(workspace, "search", scopes=["search"])
    # A fresh multiprocess folder, as in production: every family is listed (HELP/TYPE) from
    # the first scrape, even those only workers record (none runs here).
    env = {"RAGSITE_ENV": "development", "METRICS_TOKEN": "", "PROMETHEUS_MULTIPROC_DIR": str(tmp_path / "metrics")}
    with start_web(env=env) as base_url:
        search = requests.post(
            f"{base_url}/api/v1/search",
            json={"query": "charging hours"},
            headers={"Authorization": f"Bearer {token}"},
            timeout=120,
        )
        assert search.status_code == 200, search.text
        response = requests.get(f"{base_url}/metrics", timeout=60)
    assert response.status_code == 200, response.text[:500]
    exposed = set(re.findall(r"^# (?:HELP|TYPE) (\S+)", response.text, flags=re.MULTILINE))
    exposed |= {family(name) for name in re.findall(r"^([A-Za-z_:][A-Za-z0-9_:]*)", response.text, re.MULTILINE)}
    assert used_families() - {"up"} <= exposed, sorted(used_families() - {"up"} - exposed)
