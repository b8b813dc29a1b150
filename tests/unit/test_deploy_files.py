"""The project's own cross-checks of the container files: docker/ (image, compose, chaos) and
docker/k8s/, offline.

Each file's form is checked by its ecosystem's validator in test_deploy_validators.py
(Kubernetes API schemas and the PyTorchJob CRD, hadolint, the Compose Specification). What no
validator can know is checked here: the names that must agree across files do (labels,
selector, RBAC, image, ports, checkpoint and S3 settings); every path a command names exists;
the launcher flags parse with the real `hvd-resilient run` parser; the Dockerfile's ARGs, COPY
sources and the CPU/CUDA build matrix resolve; the shell scripts pass shellcheck; the
entrypoint's `setup` and `driver` modes work on a temporary folder; and the chaos scripts run to
the end against a stand-in `docker` that plays back the events a job would log (their control
flow, not Docker: tests/docker runs them against real containers, `make docker-test`).
"""

from __future__ import annotations

import fnmatch
import functools
import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[2]
DOCKER = ROOT / "docker"
COMPOSE = DOCKER / "compose.yaml"
DOCKERFILE = DOCKER / "Dockerfile"
ENTRYPOINT = DOCKER / "entrypoint.sh"
K8S_FILES = sorted((DOCKER / "k8s").glob("*.yaml"))
DOCS = ROOT / "docs" / "containers.md"

CHECKPOINT_ENV = "HVD_RESILIENT_CHECKPOINT_URL"
ENDPOINT_ENV = "AWS_ENDPOINT_URL"
DEFAULT_WORKERS = ("worker-1", "worker-2", "worker-3")


# ---- helpers ------------------------------------------------------------------------------
def interpolate(value: str, env: dict[str, str] | None = None) -> str:
    """Compose's ${VAR}, ${VAR:-default} and ${VAR-default}, with an empty environment."""
    env = env or {}

    def sub(m: re.Match[str]) -> str:
        name, op, default = m.group(1), m.group(2), m.group(3) or ""
        if op == ":-":
            return env.get(name) or default
        if op == "-":
            return env.get(name, default)
        return env.get(name, "")

    return re.sub(r"\$\{([A-Za-z_][A-Za-z0-9_]*)(?:(:?-)([^}]*))?\}", sub, str(value))


@functools.cache
def _compose_text() -> str:
    return COMPOSE.read_text()


def compose() -> dict:
    return yaml.safe_load(_compose_text())


def services() -> dict[str, dict]:
    return compose()["services"]


@functools.cache
def _k8s_docs() -> str:
    docs = []
    for f in K8S_FILES:
        docs += [d for d in yaml.safe_load_all(f.read_text()) if d]
    return json.dumps(docs)


def k8s_docs() -> list[dict]:
    """Every manifest in docker/k8s/ (parsed once; each call gets its own copy)."""
    return json.loads(_k8s_docs())


def k8s(kind: str, name: str) -> dict:
    found = [d for d in k8s_docs() if d["kind"] == kind and d["metadata"]["name"] == name]
    assert len(found) == 1, f"expected one {kind}/{name} in docker/k8s/, found {len(found)}"
    return found[0]


def env_of(container: dict) -> dict[str, dict]:
    return {e["name"]: e for e in container.get("env", [])}


def env_value(container: dict, name: str) -> str:
    entry = env_of(container)[name]
    assert "value" in entry, f"{container['name']}: {name} should be a plain value"
    return entry["value"]


def launcher_pod() -> dict:
    return k8s("Job", "hvd-resilient-launcher")["spec"]["template"]


def launcher() -> dict:
    return next(c for c in launcher_pod()["spec"]["containers"] if c["name"] == "launcher")


def worker_set() -> dict:
    return k8s("StatefulSet", "hvd-resilient-worker")


def worker_container() -> dict:
    return worker_set()["spec"]["template"]["spec"]["containers"][0]


def pytorchjob() -> dict:
    return next(d for d in k8s_docs() if d["kind"] == "PyTorchJob")


def pytorch_container() -> dict:
    pod = pytorchjob()["spec"]["pytorchReplicaSpecs"]["Worker"]["template"]
    return pod["spec"]["containers"][0]


def selector_labels(selector: str) -> dict[str, str]:
    pairs = [p.split("=", 1) for p in selector.split(",")]
    assert all(len(p) == 2 and p[0] and p[1] for p in pairs), f"only k=v selectors: {selector}"
    return dict(pairs)


def matches(selector: dict[str, str], labels: dict[str, str]) -> bool:
    return all(labels.get(k) == v for k, v in selector.items())


def run_options(cmd: list[str]):
    """The driver's arguments parsed by the real `hvd-resilient run` parser, typed as it
    types them (`RunSettings`: `.launcher`, `.run` the options every launcher is handed,
    `.horovod` the Horovod launcher's own)."""
    from hvd_resilient.launch.cli import build_parser
    from hvd_resilient.launch.run_settings import RUN

    assert cmd[0] == "driver", f"the launcher runs the entrypoint's driver mode: {cmd}"
    opts = RUN.build(RUN.read(args=build_parser().parse_args(cmd[1:])))
    train = opts.run.command[1:] if opts.run.command[:1] == ["--"] else opts.run.command
    return opts, train


