"""deploy/: manifests parse and have what operators rely on; every metric the alert
rules and the dashboard query is one the worker exports; promtool validates and
unit-tests the rules."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
from pathlib import Path

import msgspec
import pytest
import yaml

from schemas import keys
from worker.config import load_config
from worker.obs.metrics import Metrics

ROOT = Path(__file__).resolve().parents[2]
DEPLOY = ROOT / "deploy"

PROMQL_WORDS = {
    "sum", "max", "min", "avg", "count", "by", "without", "rate", "increase", "irate", "deriv", "delta",
    "histogram_quantile", "and", "or", "unless", "on", "ignoring", "offset", "avg_over_time", "max_over_time",
    "min_over_time", "topk", "bottomk", "abs", "clamp_min", "clamp_max", "absent", "humanize", "vector", "scalar",
    "group_left", "group_right",
}
LABELS = {"le", "priority", "instance", "topic", "partition", "outcome", "finish_reason", "reason", "job", "pod",
          "tenant", "kind", "pool", "to_pool", "adapter", "position", "direction"}


def metric_names_in(expr: str) -> set[str]:
    """Metric names referenced by a PromQL expression (strings, ranges, label matchers,
    grouping labels, functions and numbers removed)."""
    e = re.sub(r'"[^"]*"', " ", expr)
    e = re.sub(r"\[[^\]]*\]", " ", e)
    e = re.sub(r"\{[^}]*\}", " ", e)
    e = e.replace("$__rate_interval", " ")
    words = set(re.findall(r"[A-Za-z_:][A-Za-z0-9_:]*", e))
    return {w for w in words if w not in PROMQL_WORDS and w not in LABELS}


def exported() -> set[str]:
    """Every series the workers and the gateway export."""
    from worker.gateway.metrics import GatewayMetrics

    suffixes = {"counter": ("_total",), "histogram": ("_bucket", "_sum", "_count"), "gauge": ("",)}
    gateway = {f.name + s for f in GatewayMetrics().registry.collect() for s in suffixes.get(f.type, ("",))}
    return Metrics(gpu=True).names() | gateway


def alert_rules() -> list[dict]:
    doc = yaml.safe_load((DEPLOY / "prometheus" / "alerts.yaml").read_text())
    return [r for g in doc["groups"] for r in g["rules"]]


def test_metric_name_extraction():
    assert metric_names_in('histogram_quantile(0.99, sum by (le, priority) (rate(llm_ttft_seconds_bucket{a="b"}[5m]))) > 5') \
        == {"llm_ttft_seconds_bucket"}
    assert metric_names_in("deriv(sum(waiting_requests)[10m:1m]) > 0 and x_total") == {"waiting_requests", "x_total"}


def test_alert_rules_cover_the_required_signals_with_exported_metrics():
    rules = alert_rules()
    used = set()
    for r in rules:
        names = metric_names_in(r["expr"])
        assert names, r["alert"]
        used |= names
        assert r["labels"]["severity"] in ("info", "warning", "critical")
        assert r["annotations"]["summary"]
    assert used <= exported(), used - exported()
    for required in ("kv_cache_usage_ratio", "waiting_requests", "llm_ttft_seconds_bucket", "request_oom_total",
                     "kafka_consumer_lag", "dlq_records_total"):
        assert required in used, required


def test_dashboard_queries_exported_metrics_and_covers_design_metrics():
    from tools.make_dashboard import build

    committed = json.loads((DEPLOY / "grafana" / "dashboards" / "inflight.json").read_text())
    assert committed == build(), "dashboard JSON is stale: run python -m tools.make_dashboard"
    used = set()
    for panel in committed["panels"]:
        for t in panel.get("targets", []):
            used |= metric_names_in(t["expr"])
    assert used <= exported(), used - exported()
    design = {"request_queue_time_seconds_bucket", "llm_ttft_seconds_bucket", "llm_tpot_seconds_bucket",
              "llm_e2e_request_latency_seconds_bucket", "running_requests", "waiting_requests", "gpu_utilization",
              "kv_cache_usage_ratio", "prefill_tokens_per_second", "decode_tokens_per_second", "request_abort_total",
              "request_oom_total", "request_rejected_total", "preemptions_total", "request_finished_total",
              "kafka_consumer_lag", "kafka_paused_partitions", "dlq_records_total", "kafka_commit_failures_total",
              "cancel_to_free_seconds_bucket"}
    assert design <= used, design - used


def promtool() -> str:
    path = shutil.which("promtool")
    if path is None:
        if os.environ.get("CI"):
            pytest.fail("promtool missing in CI: tools/test.sh installs Debian's prometheus package")
        pytest.skip("promtool not installed (apt-get install prometheus)")
    return path


def test_promtool_checks_and_unit_tests_the_rules():
    exe = promtool()
    d = DEPLOY / "prometheus"
    check = subprocess.run([exe, "check", "rules", "alerts.yaml"], cwd=d, capture_output=True, text=True)
    assert check.returncode == 0, check.stdout + check.stderr
    test = subprocess.run([exe, "test", "rules", "alerts.test.yaml"], cwd=d, capture_output=True, text=True)
    assert test.returncode == 0, test.stdout + test.stderr
    cfg = subprocess.run([exe, "check", "config", "--syntax-only", "prometheus.yml"], cwd=d, capture_output=True,
                         text=True)
    assert cfg.returncode == 0, cfg.stdout + cfg.stderr


def test_worker_configs_load(tmp_path):
    cfg = load_config(str(DEPLOY / "config.yaml"), env={})
    assert cfg.metrics.port == 8000 and cfg.serving_tuning.max_total_tokens is None
    cm = yaml.safe_load((DEPLOY / "k8s" / "configmap.yaml").read_text())
    p = tmp_path / "config.yaml"
    p.write_text(cm["data"]["config.yaml"])
    k8s_cfg = load_config(str(p), env={"INFLIGHT_KAFKA__SASL_PASSWORD": "x"})
    assert k8s_cfg.kafka.sasl_password == "x"


def test_compose_has_the_stack():
    doc = yaml.safe_load((DEPLOY / "compose.yaml").read_text())
    s = doc["services"]
    assert s["kafka"]["image"].startswith("apache/kafka:")
    assert "broker,controller" in s["kafka"]["environment"]["KAFKA_PROCESS_ROLES"]
    assert s["redis"]["image"].startswith("redis:")
    cmd = s["redis"]["command"]  # persistence: a restart must not lose claims and logs
    assert cmd[cmd.index("--appendonly") + 1] == "yes" and cmd[cmd.index("--appendfsync") + 1] == "everysec"
    assert any(v.endswith(":/data") for v in s["redis"]["volumes"])
    w = s["worker"]
    assert any(v.endswith(":/models:ro") for v in w["volumes"])
    assert w["deploy"]["resources"]["reservations"]["devices"][0]["capabilities"] == ["gpu"]
    drain = load_config(str(DEPLOY / "config.yaml"), env={}).worker.drain_timeout_s
    assert int(w["stop_grace_period"].rstrip("s")) > drain
    assert s["topics"]["build"]["dockerfile"] == "deploy/Dockerfile"
    assert any("alerts.yaml" in v for v in s["prometheus"]["volumes"])
    assert any("provisioning" in v for v in s["grafana"]["volumes"])
    prom = yaml.safe_load((DEPLOY / "prometheus" / "prometheus.yml").read_text())
    assert prom["scrape_configs"][0]["dns_sd_configs"][0]["port"] == 8000


def test_dockerfile_is_cuda_non_root_with_worker_entrypoint():
    text = (DEPLOY / "Dockerfile").read_text()
    assert re.search(r"^ARG CUDA_IMAGE=nvidia/cuda:\S+-runtime-", text, re.M)
    user = re.findall(r"^USER (\S+)", text, re.M)
    assert user and not user[-1].startswith(("root", "0"))
    assert 'ENTRYPOINT ["inflight", "worker"]' in text
    assert 'VOLUME ["/models"]' in text
    # the image installs the worker extra at requirements.lock's versions
    assert re.search(r"^COPY .*\brequirements\.lock\b", text, re.M)
    assert re.search(r"PIP_CONSTRAINT=/src/requirements\.lock pip install [^\n]*\.\[worker\]", text)


def test_the_worker_on_vllms_engine_is_a_setting_of_compose_and_kubernetes():
    """compose.vllm.yaml and deploy/k8s/vllm select the Dockerfile's `vllm` stage (vLLM in
    its own environment) and `model.engine: vllm`, which the worker's config accepts."""
    stages = re.findall(r"^FROM \S+(?: AS (\S+))?", (DEPLOY / "Dockerfile").read_text(), re.M)
    assert stages[:2] == ["inflight", "vllm"] and stages[-1] == ""  # the default build: Inflight's engine
    worker = yaml.safe_load((DEPLOY / "compose.vllm.yaml").read_text())["services"]["worker"]
    assert worker["build"]["target"] == "vllm" and worker["build"]["dockerfile"] == "deploy/Dockerfile"
    cfg = load_config(str(DEPLOY / "config.yaml"), env=worker["environment"])
    assert cfg.model.engine == "vllm" and cfg.model.vllm_python == "/opt/vllm/bin/python"
    from tests.repo.test_k8s_schemas import build

    (dep,) = [d for d in build(DEPLOY / "k8s" / "vllm") if d["kind"] == "Deployment" and d["metadata"]["name"] == "inflight-worker"]
    pod = dep["spec"]["template"]["spec"]
    for c in pod["initContainers"] + pod["containers"]:
        env = {e["name"]: e.get("value") for e in c["env"]}
        assert c["image"].split(":")[0].endswith("inflight-worker-vllm") and env["INFLIGHT_MODEL__ENGINE"] == "vllm"
        assert "INFLIGHT_REDIS__URL" in env  # merged into the base's list, not replacing it


