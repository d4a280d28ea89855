"""The Grafana dashboard: a valid dashboard model, and PromQL that parses and reads the server's metrics."""

from __future__ import annotations

import re

import promql_parser
import pytest

from helpers.deploy_checks import load_dashboard

# Grafana's core panel types (built into every Grafana since 8); a typo would show an empty "unknown panel".
CORE_PANEL_TYPES = {"row", "timeseries", "stat", "gauge", "bargauge", "table", "heatmap", "histogram", "text",
                    "piechart", "barchart", "state-timeline", "status-history", "logs", "nodeGraph"}
# Variables Grafana defines itself, and what a query sees in their place.
GRAFANA_MACROS = {"__rate_interval": "1m", "__interval": "1m", "__range": "1h"}
# The speculative-decoding metrics, with vLLM's names (the spec-decode feature adds them to the server).
SPEC_DECODE_METRICS = {"vllm:spec_decode_num_drafts_total", "vllm:spec_decode_num_draft_tokens_total",
                       "vllm:spec_decode_num_accepted_tokens_total"}


def panels(dashboard: dict) -> list[dict]:
    out = []
    for panel in dashboard["panels"]:
        out.append(panel)
        out.extend(panel.get("panels", []))  # collapsed rows hold their panels
    return out


def expressions(dashboard: dict) -> list[tuple[str, str]]:
    """(panel title, PromQL) for every query target."""
    return [(p["title"], t["expr"]) for p in panels(dashboard) for t in p.get("targets", []) if "expr" in t]


def substitute_variables(expr: str, variables: dict[str, str]) -> str:
    def value(match: re.Match) -> str:
        name = match.group(1) or match.group(2)
        assert name in variables, f"undefined variable ${name} in {expr}"
        return variables[name]

    return re.sub(r"\$\{(\w+)(?::\w+)?\}|\$(\w+)", value, expr)


def metric_names(expr: str, variables: dict[str, str]) -> set[str]:
    names: set[str] = set()

    def visit(node) -> bool:
        if isinstance(node, promql_parser.VectorSelector):
            names.add(node.name)
        return True

    promql_parser.walk(promql_parser.parse(substitute_variables(expr, variables)), visit)
    return names


def query_variables(dashboard: dict) -> dict[str, str]:
    """Each templating variable with a value that makes a valid query (a regex for multi-value ones)."""
    out = dict(GRAFANA_MACROS)
    for var in dashboard["templating"]["list"]:
        out[var["name"]] = ".*" if var.get("multi") or var.get("includeAll") else "x"
    return out


def dashboard_metric_names(dashboard: dict) -> dict[str, set[str]]:
    """Metric name -> titles of the panels that query it."""
    variables = query_variables(dashboard)
    out: dict[str, set[str]] = {}
    for title, expr in expressions(dashboard):
        for name in metric_names(expr, variables):
            out.setdefault(name, set()).add(title)
    return out


def test_dashboard_model():
    dashboard = load_dashboard()
    for field in ("uid", "title", "panels", "schemaVersion", "templating", "time", "annotations"):
        assert field in dashboard, field
    assert isinstance(dashboard["schemaVersion"], int) and dashboard["schemaVersion"] >= 36
    assert re.fullmatch(r"[A-Za-z0-9_-]{1,40}", dashboard["uid"])
    all_panels = panels(dashboard)
    ids = [p["id"] for p in all_panels]
    assert len(ids) == len(set(ids)), "panel ids must be unique"
    occupied: set[tuple[int, int]] = set()
    for p in all_panels:
        assert p["type"] in CORE_PANEL_TYPES, p["type"]
        g = p["gridPos"]
        assert all(isinstance(g[k], int) for k in "hwxy") and g["w"] >= 1 and g["h"] >= 1
        assert 0 <= g["x"] and g["x"] + g["w"] <= 24, p["title"]  # Grafana's grid is 24 columns wide
        cells = {(x, y) for x in range(g["x"], g["x"] + g["w"]) for y in range(g["y"], g["y"] + g["h"])}
        assert not cells & occupied, f"{p['title']} overlaps another panel"
        occupied |= cells
        if p["type"] != "row":
            assert p["targets"] and p["datasource"]["uid"] == "${datasource}"
            ref_ids = [t["refId"] for t in p["targets"]]
            assert len(ref_ids) == len(set(ref_ids)), p["title"]
    datasource_var = next(v for v in dashboard["templating"]["list"] if v["name"] == "datasource")
    assert (datasource_var["type"], datasource_var["query"]) == ("datasource", "prometheus")


def test_grafana_foundation_sdk_loads_it():
    # Grafana's own typed model of a dashboard (generated from its schemas) reads the JSON back intact.
    from grafana_foundation_sdk.cog import plugins, runtime
    from grafana_foundation_sdk.models.dashboard import Dashboard, RowPanel
    from grafana_foundation_sdk.models.prometheus import Dataquery as PrometheusQuery

    plugins.register_default_plugins()  # panel configs and data source query types, as Grafana has them
    dashboard = load_dashboard()
    model = Dashboard.from_json(dashboard)
    assert model.uid == dashboard["uid"] and model.schema_version == dashboard["schemaVersion"]
    # Rows stay rows and panels stay panels; every panel type has a registered panel config.
    model_panels = model.panels or []
    assert len(model_panels) == len(dashboard["panels"])
    for raw, parsed in zip(dashboard["panels"], model_panels, strict=True):
        if raw["type"] == "row":
            assert isinstance(parsed, RowPanel)
        else:
            assert parsed.type_val == raw["type"] and runtime.panelcfg_config(raw["type"]) is not None
            assert all(isinstance(t, PrometheusQuery) for t in parsed.targets)
            assert [t.expr for t in parsed.targets] == [t["expr"] for t in raw["targets"]]
    assert model.to_json()["panels"]


def test_every_expression_parses():
    dashboard = load_dashboard()
    variables = query_variables(dashboard)
    exprs = expressions(dashboard)
    assert len(exprs) >= 20
    for title, expr in exprs:
        try:
            promql_parser.parse(substitute_variables(expr, variables))
        except Exception as e:  # the parser raises ValueError and friends
            pytest.fail(f"{title}: {expr}: {e}")
    with pytest.raises(ValueError):
        promql_parser.parse("sum(rate(vllm:prompt_tokens_total[5m])")


def test_dashboard_covers_what_operators_need():
    names = dashboard_metric_names(load_dashboard())
    for needed in ("vllm:request_success_total", "vllm:time_to_first_token_seconds_bucket",
                   "vllm:inter_token_latency_seconds_bucket", "vllm:e2e_request_latency_seconds_bucket",
                   "vllm:prompt_tokens_total", "vllm:generation_tokens_total", "vllm:num_requests_running",
                   "vllm:num_requests_waiting", "vllm:kv_cache_usage_perc", "vllm:prefix_cache_hits_total",
                   "vllm:prefix_cache_queries_total", "vllm:num_preemptions_total"):
        assert needed in names, needed


def test_spec_decode_panels_use_vllms_names():
    names = dashboard_metric_names(load_dashboard())
    spec = {n for n in names if "spec_decode" in n}
    assert spec == SPEC_DECODE_METRICS