def check_train_command(train: list[str]) -> None:
    """`python examples/digits.py --flag value ...`: the script exists, every flag is known."""
    import argparse

    from hvd_resilient.config import TrainConfig

    assert train[:2] == ["python", "examples/digits.py"], train
    assert (ROOT / train[1]).is_file()
    parser = argparse.ArgumentParser()
    TrainConfig.add_arguments(parser)
    known = {o for a in parser._actions for o in a.option_strings} | {"--lr", "--hidden"}
    flags = [a for a in train[2:] if a.startswith("--")]
    assert set(flags) <= known, f"unknown training flags {set(flags) - known}"


# ---- Dockerfile -----------------------------------------------------------------------------
def dockerfile_instructions(text: str) -> list[tuple[int, str, str]]:
    """(line, INSTRUCTION, arguments), continuations joined and comments dropped, as Docker does."""
    out, buf, start = [], "", 0
    for no, raw in enumerate(text.splitlines(), 1):
        line = raw.rstrip()
        if line.lstrip().startswith("#") or (not buf and not line.strip()):
            continue  # comment lines are dropped even inside a continuation
        if not buf:
            start = no
        if line.endswith("\\"):
            buf += line[:-1] + " "
            continue
        buf += line
        keyword, _, rest = buf.strip().partition(" ")
        out.append((start, keyword, rest.strip()))
        buf = ""
    assert not buf, "Dockerfile ends inside a line continuation"
    return out


def dockerfile_env() -> tuple[dict[str, str], dict[str, str], dict[str, str]]:
    """(global ARG defaults, stage ARG defaults, ENV values resolved in order)."""
    global_args: dict[str, str] = {}
    stage_args: dict[str, str] = {}
    env: dict[str, str] = {"PATH": "/usr/local/bin:/usr/bin:/bin"}
    seen_from = False
    for _, kw, rest in dockerfile_instructions(DOCKERFILE.read_text()):
        if kw == "FROM":
            seen_from = True
        elif kw == "ARG":
            name, _, default = rest.partition("=")
            (stage_args if seen_from else global_args)[name] = default.strip('"')
        elif kw == "ENV":
            for name, value in re.findall(r'([A-Za-z_][A-Za-z0-9_]*)=("[^"]*"|\S+)', rest):
                scope = {**stage_args, **env}
                env[name] = re.sub(r"\$\{?([A-Za-z_][A-Za-z0-9_]*)\}?",
                                   lambda m, s=scope: s.get(m.group(1), ""), value.strip('"'))
    return global_args, stage_args, env


IMAGE_REF = re.compile(
    r"^(?:[a-zA-Z0-9.-]+(?::\d+)?/)?"                      # registry (optional)
    r"[a-z0-9]+(?:(?:[._]|__|-+)[a-z0-9]+)*"                # first path component
    r"(?:/[a-z0-9]+(?:(?:[._]|__|-+)[a-z0-9]+)*)*"          # more components
    r"(?::[A-Za-z0-9_][A-Za-z0-9_.-]{0,127})?"              # tag
    r"(?:@sha256:[0-9a-f]{64})?$"                           # digest
)


def image_from_line() -> str:
    """The FROM of the image's own stage: the last one (the first is the wheels stage)."""
    froms = [rest for _, kw, rest in dockerfile_instructions(DOCKERFILE.read_text())
             if kw == "FROM"]
    assert froms[0].endswith(" AS wheels"), "the wheels stage comes first"
    return froms[-1]


def test_dockerfile_every_variable_is_declared_and_every_arg_used():
    text = DOCKERFILE.read_text()
    global_args, stage_args, _ = dockerfile_env()
    declared_env: set[str] = set()
    seen_from = False
    used: set[str] = set()
    for no, kw, rest in dockerfile_instructions(text):
        refs = set(re.findall(r"\$\{?([A-Za-z_][A-Za-z0-9_]*)", rest))
        if kw == "FROM":
            assert refs <= set(global_args), f"line {no}: FROM uses {refs - set(global_args)}"
            used |= refs
            seen_from = True
            continue
        if not seen_from:
            continue
        known = set(stage_args) | declared_env | {"PATH", "HOME"}
        if kw == "RUN":
            # Shell variables are the RUN's own business; upper-case ${NAME} must be ours.
            refs = set(re.findall(r"\$\{([A-Z_][A-Z0-9_]*)", rest))
            assigned = set(re.findall(r"\b([A-Z_][A-Z0-9_]*)=", rest))
            known |= assigned
        assert refs <= known, f"line {no}: {kw} uses undeclared {sorted(refs - known)}"
        used |= refs
        if kw == "ENV":
            declared_env |= set(re.findall(r"([A-Za-z_][A-Za-z0-9_]*)=", rest))
    unused = (set(global_args) | set(stage_args)) - used
    assert not unused, f"ARGs declared but never used: {sorted(unused)}"
    assert stage_args.get("TORCH_VERSION") == "2.13.0", "the torch install.sh pins"


def dockerignore_patterns() -> list[str]:
    ignore = DOCKER / "Dockerfile.dockerignore"
    assert ignore.is_file(), "docker/Dockerfile.dockerignore keeps .venv/.git out of the context"
    lines = [ln.strip() for ln in ignore.read_text().splitlines()]
    return [ln for ln in lines if ln and not ln.startswith("#")]