def k8s(name: str) -> list[dict]:
    return [d for d in yaml.safe_load_all((DEPLOY / "k8s" / name).read_text()) if d]


def test_kubernetes_manifests():
    kinds = {d["kind"] for f in (DEPLOY / "k8s").glob("*.yaml") for d in k8s(f.name)}
    assert {"Deployment", "Service", "PodDisruptionBudget", "ScaledObject", "ConfigMap", "Secret"} <= kinds
    cm = k8s("configmap.yaml")[0]
    cfg = yaml.safe_load(cm["data"]["config.yaml"])
    dep = k8s("deployment.yaml")[0]
    pod = dep["spec"]["template"]["spec"]
    c = pod["containers"][0]
    assert pod["terminationGracePeriodSeconds"] > cfg["worker"]["drain_timeout_s"]
    assert c["resources"]["limits"]["nvidia.com/gpu"] == 1
    assert c["readinessProbe"]["httpGet"]["path"] == "/readyz"
    assert c["livenessProbe"]["httpGet"]["path"] == "/healthz"
    assert c["startupProbe"]["httpGet"]["path"] == "/healthz"
    assert pod["securityContext"]["runAsNonRoot"] is True
    vols = {v["name"]: v for v in pod["volumes"]}
    assert vols["config"]["configMap"]["name"] == cm["metadata"]["name"]
    secret_env = {e["name"] for e in c["env"] if "secretKeyRef" in e.get("valueFrom", {})}
    assert {"INFLIGHT_KAFKA__SASL_PASSWORD", "INFLIGHT_REDIS__URL"} <= secret_env
    assert "sasl_password" not in cfg["kafka"] and "url" not in cfg["redis"]  # no credentials in the ConfigMap
    port = c["ports"][0]
    assert port["containerPort"] == cfg["metrics"]["port"]
    # the preflight initContainer: `inflight check` on the worker's own config, secrets,
    # mounts and GPU, so what it checks is what the worker will meet
    (init,) = pod["initContainers"]
    assert init["command"] == ["inflight", "check"] and init["args"] == c["args"]
    assert init["image"] == c["image"]
    assert {e["name"]: e["valueFrom"] for e in init["env"]} == \
        {e["name"]: e["valueFrom"] for e in c["env"] if "secretKeyRef" in e.get("valueFrom", {})}
    assert init["volumeMounts"] == c["volumeMounts"]
    assert init["resources"] == c["resources"] and init["securityContext"] == c["securityContext"]
    svc = k8s("service.yaml")[0]
    assert svc["spec"]["selector"] == dep["spec"]["selector"]["matchLabels"]
    pdb = k8s("pdb.yaml")[0]
    assert pdb["spec"]["selector"]["matchLabels"] == dep["spec"]["selector"]["matchLabels"]
    so = k8s("scaledobject.yaml")[0]
    assert so["spec"]["scaleTargetRef"]["name"] == dep["metadata"]["name"]
    assert so["spec"]["minReplicaCount"] == 0
    trig = so["spec"]["triggers"]
    assert {t["type"] for t in trig} == {"kafka"}
    assert {t["metadata"]["topic"] for t in trig} == {keys.job_topic(cfg["kafka"]["topic_prefix"], p)
                                                       for p in keys.PRIORITIES}
    assert {t["metadata"]["consumerGroup"] for t in trig} == {cfg["kafka"]["group_id"]}


