"""Every manifest under deploy/k8s against the schemas a cluster would check it with,
offline, strictly (an unknown field is an error, as with `kubectl apply --validate=strict`):

- core kinds (Deployment, Service, ConfigMap, StatefulSet, PodDisruptionBudget, ...): the
  Kubernetes OpenAPI schemas bundled in `kubernetes-validate` (PyPI), newest version;
- KEDA's ScaledObject and TriggerAuthentication: the `openAPIV3Schema` of KEDA's own CRDs
  (`config/crd/bases` of the github.com/kedacore/keda/v2 module, from the Go module proxy
  with `go mod download`; skipped when Go or the proxy is not there);
- kustomize patches (deploy/k8s/pools): merged into their target first, by the strategic
  merge rules they rely on (maps merged, lists of named items merged by name), so what is
  validated is what `kubectl apply -k` would send.
"""

from __future__ import annotations

import copy
import json
import os
import shutil
import subprocess
from pathlib import Path

import pytest
import yaml

kv = pytest.importorskip("kubernetes_validate")

K8S = Path(__file__).resolve().parents[2] / "deploy" / "k8s"
KEDA = "github.com/kedacore/keda/v2@v2.17.2"  # the version deploy/k8s/scaledobject.yaml is written for
KEDA_CRDS = {"ScaledObject": "keda.sh_scaledobjects.yaml", "TriggerAuthentication": "keda.sh_triggerauthentications.yaml"}


def strategic_merge(base, patch):
    """`patch` over `base`: maps merged key by key, lists of maps with a `name` merged by
    name (containers, volumes, volumeMounts, env), other values replaced."""
    if isinstance(base, dict) and isinstance(patch, dict):
        out = dict(base)
        for k, v in patch.items():
            out[k] = strategic_merge(base[k], v) if k in base else v
        return out
    if isinstance(base, list) and isinstance(patch, list) and all(isinstance(x, dict) and "name" in x
                                                                  for x in base + patch):
        out = [copy.deepcopy(x) for x in base]
        for item in patch:
            i = next((i for i, x in enumerate(out) if x["name"] == item["name"]), None)
            if i is None:
                out.append(item)
            else:
                out[i] = strategic_merge(out[i], item)
        return out
    return patch


def build(directory: Path) -> list[dict]:
    """What `kubectl kustomize directory` yields: resources (files, or directories built
    the same way) with the patches merged into the resource of the same kind and name."""
    k = yaml.safe_load((directory / "kustomization.yaml").read_text())
    docs: list[dict] = []
    for r in k.get("resources", []):
        path = (directory / r).resolve()
        docs += build(path) if path.is_dir() else [d for d in yaml.safe_load_all(path.read_text()) if d]
    for p in k.get("patches", []):
        patch = yaml.safe_load((directory / p["path"]).read_text())
        i = next(i for i, d in enumerate(docs) if (d["kind"], d["metadata"]["name"]) ==
                 (patch["kind"], patch["metadata"]["name"]))
        docs[i] = strategic_merge(docs[i], patch)
    return docs


def strict(schema: dict) -> dict:
    """A CRD schema that refuses unknown fields (the API server would prune them silently)."""
    schema = dict(schema)
    if "properties" in schema and "additionalProperties" not in schema \
            and not schema.get("x-kubernetes-preserve-unknown-fields"):
        schema["additionalProperties"] = False
    for key in ("properties",):
        if key in schema:
            schema[key] = {n: strict(s) for n, s in schema[key].items()}
    for key in ("items", "additionalProperties"):
        if isinstance(schema.get(key), dict):
            schema[key] = strict(schema[key])
    return schema


@pytest.fixture(scope="module")
def keda_schemas() -> dict[str, dict]:
    if not shutil.which("go"):
        pytest.skip("go not installed: KEDA's CRDs come from the Go module proxy")
    env = {**os.environ, "GOFLAGS": "-mod=mod"}
    p = subprocess.run(["go", "mod", "download", "-json", KEDA], capture_output=True, text=True, timeout=300,
                       env=env, cwd=K8S)
    if p.returncode != 0:
        pytest.skip(f"go mod download {KEDA} failed (no module proxy?): {p.stdout[-300:]}{p.stderr[-300:]}")
    crds = Path(json.loads(p.stdout)["Dir"]) / "config" / "crd" / "bases"
    out = {}
    for kind, name in KEDA_CRDS.items():
        crd = yaml.safe_load((crds / name).read_text())
        (version,) = [v for v in crd["spec"]["versions"] if v["name"] == "v1alpha1"]
        out[kind] = strict(version["schema"]["openAPIV3Schema"])
    return out


def applied() -> list[tuple[str, dict]]:
    """The three kustomizations built, and the Secret example users apply by hand."""
    secrets = [d for d in yaml.safe_load_all((K8S / "secret.example.yaml").read_text()) if d]
    return [(f"{where}: {doc['kind']} {doc['metadata']['name']}", doc)
            for where, docs in (("k8s", build(K8S)), ("k8s/pools", build(K8S / "pools")),
                                ("k8s/vllm", build(K8S / "vllm")), ("secret.example.yaml", secrets))
            for doc in docs]


@pytest.mark.parametrize(("what", "doc"), applied(), ids=[w for w, _ in applied()])
def test_manifest_is_valid(what, doc, keda_schemas):
    if doc["kind"] in KEDA_CRDS:
        import jsonschema

        jsonschema.validate(doc, keda_schemas[doc["kind"]])
    else:
        kv.validate(doc, kv.latest_version(), strict=True)


def test_a_typo_is_caught_in_both_kinds_of_schema(keda_schemas):
    import jsonschema

    (dep,) = [d for d in build(K8S) if d["kind"] == "Deployment" and d["metadata"]["name"] == "inflight-worker"]
    dep = copy.deepcopy(dep)
    dep["spec"]["template"]["spec"]["containers"][0]["readinesProbe"] = {}  # "readiness" misspelt
    with pytest.raises(kv.ValidationError):
        kv.validate(dep, kv.latest_version(), strict=True)
    (so,) = [d for d in build(K8S) if d["kind"] == "ScaledObject"]
    so = copy.deepcopy(so)
    so["spec"]["minReplicas"] = so["spec"].pop("minReplicaCount")
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate(so, keda_schemas["ScaledObject"])