def ignored(path: str, patterns: list[str]) -> bool:
    parts = path.split("/")
    prefixes = ["/".join(parts[: i + 1]) for i in range(len(parts))]
    for pat in patterns:
        pat = pat.lstrip("/")
        for p in prefixes:
            if fnmatch.fnmatchcase(p, pat) or (pat.startswith("**/") and any(
                    fnmatch.fnmatchcase(q, pat[3:]) for q in p.split("/"))):
                return True
    return False


def test_dockerfile_copy_sources_exist_and_are_in_the_context():
    patterns = dockerignore_patterns()
    copies = [rest for _, kw, rest in dockerfile_instructions(DOCKERFILE.read_text())
              if kw in ("COPY", "ADD")]
    assert copies, "the repository must be copied into the image"
    for rest in copies:
        args = [a for a in rest.split() if not a.startswith("--")]
        for src in args[:-1]:
            assert (ROOT / src).exists(), f"COPY source {src} missing from the repository"
    # What install.sh and the entrypoint need must not be filtered out of the context.
    needed = ["scripts/install.sh", "pyproject.toml", "README.md", "hvd_resilient/__init__.py",
              "docker/entrypoint.sh", "docker/discover.sh", "discovery/kubernetes",
              "discovery/hostfile", "discovery/health-filter", "examples/digits.py"]
    for path in needed:
        assert (ROOT / path).exists(), path
        assert not ignored(path, patterns), f"{path} is excluded by the dockerignore"
    for path in (".venv/bin/python", ".git/HEAD", "runs/x/events.jsonl",
                 "hvd_resilient/__pycache__/x.pyc"):
        assert ignored(path, patterns), f"{path} should stay out of the build context"


def build_arg_sets() -> list[dict[str, str]]:
    """Each documented `docker build` (Dockerfile header, docs) as its --build-arg values."""
    sets = [{}]
    for text in (DOCKERFILE.read_text(), DOCS.read_text()):
        for cmd in re.findall(r"docker build\b(?:[^\n]*\\\n)*[^\n]*", text):
            args = dict(re.findall(r"--build-arg\s+([A-Z_]+)=(\S+)", cmd))
            if args:
                sets.append(args)
    return sets


def test_build_matrix_resolves_to_well_formed_from_lines():
    global_args, stage_args, _ = dockerfile_env()
    sets = build_arg_sets()
    bases = {s.get("BASE_IMAGE", global_args["BASE_IMAGE"]) for s in sets}
    assert len(bases) >= 2, f"expected the CPU default and a documented CUDA base, got {bases}"
    from_line = image_from_line()
    for s in sets:
        assert set(s) <= set(global_args) | set(stage_args), f"undeclared build args in {s}"
        values = {**global_args, **s}
        image = re.sub(r"\$\{?([A-Za-z_][A-Za-z0-9_]*)\}?", lambda m, v=values: v[m.group(1)],
                       from_line)
        assert IMAGE_REF.match(image), f"FROM {image!r} is not an image reference"
        cuda = re.search(r"nvidia/cuda:(\d+)\.(\d+)", image)
        if cuda:  # torch's CUDA build must match the toolkit Horovod's NCCL ops compile against
            index = s.get("TORCH_INDEX_URL", "")
            assert index.strip('"').endswith(f"/cu{cuda.group(1)}{cuda.group(2)}"), (
                f"{image} needs --build-arg TORCH_INDEX_URL=.../cu{cuda.group(1)}"
                f"{cuda.group(2)}, got {index!r}")
            assert "devel" in image, "the CUDA base must be a -devel image (nvcc for Horovod)"
    assert not IMAGE_REF.match("nvidia/cuda:12.8 devel"), "the reference check must reject this"


def test_dockerfile_entrypoint_workdir_and_ssh_port():
    _, stage_args, env = dockerfile_env()
    ins = dockerfile_instructions(DOCKERFILE.read_text())
    app = env["APP_DIR"]
    entry = json.loads(next(rest for _, kw, rest in ins if kw == "ENTRYPOINT"))
    assert entry[-1] == f"{app}/docker/entrypoint.sh"
    assert os.access(ENTRYPOINT, os.X_OK), "docker/entrypoint.sh must be executable (git mode)"
    if entry[0].endswith("tini"):
        assert "tini" in DOCKERFILE.read_text().split("ENTRYPOINT")[0], "tini is installed"
    workdir = next(rest for _, kw, rest in ins if kw == "WORKDIR")
    assert re.sub(r"\$\{?APP_DIR\}?", app, workdir) == app, "horovodrun runs ranks in the cwd"
    assert env["VENV"] == f"{app}/.venv" and env["PATH"].startswith(f"{app}/.venv/bin:")
    cmd = json.loads(next(rest for _, kw, rest in ins if kw == "CMD"))
    assert cmd[0] in entrypoint_modes()
    port = stage_args["SSH_PORT"]
    expose = next(rest for _, kw, rest in ins if kw == "EXPOSE")
    assert re.sub(r"\$\{?SSH_PORT\}?", port, expose) == port
    assert "Port ${SSH_PORT}" in DOCKERFILE.read_text(), "sshd and ssh use SSH_PORT"
    assert "StrictHostKeyChecking no" in DOCKERFILE.read_text()
    assert "rm -f /etc/ssh/ssh_host_*" in DOCKERFILE.read_text(), "no host keys in the image"
    assert "ssh-keygen -A" in ENTRYPOINT.read_text(), "host keys are made at container start"
    assert "bash scripts/install.sh" in DOCKERFILE.read_text(), "installed as `make install` does"