def test_kubernetes_redis_persists():
    docs = [d for d in yaml.safe_load_all((DEPLOY / "k8s" / "redis.yaml").read_text()) if d]
    sts = next(d for d in docs if d["kind"] == "StatefulSet")
    args = sts["spec"]["template"]["spec"]["containers"][0]["args"]
    assert args[args.index("--appendonly") + 1] == "yes" and args[args.index("--appendfsync") + 1] == "everysec"
    assert sts["spec"]["volumeClaimTemplates"][0]["metadata"]["name"] == "data"
    kust = yaml.safe_load((DEPLOY / "k8s" / "kustomization.yaml").read_text())
    assert "redis.yaml" in kust["resources"]


# ---- the gateway ------------------------------------------------------------------------------
def test_gateway_configs_load():
    from worker.gateway.config import load_gateway_config

    cfg = load_gateway_config(str(DEPLOY / "gateway.yaml"), env={})
    g = cfg.gateway
    assert (g.port, g.batch_priority, cfg.kafka.topic_prefix) == (8080, "low", "inflight")
    assert g.files_dir == "/var/lib/inflight/files" and not g.api_keys  # keys come from the environment
    worker = load_config(str(DEPLOY / "config.yaml"), env={})
    assert (cfg.kafka.topic_prefix, cfg.redis.key_prefix) == (worker.kafka.topic_prefix, worker.redis.key_prefix)
    cm = next(d for d in k8s("gateway.yaml") if d["kind"] == "ConfigMap")
    import tempfile

    with tempfile.NamedTemporaryFile("w", suffix=".yaml") as f:
        f.write(cm["data"]["gateway.yaml"])
        f.flush()
        k8s_cfg = load_gateway_config(f.name, env={"INFLIGHT_KAFKA__SASL_PASSWORD": "x"})
    assert k8s_cfg.gateway.api_keys_file == "/etc/inflight/keys/keys.yaml" and not k8s_cfg.gateway.api_keys
    assert k8s_cfg.kafka.sasl_username == "inflight-producer"  # the producer principal (inflight acl kafka)
    assert "url" not in yaml.safe_load(cm["data"]["gateway.yaml"])["redis"]  # credentials from the Secret


