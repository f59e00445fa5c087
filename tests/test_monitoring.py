"""deploy/: the Grafana dashboard read through Grafana's own schema (grafana-foundation-sdk, generated from the
schema Grafana 11.6 loads), its queries parsed as PromQL (promql-parser), and the Prometheus and Grafana
provisioning checked against the compose monitoring profile that mounts them. That every metric the dashboard
queries is on a live /metrics is checked against `pagedserve up` in tests/test_dashboard.py."""
from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
import promql_parser
import pytest
import yaml
from grafana_foundation_sdk.cog.encoder import JSONEncoder
from grafana_foundation_sdk.cog.plugins import register_default_plugins
from grafana_foundation_sdk.models.dashboard import Dashboard
from test_compose import load, resolved

from gateway.dashboard import _buckets, histogram_quantile
from gateway.metrics import FAST_BUCKETS, Metrics

ROOT = Path(__file__).resolve().parent.parent
DEPLOY = ROOT / "deploy"
DASHBOARD = DEPLOY / "grafana" / "dashboards" / "pagedserve.json"
# Grafana's interpolation of the variables the dashboard uses, before the query reaches Prometheus.
GRAFANA_VARIABLES = {"$__rate_interval": "1m", "$worker": ".*"}


def dashboard() -> dict:
    return json.loads(DASHBOARD.read_text())


def panels() -> list[dict]:
    return [p for p in dashboard()["panels"] if p["type"] != "row"]


def lost_fields(ours, back, path: str = "") -> list[str]:
    """Where `back` (the schema's reading of `ours`) lacks or changed something of `ours`."""
    if isinstance(ours, dict):
        if not isinstance(back, dict):
            return [f"{path} is not an object in the schema"]
        return [lost for key, value in ours.items()
                for lost in (lost_fields(value, back[key], f"{path}.{key}") if key in back else [f"{path}.{key}"])]
    if isinstance(ours, list):
        if not isinstance(back, list) or len(back) != len(ours):
            return [f"{path} is not the same list in the schema"]
        return [lost for i, (a, b) in enumerate(zip(ours, back)) for lost in lost_fields(a, b, f"{path}[{i}]")]
    return [] if ours == back else [f"{path}: {ours!r} became {back!r}"]


def metric_names(expr) -> set[str]:
    if isinstance(expr, promql_parser.VectorSelector):
        return {expr.name}
    if isinstance(expr, promql_parser.MatrixSelector):
        return metric_names(expr.vector_selector)
    if isinstance(expr, promql_parser.BinaryExpr):
        return metric_names(expr.lhs) | metric_names(expr.rhs)
    if isinstance(expr, promql_parser.Call):
        return set().union(*(metric_names(a) for a in expr.args))
    if isinstance(expr, (promql_parser.AggregateExpr, promql_parser.ParenExpr, promql_parser.UnaryExpr,
                         promql_parser.SubqueryExpr)):
        return metric_names(expr.expr)
    return set()


def queried_metrics() -> set[str]:
    """Every metric (as a sample name: `_total`, `_bucket`, `_count` included) the dashboard's queries read."""
    names = set()
    for panel in panels():
        for target in panel["targets"]:
            expr = target["expr"]
            for variable, value in GRAFANA_VARIABLES.items():
                expr = expr.replace(variable, value)
            names |= metric_names(promql_parser.parse(expr))
    return names


def test_the_dashboard_loads_in_grafanas_schema_without_losing_a_field():
    register_default_plugins()
    data = dashboard()
    back = json.loads(json.dumps(Dashboard.from_json(data), cls=JSONEncoder))
    assert lost_fields(data, back) == []
    # The reader drops what the schema does not know, so the comparison catches it: a misspelt field fails.
    data["panels"][1]["gridpos"] = data["panels"][1].pop("gridPos")
    assert lost_fields(data, json.loads(json.dumps(Dashboard.from_json(data), cls=JSONEncoder))) == [".panels[1].gridpos"]


def test_the_panels_tile_grafanas_24_column_grid_with_unique_ids():
    cells: dict[tuple[int, int], int] = {}
    ids = [p["id"] for p in dashboard()["panels"]]
    assert len(set(ids)) == len(ids)
    for panel in dashboard()["panels"]:
        pos = panel["gridPos"]
        assert pos["x"] >= 0 and pos["w"] > 0 and pos["x"] + pos["w"] <= 24 and pos["h"] > 0
        for x in range(pos["x"], pos["x"] + pos["w"]):
            for y in range(pos["y"], pos["y"] + pos["h"]):
                assert (x, y) not in cells, f"panels {cells.get((x, y))} and {panel['id']} overlap"
                cells[(x, y)] = panel["id"]