def entrypoint_modes() -> set[str]:
    text = ENTRYPOINT.read_text()
    case = text[text.rindex('case "$mode" in'):]
    return set(re.findall(r"^\s+([a-z]+)\)", case, re.M))


# ---- compose --------------------------------------------------------------------------------
def image_of(svc: dict) -> str:
    return interpolate(svc["image"])


def test_compose_services_share_one_image_and_it_is_the_k8s_one():
    svcs = services()
    assert set(DEFAULT_WORKERS) | {"setup", "seaweedfs", "driver", "worker-4"} <= set(svcs)
    images = {image_of(s) for s in svcs.values()}
    assert images == {"hvd-resilient:cpu"}, images
    for s in svcs.values():
        assert s["build"]["context"] == ".." and s["build"]["dockerfile"] == "docker/Dockerfile"
        assert (COMPOSE.parent / s["build"]["context"] / s["build"]["dockerfile"]).is_file()
    k8s_images = set()
    for d in k8s_docs():
        for c in _containers(d):
            k8s_images.add(c["image"])
    assert k8s_images == images, f"k8s images {k8s_images} differ from compose {images}"
    assert "-t hvd-resilient:cpu" in DOCS.read_text()


def test_compose_workers_setup_and_hostfile_agree():
    svcs = services()
    setup_env = svcs["setup"]["environment"]
    assert setup_env["HVD_WORKERS"].split() == list(DEFAULT_WORKERS)
    for name in (*DEFAULT_WORKERS, "worker-4"):
        w = svcs[name]
        assert w["hostname"] == name and w["command"] == ["sshd"]
        assert w["healthcheck"]["test"][1:] == [
            "/opt/hvd_resilient/docker/entrypoint.sh", "health", "sshd"]
        assert w["depends_on"]["setup"]["condition"] == "service_completed_successfully"
        assert "shared:/shared" in w["volumes"]
        assert w["environment"]["HVD_SSH_DIR"] == setup_env["HVD_SSH_DIR"]
        assert w["environment"]["HVD_RESILIENT_HOSTFILE"] == setup_env["HVD_RESILIENT_HOSTFILE"]
    assert svcs["worker-4"].get("profiles") == ["spare"], "the spare is not started by default"
    assert all("profiles" not in svcs[n] for n in DEFAULT_WORKERS)
    for svc in svcs.values():
        cmd = svc.get("command") or ["sshd"]
        assert cmd[0] in entrypoint_modes(), f"no entrypoint mode {cmd[0]!r}"
        hc = svc.get("healthcheck")
        if hc:
            assert hc["test"][0] == "CMD" and hc["test"][2] == "health"


def test_compose_training_env_checkpoint_and_s3_agree():
    svcs = services()
    trainers = ["driver", *DEFAULT_WORKERS, "worker-4"]
    envs = {n: {k: interpolate(v) for k, v in svcs[n]["environment"].items()} for n in trainers}
    for key in (CHECKPOINT_ENV, ENDPOINT_ENV, "HVD_RESILIENT_RUN_ID", "HVD_RESILIENT_RUN_DIR",
                "AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY"):
        values = {n: e.get(key) for n, e in envs.items()}
        assert len(set(values.values())) == 1 and None not in values.values(), (key, values)
    env = envs["driver"]
    s3 = {k: interpolate(v) for k, v in svcs["seaweedfs"]["environment"].items()}
    assert env[ENDPOINT_ENV] == f"http://seaweedfs:{s3['S3_PORT']}"
    assert env[CHECKPOINT_ENV] == f"s3://{s3['S3_BUCKET']}/{env['HVD_RESILIENT_RUN_ID']}"
    assert env["HVD_RESILIENT_RUN_DIR"].startswith("/shared/")
    for key in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY"):
        raw = svcs["seaweedfs"]["environment"][key]
        assert raw == svcs["driver"]["environment"][key], "server and clients share credentials"
        assert re.fullmatch(r"\$\{HVD_S3_[A-Z_]+:-placeholder-[a-z-]+\}", raw), (
            f"{key}: only placeholders that say so may be written in the file: {raw}")
    hc = svcs["seaweedfs"]["healthcheck"]["test"]
    assert hc[1:] == ["/opt/hvd_resilient/docker/entrypoint.sh", "health", "s3"]


def test_compose_driver_command():
    svcs = services()
    driver = svcs["driver"]
    cmd = [interpolate(a) for a in driver["command"]]
    opts, train = run_options(cmd)
    assert opts.launcher == "horovod" and opts.horovod.network_interface == "eth0"
    assert opts.run.discovery == "/shared/discover.sh"
    # `entrypoint.sh setup` puts docker/discover.sh there, on the volume mounted at /shared.
    assert '"$SHARED/discover.sh"' in ENTRYPOINT.read_text()
    assert 'SHARED="${HVD_SHARED_DIR:-/shared}"' in ENTRYPOINT.read_text()
    assert "/discovery/hostfile" in (DOCKER / "discover.sh").read_text()
    assert "/discovery/health-filter" in (DOCKER / "discover.sh").read_text()
    assert opts.run.min_np <= opts.run.np <= opts.run.max_np
    assert opts.run.np == len(DEFAULT_WORKERS)
    assert opts.run.max_np >= len(DEFAULT_WORKERS) + 1, "room for the spare worker"
    check_train_command(train)
    deps = driver["depends_on"]
    for name in (*DEFAULT_WORKERS, "seaweedfs"):
        assert deps[name]["condition"] == "service_healthy", name
    assert "worker-4" not in deps