def test_compose_has_the_gateway():
    doc = yaml.safe_load((DEPLOY / "compose.yaml").read_text())
    gw = doc["services"]["gateway"]
    assert gw["build"]["dockerfile"] == "deploy/Dockerfile.gateway" and "deploy" not in gw  # no GPU
    assert "8080:8080" in gw["ports"]
    assert any(v.endswith(":/etc/inflight/gateway.yaml:ro") for v in gw["volumes"])
    files = next(v for v in gw["volumes"] if v.endswith(":/var/lib/inflight/files"))
    assert files.split(":")[0] in doc["volumes"]  # a named volume every gateway replica shares
    keys = yaml.safe_load(gw["environment"]["INFLIGHT_GATEWAY__API_KEYS"])
    assert keys[0]["max_priority"] in ("high", "normal", "low")
    from worker.gateway.config import load_gateway_config

    cfg = load_gateway_config(str(DEPLOY / "gateway.yaml"), env=gw["environment"])
    assert cfg.gateway.load_keys() and cfg.gateway.drain_timeout_s < int(gw["stop_grace_period"].rstrip("s"))
    prom = yaml.safe_load((DEPLOY / "prometheus" / "prometheus.yml").read_text())
    job = next(j for j in prom["scrape_configs"] if j["job_name"] == "inflight-gateway")
    assert job["dns_sd_configs"][0] == {"names": ["gateway"], "type": "A", "port": cfg.gateway.port}