def test_every_query_parses_as_promql_reads_pagedserve_metrics_through_the_datasource_variable():
    variables = {v["name"]: v for v in dashboard()["templating"]["list"]}
    assert variables["datasource"]["type"] == "datasource" and variables["datasource"]["query"] == "prometheus"
    for panel in panels():
        assert panel["datasource"] == {"type": "prometheus", "uid": "${datasource}"}
        refs = [t["refId"] for t in panel["targets"]]
        assert len(set(refs)) == len(refs) and all(t["datasource"] == panel["datasource"] for t in panel["targets"])
    names = queried_metrics()
    assert names and all(name.startswith("pagedserve_") for name in names)
    # Grafana's variables are the only things that are not PromQL as written.
    with pytest.raises(ValueError):
        promql_parser.parse("rate(pagedserve_prompt_tokens_total[$__rate_interval])")


def test_prometheus_scrapes_the_gateway_where_compose_runs_it():
    config = yaml.safe_load((DEPLOY / "prometheus" / "prometheus.yml").read_text())
    (job,) = config["scrape_configs"]
    gateway = resolved({"REDIS_PASSWORD": "x"})["services"]["gateway"]
    assert job["metrics_path"] == "/metrics"
    assert job["static_configs"] == [{"targets": [f"gateway:{gateway['environment']['PAGEDSERVE_PORT']}"]}]


def test_the_monitoring_profile_mounts_deploy_where_prometheus_and_grafana_read_it():
    services = load("docker-compose.yml")["services"]
    assert all("profiles" not in services[s] for s in ("redis", "gateway", "scheduler", "gpu_worker"))
    mounts = {}
    for name in ("prometheus", "grafana"):
        spec = services[name]
        assert spec["profiles"] == ["monitoring"] and spec["restart"] == "unless-stopped"
        assert all(port.startswith("127.0.0.1:") for port in spec["ports"])
        for volume in spec["volumes"]:
            source, target = volume.split(":")[:2]
            if source.startswith("./"):
                assert (ROOT / source).exists(), volume
                mounts[target] = ROOT / source
    assert f"--config.file={next(t for t in mounts if t.startswith('/etc/prometheus'))}" in services["prometheus"]["command"]
    provisioning = mounts["/etc/grafana/provisioning"]
    (source,) = yaml.safe_load((provisioning / "datasources" / "prometheus.yml").read_text())["datasources"]
    assert source["type"] == "prometheus" and source["url"] == "http://prometheus:9090" and source["isDefault"]
    (provider,) = yaml.safe_load((provisioning / "dashboards" / "pagedserve.yml").read_text())["providers"]
    assert mounts[provider["options"]["path"]] == DASHBOARD.parent
    home = services["grafana"]["environment"]["GF_DASHBOARDS_DEFAULT_HOME_DASHBOARD_PATH"]
    assert mounts[str(Path(home).parent)] / Path(home).name == DASHBOARD


@pytest.mark.parametrize("q", [0.5, 0.9, 0.99])
def test_the_pages_latency_quantiles_fall_in_the_bucket_of_the_true_quantile(q):
    """The page's TTFT/TPOT quantiles come from the gateway's histograms as Prometheus' histogram_quantile makes
    them: the estimate lies in the bucket that holds the exact quantile of the observations."""
    rng = np.random.default_rng(0)
    ttft = Metrics().ttft
    values = rng.lognormal(np.log(0.08), 0.8, 2000)
    for i, v in enumerate(values):
        ttft.labels(("light", "heavy")[i % 2]).observe(float(v))  # the page sums the tenants' histograms
    bounds = [*FAST_BUCKETS, math.inf]
    cumulative = _buckets(ttft, bounds)
    exact = float(np.quantile(values, q))
    i = next(i for i, b in enumerate(bounds) if exact <= b)
    assert (bounds[i - 1] if i else 0.0) <= histogram_quantile(q, bounds, cumulative) <= bounds[i]
    assert histogram_quantile(q, bounds, [0.0] * len(bounds)) is None