# ---- Kubernetes -----------------------------------------------------------------------------
def _containers(doc: dict) -> list[dict]:
    out = []

    def walk(node):
        if isinstance(node, dict):
            for key in ("containers", "initContainers"):
                out.extend(node.get(key) or [])
            for v in node.values():
                walk(v)
        elif isinstance(node, list):
            for v in node:
                walk(v)

    walk(doc)
    return out


def test_k8s_manifests_hold_the_kinds_and_take_the_namespace_from_kubectl():
    docs = k8s_docs()
    assert K8S_FILES and docs
    for d in docs:
        assert "namespace" not in d["metadata"], "namespace comes from `kubectl apply -n`"
    kinds = {d["kind"] for d in docs}
    assert {"ServiceAccount", "Role", "RoleBinding", "Service", "StatefulSet", "Job",
            "PersistentVolumeClaim", "PyTorchJob"} <= kinds


def test_k8s_discovery_selector_matches_workers_only():
    selector = selector_labels(env_value(launcher(), "HVD_RESILIENT_K8S_SELECTOR"))
    sts = worker_set()
    labels = sts["spec"]["template"]["metadata"]["labels"]
    assert matches(selector, labels), f"worker pods {labels} do not match {selector}"
    assert matches(sts["spec"]["selector"]["matchLabels"], labels)
    assert not matches(selector, launcher_pod()["metadata"]["labels"]), "launcher is no worker"
    torch_pod = pytorchjob()["spec"]["pytorchReplicaSpecs"]["Worker"]["template"]
    assert not matches(selector, torch_pod["metadata"]["labels"])
    # The wait in the init container looks for the same pods, as many as --min-np.
    init = launcher_pod()["spec"]["initContainers"][0]
    assert env_value(init, "HVD_RESILIENT_K8S_SELECTOR") == env_value(
        launcher(), "HVD_RESILIENT_K8S_SELECTOR")
    opts, _ = run_options(launcher()["args"])
    assert int(env_value(init, "MIN_HOSTS")) == opts.run.min_np
    assert "/opt/hvd_resilient/discovery/kubernetes" in " ".join(init["args"])
    # Every discovery variable set is one the script reads.
    source = (ROOT / "hvd_resilient" / "discovery" / "kubernetes.py").read_text()
    for name in env_of(launcher()):
        if name.startswith("HVD_RESILIENT_K8S_"):
            assert name in source, f"{name} is not read by discovery/kubernetes"


def test_k8s_headless_service_and_statefulset():
    svc = k8s("Service", "hvd-resilient-workers")
    sts = worker_set()
    assert svc["spec"]["clusterIP"] == "None"
    assert sts["spec"]["serviceName"] == svc["metadata"]["name"]
    assert matches(svc["spec"]["selector"], sts["spec"]["template"]["metadata"]["labels"])
    _, stage_args, _ = dockerfile_env()
    port = int(stage_args["SSH_PORT"])
    c = worker_container()
    assert c["args"] == ["sshd"]
    assert [p["containerPort"] for p in c["ports"]] == [port]
    assert svc["spec"]["ports"][0]["port"] == port
    assert c["readinessProbe"]["tcpSocket"]["port"] in ("ssh", port)
    assert sts["spec"]["template"]["spec"]["automountServiceAccountToken"] is False


def test_k8s_rbac_lets_the_launcher_list_pods():
    sa = launcher_pod()["spec"]["serviceAccountName"]
    k8s("ServiceAccount", sa)
    bindings = [d for d in k8s_docs() if d["kind"] == "RoleBinding"]
    bound = [b for b in bindings
             if any(s["kind"] == "ServiceAccount" and s["name"] == sa for s in b["subjects"])]
    assert bound, f"no RoleBinding for ServiceAccount {sa}"
    for b in bound:
        assert b["roleRef"]["kind"] == "Role"
        assert b["roleRef"]["apiGroup"] == "rbac.authorization.k8s.io"
        role = k8s("Role", b["roleRef"]["name"])
        granted = set()
        for rule in role["rules"]:
            if "" in rule["apiGroups"] and "pods" in rule["resources"]:
                granted |= set(rule["verbs"])
        assert {"get", "list", "watch"} <= granted, granted
        assert granted <= {"get", "list", "watch"}, "read-only: nothing more than that"


def test_k8s_launcher_command_and_paths():
    c = launcher()
    opts, train = run_options(c["args"])
    assert opts.launcher == "horovod" and opts.horovod.network_interface == "eth0"
    app = dockerfile_env()[2]["APP_DIR"]
    assert opts.run.discovery.startswith(app + "/")
    script = ROOT / opts.run.discovery[len(app) + 1:]
    assert script.is_file() and os.access(script, os.X_OK), script
    assert opts.run.min_np <= opts.run.np <= opts.run.max_np
    assert opts.run.np <= worker_set()["spec"]["replicas"]
    check_train_command(train)
    # ssh key from the Secret at HVD_SSH_DIR, for the launcher and the workers alike.
    for pod, cont in ((launcher_pod(), c), (worker_set()["spec"]["template"], worker_container())):
        mounts = {m["name"]: m["mountPath"] for m in cont["volumeMounts"]}
        vols = {v["name"]: v for v in pod["spec"]["volumes"]}
        assert mounts["ssh-key"] == env_value(cont, "HVD_SSH_DIR")
        assert vols["ssh-key"]["secret"]["secretName"] == "hvd-resilient-ssh"