def test_gateway_dockerfile_is_slim_non_root_with_the_gateway_extra():
    text = (DEPLOY / "Dockerfile.gateway").read_text()
    assert "cuda" not in text.lower() and re.search(r"^ARG PYTHON_IMAGE=python:3\.\d+-slim", text, re.M)
    user = re.findall(r"^USER (\S+)", text, re.M)
    assert user and not user[-1].startswith(("root", "0"))
    assert 'ENTRYPOINT ["inflight", "gateway"]' in text and "EXPOSE 8080" in text
    assert re.search(r"PIP_CONSTRAINT=/src/requirements\.lock pip install [^\n]*\.\[gateway\]", text)


def test_kubernetes_gateway_manifests():
    docs = {d["kind"]: d for d in k8s("gateway.yaml")}
    assert {"ConfigMap", "Deployment", "Service", "PersistentVolumeClaim", "PodDisruptionBudget"} <= set(docs)
    assert "gateway.yaml" in yaml.safe_load((DEPLOY / "k8s" / "kustomization.yaml").read_text())["resources"]
    dep, svc, pvc = docs["Deployment"], docs["Service"], docs["PersistentVolumeClaim"]
    pod = dep["spec"]["template"]["spec"]
    (c,) = pod["containers"]
    cfg = yaml.safe_load(docs["ConfigMap"]["data"]["gateway.yaml"])
    port = cfg["gateway"]["port"]
    assert c["ports"][0]["containerPort"] == port and "nvidia.com/gpu" not in str(c["resources"])
    assert c["readinessProbe"]["httpGet"]["path"] == "/readyz" and c["livenessProbe"]["httpGet"]["path"] == "/healthz"
    assert dep["spec"]["replicas"] >= 2 and pod["securityContext"]["runAsNonRoot"] is True
    assert pod["terminationGracePeriodSeconds"] > cfg["gateway"]["drain_timeout_s"]
    assert svc["spec"]["selector"] == dep["spec"]["selector"]["matchLabels"] == docs["PodDisruptionBudget"][
        "spec"]["selector"]["matchLabels"]
    assert pvc["spec"]["accessModes"] == ["ReadWriteMany"]  # one file store for every replica
    mounts = {m["name"]: m["mountPath"] for m in c["volumeMounts"]}
    vols = {v["name"]: v for v in pod["volumes"]}
    assert mounts["files"] == cfg["gateway"]["files_dir"]
    assert vols["files"]["persistentVolumeClaim"]["claimName"] == pvc["metadata"]["name"]
    assert cfg["gateway"]["api_keys_file"].startswith(mounts["keys"]) and "secret" in vols["keys"]
    secret_env = {e["name"] for e in c["env"] if "secretKeyRef" in e.get("valueFrom", {})}
    assert {"INFLIGHT_KAFKA__SASL_PASSWORD", "INFLIGHT_REDIS__URL"} <= secret_env
    examples = {d["metadata"]["name"]: d for d in k8s("secret.example.yaml")}
    refs = {e["valueFrom"]["secretKeyRef"]["key"] for e in c["env"] if "secretKeyRef" in e.get("valueFrom", {})}
    assert refs <= set(examples["inflight-credentials"]["stringData"])
    keys = yaml.safe_load(examples[vols["keys"]["secret"]["secretName"]]["stringData"]["keys.yaml"])
    from worker.gateway.config import ApiKey

    assert [msgspec.convert(k, ApiKey).tenant for k in keys] == ["team-a", "team-b"]


