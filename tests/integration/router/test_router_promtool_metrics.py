"""`promtool check metrics` on every /metrics the data plane serves (real engine and router
processes, after real traffic so the labelled series exist): the only finding allowed is vLLM's
`vllm:` colon names, which vLLM's dashboards need. The operator's /metrics is checked in
tests/e2e/operator/test_operator_chart_observability.py (a real operator needs the control plane)."""
from __future__ import annotations

import procs
import pytest
import yaml
from conftest import router_config
from promql import check_metrics

pytestmark = pytest.mark.timeout(300)

GREEDY_EXTRA = {"ignore_eos": True}


def scrape(url: str) -> str:
    status, body = procs.http_get(url + "/metrics")
    assert status == 200 and isinstance(body, str), (status, body)
    return body


def test_engine_and_router_metrics_pass_promtool(engines, make_router):
    r = make_router(router_config(engines, shadow={"default_threshold": 1.0}))
    c = r.client()
    for intent in ("templates", "codegen", "review"):
        c.completions.create(model="cpp", prompt="int main() {", max_tokens=4, temperature=0,
                             extra_body={**GREEDY_EXTRA, "intent": intent})
    c.chat.completions.create(model="cpp", messages=[{"role": "user", "content": "sort a vector"}], max_tokens=3,
                              stream=True, temperature=0, extra_body=GREEDY_EXTRA).close()
    bodies = {f"engine {n}": scrape(e.url) for n, e in engines.items()} | {"router": scrape(r.url)}
    for where, body in bodies.items():
        assert "_bucket{" in body, f"{where}: no histogram samples yet, the check would be shallow"
        assert check_metrics(body) == [], f"{where}: promtool check metrics findings"
    # The filter accepts exactly the colon names: anything else promtool reports still fails.
    assert "vllm:time_to_first_token_seconds_bucket{" in bodies["engine Algo"]
    bad = bodies["router"] + "# HELP consort_bad_counter x\n# TYPE consort_bad_counter counter\nconsort_bad_counter 1\n"
    assert check_metrics(bad), "promtool should flag a counter without _total"


def test_replica_series_of_a_gone_replica_disappear(engines, make_router):
    """ConsortNoWarmReplicas reads consort_router_replica_ready: a replica that left the lane must
    not keep its last value (ready 1) in /metrics, or the alert could never fire."""
    cfg = router_config(engines)
    r = make_router(cfg)
    old = engines["Algo"].url
    procs.wait_until(lambda: 'consort_router_replica_ready{replica="0",specialist="Algo"} 1.0' in scrape(r.url),
                     20, what="Algo's replica ready in /metrics")
    dead = f"http://127.0.0.1:{procs.free_port()}"
    cfg["specialists"] = [{**s, "replicas": [dead]} if s["name"] == "Algo" else s for s in cfg["specialists"]]
    r.config_path.write_text(yaml.safe_dump(cfg, sort_keys=False))
    procs.wait_until(lambda: 'consort_router_replica_ready{replica="0",specialist="Algo"} 0.0' in scrape(r.url), 20,
                     what="the new (dead) replica in /metrics")
    body = scrape(r.url)
    # replicas are labelled by their index in the lane: /metrics names no engine address
    assert old not in body and dead not in body and "127.0.0.1" not in body