def test_k8s_training_containers_share_checkpoint_and_s3_settings():
    trainers = [launcher(), worker_container(), pytorch_container()]
    secrets = set()
    for c in trainers:
        env = env_of(c)
        assert CHECKPOINT_ENV in env and ENDPOINT_ENV in env, c["name"]
        assert env_value(c, CHECKPOINT_ENV).startswith("s3://")
        for key in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY"):
            ref = env[key]["valueFrom"]["secretKeyRef"]
            assert ref["key"] == key
            secrets.add(ref["name"])
    assert secrets == {"hvd-resilient-s3"}
    # One elastic job: launcher and workers use the same run and checkpoint location.
    for key in (CHECKPOINT_ENV, ENDPOINT_ENV, "HVD_RESILIENT_RUN_ID", "HVD_RESILIENT_RUN_DIR"):
        assert env_value(launcher(), key) == env_value(worker_container(), key), key
    assert env_value(pytorch_container(), ENDPOINT_ENV) == env_value(launcher(), ENDPOINT_ENV)
    # Two jobs must not write to one checkpoint prefix.
    assert env_value(pytorch_container(), CHECKPOINT_ENV) != env_value(launcher(), CHECKPOINT_ENV)
    # The shared run folder is the ReadWriteMany claim.
    pvc = k8s("PersistentVolumeClaim", "hvd-resilient-shared")
    assert pvc["spec"]["accessModes"] == ["ReadWriteMany"]
    for c in trainers:
        assert any(m["mountPath"] == "/shared" for m in c["volumeMounts"]), c["name"]
        assert env_value(c, "HVD_RESILIENT_RUN_DIR").startswith("/shared/")


def test_k8s_pytorchjob_elastic_torchrun():
    spec = pytorchjob()["spec"]
    ep = spec["elasticPolicy"]
    assert ep["rdzvBackend"] == "c10d" and ep["maxRestarts"] > 0
    worker = spec["pytorchReplicaSpecs"]["Worker"]
    assert set(spec["pytorchReplicaSpecs"]) == {"Worker"}, "elastic c10d: workers only"
    assert ep["minReplicas"] <= worker["replicas"] <= ep["maxReplicas"]
    assert worker["restartPolicy"] == "OnFailure"
    assert spec["nprocPerNode"] == "1", "one process per pod on CPU ('auto': one per core)"
    c = pytorch_container()
    assert c["name"] == "pytorch", "the training operator finds the container by this name"
    assert c["args"][0] == "torchrun"
    check_train_command(["python", *c["args"][1:]])


def test_k8s_inplace_indexed_job_one_agent_per_pod_agreed_in_etcd(monkeypatch):
    """Each pod's agent command, as the kubelet expands it, parses as the agent's own: its
    place from the completion index, one pod per host, no index run twice."""
    from hvd_resilient.launch import inplace_agent

    job = k8s("Job", "hvd-resilient-inplace")
    spec, pod = job["spec"], job["spec"]["template"]["spec"]
    assert spec["completionMode"] == "Indexed" and spec["backoffLimitPerIndex"] == 0
    assert pod["restartPolicy"] == "Never"
    (c,) = pod["containers"]
    env = {e["name"]: e for e in c["env"]}
    assert env["POD_IP"]["valueFrom"]["fieldRef"]["fieldPath"] == "status.podIP"
    assert "controller-uid" in env["JOB_UID"]["valueFrom"]["fieldRef"]["fieldPath"]
    args = [a.replace("$(POD_IP)", "10.1.2.3").replace("$(JOB_UID)", "u1") for a in c["args"]]
    assert args[:3] == ["python", "-m", "hvd_resilient.launch.inplace_agent"]
    monkeypatch.delenv("SLURM_NODEID", raising=False)
    monkeypatch.delenv("SLURM_NNODES", raising=False)
    monkeypatch.setenv("JOB_COMPLETION_INDEX", "2")
    a = inplace_agent.parse(args[3:])
    assert (a.host_index, a.address, a.job) == (2, "10.1.2.3", "u1") and a.etcd
    assert a.hosts_count == spec["completions"] == spec["parallelism"]
    assert a.min_np <= a.job_nproc
    check_train_command(a.cmd)


# ---- scripts --------------------------------------------------------------------------------
SCRIPTS = sorted([*DOCKER.glob("*.sh"), *(DOCKER / "chaos").glob("*.sh")])


def test_shellcheck():
    exe = shutil.which("shellcheck")
    if exe is None:
        pytest.fail("install shellcheck (make install)", pytrace=False)
    r = subprocess.run([exe, "-x", *map(str, SCRIPTS)], cwd=ROOT, capture_output=True,
                       text=True, timeout=120)
    assert r.returncode == 0, r.stdout + r.stderr


def test_scripts_are_strict_and_executable():
    for s in SCRIPTS:
        text = s.read_text()
        if s.name in ("lib.sh",):  # sourced, not run
            continue
        assert os.access(s, os.X_OK), f"{s} is not executable"
        if text.startswith("#!/usr/bin/env bash"):
            assert "set -euo pipefail" in text, s
    for s in (DOCKER / "chaos").glob("*.sh"):
        if s.name != "lib.sh":
            assert "source " in s.read_text() and "report" in s.read_text(), s