def test_the_long_pool_manifests_follow_the_base_and_the_pools_section():
    """deploy/k8s/pools: the long pool's Deployment is the base one renamed with its pool
    set by environment; its ScaledObject watches that pool's topics in its consumer group;
    the ConfigMap patch is the base config plus the pools section (issue 28)."""
    import copy
    import tempfile

    pools_dir = DEPLOY / "k8s" / "pools"
    kust = yaml.safe_load((pools_dir / "kustomization.yaml").read_text())
    assert kust["resources"] == ["..", "long.yaml"]
    assert [p["path"] for p in kust["patches"]] == ["pools-config.yaml", "gateway-pools-config.yaml",
                                                    "gateway-models.yaml"]
    base_cfg = yaml.safe_load(k8s("configmap.yaml")[0]["data"]["config.yaml"])
    patch = yaml.safe_load((pools_dir / "pools-config.yaml").read_text())
    assert patch["metadata"]["name"] == k8s("configmap.yaml")[0]["metadata"]["name"]
    cfg_text = patch["data"]["config.yaml"]
    pooled = yaml.safe_load(cfg_text)
    assert {k: v for k, v in pooled.items() if k != "pools"} == base_cfg
    with tempfile.NamedTemporaryFile("w", suffix=".yaml") as f:
        f.write(cfg_text)
        f.flush()
        secrets = {"INFLIGHT_KAFKA__SASL_PASSWORD": "x"}  # from the Secret in the cluster
        default = load_config(f.name, env=secrets)
        long = load_config(f.name, env={**secrets, "INFLIGHT_WORKER__POOL": "long"})
    assert default.pool_set.names == ["default", "long"] and long.pool.name == "long"

    dep, so, pdb = [d for d in yaml.safe_load_all((pools_dir / "long.yaml").read_text()) if d]
    expected = copy.deepcopy(k8s("deployment.yaml")[0])
    name = "inflight-worker-long"
    labels = {"app.kubernetes.io/name": name, "inflight.dev/pool": "long"}
    expected["metadata"].update(name=name, labels=labels)
    expected["spec"]["selector"]["matchLabels"] = labels
    expected["spec"]["template"]["metadata"]["labels"] = labels
    pod = expected["spec"]["template"]["spec"]
    for c in pod["initContainers"] + pod["containers"]:
        c["env"].insert(0, {"name": "INFLIGHT_WORKER__POOL", "value": "long"})
    assert dep == expected
    assert so["spec"]["scaleTargetRef"]["name"] == name and pdb["spec"]["selector"]["matchLabels"] == labels
    trig = so["spec"]["triggers"]
    assert [t["metadata"]["topic"] for t in trig] == keys.job_topics(long.kafka.topic_prefix, "long")
    assert {t["metadata"]["consumerGroup"] for t in trig} == {long.job_group_id} != {default.job_group_id}
    # the gateway: the base config plus the same pools and the model's tokenizer, read from
    # the models volume the workers mount
    from worker.gateway.config import load_gateway_config

    gw_base = yaml.safe_load(next(d for d in k8s("gateway.yaml") if d["kind"] == "ConfigMap")["data"]["gateway.yaml"])
    gw_patch = yaml.safe_load((pools_dir / "gateway-pools-config.yaml").read_text())
    gw_text = gw_patch["data"]["gateway.yaml"]
    gw = yaml.safe_load(gw_text)
    assert gw["pools"] == pooled["pools"] and gw["gateway"].pop("tokenizer") == "/models/model"
    assert {k: v for k, v in gw.items() if k != "pools"} == gw_base
    with tempfile.NamedTemporaryFile("w", suffix=".yaml") as f:
        f.write(gw_text)
        f.flush()
        assert load_gateway_config(f.name, env={"INFLIGHT_KAFKA__SASL_PASSWORD": "x"}).pools[1].name == "long"
    mounts = yaml.safe_load((pools_dir / "gateway-models.yaml").read_text())["spec"]["template"]["spec"]
    (worker_models,) = [v for v in k8s("deployment.yaml")[0]["spec"]["template"]["spec"]["volumes"]
                        if v["name"] == "models"]
    assert mounts["volumes"] == [worker_models]
    assert mounts["containers"][0]["volumeMounts"] == [{"name": "models", "mountPath": "/models", "readOnly": True}]
    assert mounts["containers"][0]["name"] == next(d for d in k8s("gateway.yaml") if d["kind"] == "Deployment")[
        "spec"]["template"]["spec"]["containers"][0]["name"]
    base_trig = k8s("scaledobject.yaml")[0]["spec"]["triggers"]
    assert [{**t["metadata"], "topic": None, "consumerGroup": None} for t in trig] == \
        [{**t["metadata"], "topic": None, "consumerGroup": None} for t in base_trig]