def test_entrypoint_setup_then_driver_dry_run(tmp_path: Path):
    """setup makes the key, hostfile and discover.sh once; driver turns the compose
    environment into the `hvd-resilient run` command line."""
    shared = tmp_path / "shared"
    compose_env = {k: interpolate(v) for k, v in services()["driver"]["environment"].items()}
    setup_env = services()["setup"]["environment"]
    base = {"PATH": os.environ["PATH"], "HOME": str(tmp_path / "home"),
            "VENV": str(Path(sys.executable).parent.parent), "HVD_SHARED_DIR": str(shared)}
    env = {**base, "HVD_WORKERS": setup_env["HVD_WORKERS"], "HVD_SSH_DIR": str(shared / "ssh"),
           "HVD_RESILIENT_HOSTFILE": str(shared / "hosts")}
    r = subprocess.run([str(ENTRYPOINT), "setup"], env=env, capture_output=True, text=True,
                       timeout=60)
    assert r.returncode == 0, r.stderr
    key = shared / "ssh" / "id_ed25519"
    assert key.stat().st_mode & 0o077 == 0, "private key readable by others"
    first = key.read_bytes()
    assert (shared / "hosts").read_text().split() == [f"{w}:1" for w in DEFAULT_WORKERS]
    assert os.access(shared / "discover.sh", os.X_OK)
    r = subprocess.run([str(ENTRYPOINT), "setup"], env=env, capture_output=True, text=True,
                       timeout=60)
    assert r.returncode == 0 and key.read_bytes() == first, "setup must keep what exists"

    cmd = [interpolate(a) for a in services()["driver"]["command"]]
    cmd[cmd.index("--discovery") + 1] = str(shared / "discover.sh")
    denv = {**compose_env, **base, "HVD_SSH_DIR": str(shared / "ssh"),
            "HVD_RESILIENT_RUN_DIR": str(shared / "runs" / "digits")}
    cmd.insert(1, "--dry-run")  # before `--`: after it, it would go to the training script
    r = subprocess.run([str(ENTRYPOINT), *cmd], env=denv, capture_output=True,
                       text=True, timeout=60, cwd=tmp_path)
    assert r.returncode == 0, r.stderr
    launch = r.stdout.splitlines()[0]
    assert "hvd_resilient.launch.horovod.driver" in launch  # horovodrun with slot hosts
    assert "--network-interface eth0" in launch
    assert launch.endswith("python examples/digits.py --epochs 20 --checkpoint-every 100")
    assert f"{CHECKPOINT_ENV}={compose_env[CHECKPOINT_ENV]}" in r.stdout
    assert "AWS_SECRET_ACCESS_KEY=***" in r.stdout
    assert compose_env["AWS_SECRET_ACCESS_KEY"] not in r.stdout
    assert (tmp_path / "home" / ".ssh" / "id_ed25519").read_bytes() == first


# ---- chaos scripts against a stand-in docker ------------------------------------------------
FAKE_DOCKER = r'''#!/usr/bin/env python3
"""Stand-in for `docker`: records each call and appends the events the job would log."""
import json, os, subprocess, sys, time

shared, argv = os.environ["FAKE_SHARED"], sys.argv[1:]
state_file = os.path.join(shared, ".fake-state.json")
state = json.load(open(state_file)) if os.path.exists(state_file) else {"down": []}
with open(os.environ["FAKE_LOG"], "a") as fh:
    fh.write(" ".join(argv) + "\n")

def save():
    json.dump(state, open(state_file, "w"))

def emit(event, **fields):
    if os.environ.get("FAKE_SILENT"):
        return
    path = os.path.join(shared, "runs", "digits", "events.jsonl")
    rec = {"ts": time.time(), "event": event, "rank": 0, "size": 0, "step": 1, **fields}
    with open(path, "a") as fh:
        fh.write(json.dumps(rec, separators=(",", ":")) + "\n")

def world():
    hosts = [ln.split(":")[0] for ln in open(os.path.join(shared, "hosts")) if ln.strip()]
    return len([h for h in hosts if h not in state["down"]])

def down(svc):
    if svc == "seaweedfs":
        emit("checkpoint_failed"); emit("commit")
    else:
        old = world(); state["down"].append(svc)
        emit("failure_detected"); emit("restore"); emit("reset", old_size=old, new_size=world())

def up(svc):
    if svc in state["down"]:
        state["down"].remove(svc)
    if svc == "seaweedfs":
        emit("checkpoint_saved")
    else:
        emit("hosts_changed"); emit("reset", new_size=world())

if argv[0] == "compose":
    rest = argv[1:]
    while rest[0] in ("-f", "--profile"):
        rest = rest[2:]
    sub, args = rest[0], rest[1:]
    if sub == "ps" and "--services" in args:
        print("\n".join(["driver", "seaweedfs", "worker-1", "worker-2", "worker-3"]))
    elif sub == "ps":
        print("cid-" + args[-1])
    elif sub == "run":
        cmd = args[args.index("setup") + 1:]
        if cmd[0] == "hvd-resilient":
            if not os.environ.get("FAKE_REPORT"):
                sys.exit(2)  # an image without `hvd-resilient report`
            cmd[0] = os.path.join(os.path.dirname(sys.executable), "hvd-resilient")
        cmd = [a.replace("/shared", shared) for a in cmd]
        rc = subprocess.run(cmd).returncode
        if cmd[0] == "sed":
            emit("hosts_changed"); emit("reset", new_size=world())
        save(); sys.exit(rc)
    elif sub in ("stop", "kill"):
        down(args[-1])
    elif sub == "start":
        up(args[-1])
    elif sub == "up":
        pass  # the spare starts; it joins when the hostfile names it
elif argv[0] == "kill":
    down(argv[-1].replace("cid-", ""))
elif argv[0] == "inspect":
    fmt = argv[argv.index("-f") + 1]
    print("02:42:ac:12:00:04" if "MacAddress" in fmt else "172.18.0.1" if "Gateway" in fmt
          else "hvd-resilient:cpu" if "Config.Image" in fmt else "hvd-resilient_default")
elif argv[0] == "exec":  # the interface with that MAC address
    print(state.get("iface", "eth0"))
elif argv[0] == "run" and "NET_ADMIN" in argv:  # sh -c SCRIPT sh OLD NEW GATEWAY
    state["iface"] = argv[-2]
elif argv[0] == "network" and argv[1] == "disconnect":
    down(argv[-1].replace("cid-", ""))
elif argv[0] == "network" and argv[1] == "connect":
    state["iface"] = "eth1"  # as Docker names a re-connected interface
    up(argv[-1].replace("cid-", ""))
save()
'''


def run_chaos(tmp_path: Path, script: str, *args: str, silent: bool = False,
              report: bool = False):
    shared = tmp_path / "shared"
    (shared / "runs" / "digits").mkdir(parents=True)
    (shared / "hosts").write_text("".join(f"{w}:1\n" for w in DEFAULT_WORKERS))
    (shared / "runs" / "digits" / "events.jsonl").write_text("".join(
        json.dumps({"ts": 0, "event": e, "rank": 0, "size": 3, "step": 0}) + "\n"
        for e in ("start", "commit")))
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    fake = bin_dir / "docker"
    fake.write_text(FAKE_DOCKER.replace("/usr/bin/env python3", sys.executable, 1))
    fake.chmod(0o755)
    env = {"PATH": f"{bin_dir}:/usr/bin:/bin", "FAKE_SHARED": str(shared),
           "FAKE_LOG": str(tmp_path / "docker.log"), "CHAOS_TIMEOUT": "2", "HOME": str(tmp_path)}
    if silent:
        env["FAKE_SILENT"] = "1"
    if report:
        env["FAKE_REPORT"] = "1"
    r = subprocess.run([str(DOCKER / "chaos" / script), *args], env=env, capture_output=True,
                       text=True, timeout=60)
    return r, (tmp_path / "docker.log").read_text(), shared


@pytest.mark.parametrize(("script", "args", "calls"), [
    ("stop-worker.sh", (), ["stop worker-2", "start worker-2"]),
    ("kill-worker.sh", (), ["kill cid-worker-1", "start worker-1"]),
    ("disconnect-worker.sh", (), ["network disconnect hvd-resilient_default cid-worker-3",
                                  "network connect --alias worker-3 hvd-resilient_default "
                                  "cid-worker-3",
                                  "run --rm --network container:cid-worker-3 --cap-add "
                                  "NET_ADMIN hvd-resilient:cpu sh -c"]),
    ("edit-hosts.sh", (), ["sed -i /^worker-3[:[:space:]]/d /shared/hosts",
                           "up -d --wait worker-4"]),
    ("s3-outage.sh", ("0",), ["stop seaweedfs", "start seaweedfs"]),
])
def test_chaos_scenario_runs_through(tmp_path: Path, script: str, args: tuple, calls: list):
    r, log, shared = run_chaos(tmp_path, script, *args)
    assert r.returncode == 0, r.stdout + r.stderr
    for call in calls:
        assert call in log, f"{script} did not run `docker ... {call}`:\n{log}"
    assert "[chaos" in r.stdout and "ok: '" in r.stdout
    assert "events so far" in r.stdout  # the report fallback ran
    assert re.search(r"^ +1 start$", r.stdout, re.M), r.stdout
    assert "compose version" in log, "the Compose command is detected"
    if script == "edit-hosts.sh":
        assert (shared / "hosts").read_text().split() == [
            "worker-1:1", "worker-2:1", "worker-3:1", "worker-4:1"]
    if script == "disconnect-worker.sh":  # the interface got its name back
        state = json.loads((shared / ".fake-state.json").read_text())
        assert state["iface"] == "eth0" and "rename worker-3's interface eth1 back to eth0" \
            in r.stdout, r.stdout


def test_chaos_scenario_fails_when_the_job_does_not_react(tmp_path: Path):
    r, _, _ = run_chaos(tmp_path, "stop-worker.sh", silent=True)
    assert r.returncode == 1
    assert "FAIL: no 'reset' event" in r.stdout


def test_chaos_scenario_ends_with_the_real_report(tmp_path: Path):
    """Where the image has `hvd-resilient report`, the scenario ends with its text."""
    r, log, _ = run_chaos(tmp_path, "stop-worker.sh", report=True)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "hvd-resilient report /shared/runs/digits --no-plot" in log
    assert "failures" in r.stdout and "events so far" not in r.stdout
