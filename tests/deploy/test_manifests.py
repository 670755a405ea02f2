"""Render every kustomize overlay under deploy/k8s and check what issue 5 asks of it.

Each case is rendered once per test process with `kubectl kustomize`; every object is validated
against the Kubernetes OpenAPI schemas in strict mode (kubernetes-validate, no cluster needed) and
the deployment invariants are asserted on the rendered objects, not on the source files.
"""

from __future__ import annotations

import functools
import os
import re
import shutil
import subprocess
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import kubernetes_validate
import pytest
import tomllib
import yaml

from tests.deploy.k8s import (
    Manifests,
    flag,
    parse_quantity,
    pod_spec,
    probe_ports,
    selector_matches,
)

REPO = Path(__file__).resolve().parents[2]
K8S = REPO / "deploy" / "k8s"
KUBECTL = shutil.which("kubectl")
# The oldest release we target (gRPC probes are GA since 1.27) and the newest schema bundled.
K8S_VERSIONS = ("1.29.0", kubernetes_validate.latest_version())
WORKERS = ("prefill", "decode")
ROLES = ("coordinator", *WORKERS)
STANDARD_LABELS = (
    "app.kubernetes.io/name",
    "app.kubernetes.io/instance",
    "app.kubernetes.io/component",
    "app.kubernetes.io/part-of",
    "app.kubernetes.io/version",
    "app.kubernetes.io/managed-by",
)
GPU_RESOURCE = "nvidia.com/gpu"
RDMA_RESOURCE = "rdma/ib"
MIN_STARTUP_BUDGET_S = 300


@dataclass(frozen=True)
class Case:
    """One rendering: an overlay plus optional components from deploy/k8s/components."""

    overlay: str
    components: tuple[str, ...] = ()

    @property
    def name(self) -> str:
        return "+".join((self.overlay, *self.components))

    @property
    def gpu(self) -> bool:
        return self.overlay == "gpu-rdma"


CASES = (Case("cpu"), Case("gpu-rdma"), Case("gpu-rdma", ("autoscaling",)))
GPU_CASES = [c for c in CASES if c.gpu]


@functools.cache
def render(case: Case) -> Manifests:
    if KUBECTL is None:
        pytest.skip("kubectl is not on PATH: cannot render deploy/k8s (install kubectl >= 1.27)")
    with tempfile.TemporaryDirectory() as tmp:
        target = K8S / "overlays" / case.overlay
        if case.components:
            # kustomize refuses absolute paths; relative ones may climb out of the root.
            def rel(p: Path) -> str:
                return os.path.relpath(p, tmp)

            kustomization = {
                "apiVersion": "kustomize.config.k8s.io/v1beta1",
                "kind": "Kustomization",
                "resources": [rel(target)],
                "components": [rel(K8S / "components" / c) for c in case.components],
            }
            Path(tmp, "kustomization.yaml").write_text(yaml.safe_dump(kustomization))
            target = Path(tmp)
        out = subprocess.run(
            [KUBECTL, "kustomize", str(target)], capture_output=True, text=True, timeout=120, check=False
        )
    assert out.returncode == 0, f"kubectl kustomize {case.name} failed:\n{out.stderr}"
    return Manifests(tuple(d for d in yaml.safe_load_all(out.stdout) if d))


@pytest.fixture(params=CASES, ids=lambda c: c.name)
def case(request: pytest.FixtureRequest) -> Case:
    param: Case = request.param
    return param


@pytest.fixture
def m(case: Case) -> Manifests:
    return render(case)


def test_every_overlay_is_rendered() -> None:
    on_disk = {p.name for p in (K8S / "overlays").iterdir() if p.is_dir()}
    assert on_disk == {c.overlay for c in CASES}
    components = {p.name for p in (K8S / "components").iterdir() if p.is_dir()}
    assert components == {name for c in CASES for name in c.components}


@pytest.mark.parametrize("version", K8S_VERSIONS)
def test_every_object_validates_strictly(m: Manifests, version: str) -> None:
    errors = []
    for obj in m.objects:
        try:
            kubernetes_validate.validate(obj, version, strict=True)
        except kubernetes_validate.ValidationError as e:
            path = ".".join(str(p) for p in e.path)
            errors.append(f"{obj['kind']}/{obj['metadata']['name']} {path}: {e.message}")
        except kubernetes_validate.SchemaNotFoundError as e:
            errors.append(e.message)
    assert not errors, "\n".join(errors)


def test_roles_present_and_labeled(m: Manifests) -> None:
    for role in ROLES:
        deploy = m.deployment(role)
        template_labels = deploy["spec"]["template"]["metadata"]["labels"]
        for labels in (deploy["metadata"]["labels"], template_labels):
            assert set(STANDARD_LABELS) <= labels.keys(), role
            assert labels["app.kubernetes.io/component"] == role
        selector = deploy["spec"]["selector"]
        assert selector["matchLabels"]["app.kubernetes.io/component"] == role
        assert selector_matches(selector, template_labels)
        args = deploy["spec"]["template"]["spec"]["containers"][0]["args"]
        assert args[0] == role
    # Each pool has its own headless Service (peer discovery) and PodDisruptionBudget.
    for role in WORKERS:
        for kind in ("Service", "PodDisruptionBudget"):
            [owned] = [o for o in m.of_kind(kind) if m.selects(o, role)]
            assert [r for r in ROLES if m.selects(owned, r)] == [role], kind


def test_every_container_has_startup_liveness_and_readiness_probes(m: Manifests) -> None:
    for role in ROLES:
        spec = pod_spec(m.deployment(role))
        for c in spec.get("initContainers", []):
            assert not {"startupProbe", "livenessProbe", "readinessProbe"} & c.keys(), c["name"]
        for c in spec["containers"]:
            probes = [c["startupProbe"], c["livenessProbe"], c["readinessProbe"]]
            declared = {p["name"] for p in c["ports"]} | {p["containerPort"] for p in c["ports"]}
            assert probe_ports(probes) <= declared, role
            startup = probes[0]
            assert startup["periodSeconds"] * startup["failureThreshold"] >= MIN_STARTUP_BUDGET_S
            if role == "coordinator":
                assert all("grpc" in p for p in probes)
            else:
                assert [p["httpGet"]["path"] for p in probes] == ["/livez", "/livez", "/readyz"]


def test_every_container_has_requests_and_limits(m: Manifests, case: Case) -> None:
    containers = list(m.containers())
    assert any(init for _, _, init in containers) == (not case.gpu)  # init containers are covered
    for role, c, _ in containers:
        requests, limits = c["resources"]["requests"], c["resources"]["limits"]
        for key in ("cpu", "memory"):
            assert parse_quantity(requests[key]) <= parse_quantity(limits[key]), (role, c["name"], key)
        for key in limits.keys() - {"cpu", "memory", "ephemeral-storage"}:
            assert requests.get(key) == limits[key], (role, c["name"], key)


def test_images_are_pinned(m: Manifests, case: Case) -> None:
    variant = "cuda" if case.gpu else "cpu"
    for role, c, _ in m.containers():
        name, _, tag = c["image"].rpartition(":")
        assert name and "/" not in tag, (role, c["image"])
        assert tag != "latest" and tag.endswith(f"-{variant}"), (role, c["image"])


def test_no_privileged_containers_and_no_service_account_token(m: Manifests, case: Case) -> None:
    [account] = m.of_kind("ServiceAccount")
    assert account["automountServiceAccountToken"] is False
    for role in ROLES:
        spec = pod_spec(m.deployment(role))
        assert spec["serviceAccountName"] == account["metadata"]["name"]
        assert spec["automountServiceAccountToken"] is False
        assert spec["enableServiceLinks"] is False
        assert not any(spec.get(k) for k in ("hostNetwork", "hostPID", "hostIPC"))
    for role, c, _ in m.containers():
        sc = c["securityContext"]
        assert sc.get("privileged", False) is False
        assert sc["allowPrivilegeEscalation"] is False
        assert sc["readOnlyRootFilesystem"] is True
        assert sc["capabilities"]["drop"] == ["ALL"]
        added = sc["capabilities"].get("add", [])
        run_as = pod_spec(m.deployment(role))["securityContext"]
        if case.gpu and role in WORKERS:
            # RDMA memory registration needs IPC_LOCK, which only uid 0 can use (no ambient caps).
            assert added == ["IPC_LOCK"]
        else:
            assert added == []
            assert run_as["runAsNonRoot"] is True and run_as["runAsUser"] > 0


def test_network_policy_shape(m: Manifests) -> None:
    config = m.config()
    lo, hi = (int(p) for p in config["UCX_TCP_PORT_RANGE"].split("-"))
    serve = re.findall(
        r"kvbench serve .*--port (\d+) --control-port (\d+)", (REPO / "deploy/README.md").read_text()
    )
    kvbench_ports = [int(p) for p in serve[0]]
    worker_port = m.container_ports("prefill")
    coord_port = m.container_ports("coordinator")
    for role in WORKERS:
        assert m.allowed_roles(role, worker_port["control"]) == {"coordinator", *WORKERS}
        for port in (worker_port["transfer"], *kvbench_ports, lo, hi):
            assert m.allowed_roles(role, port) == set(WORKERS), port
        assert m.allowed_roles(role, worker_port["metrics"]) is None  # Prometheus, any namespace
    assert m.allowed_roles("coordinator", coord_port["control"]) == set(WORKERS)
    assert m.allowed_roles("coordinator", coord_port["grpc"]) is None  # the public API
    assert m.allowed_roles("coordinator", coord_port["http"]) is None  # the OpenAI-compatible API
    for role in ROLES:
        assert m.allowed_roles(role, 22) == set(), role  # default deny for anything else


def test_gpu_and_rdma_resources_only_in_the_gpu_overlay(m: Manifests, case: Case) -> None:
    for role, c, _ in m.containers():
        extended = c["resources"]["limits"].keys() - {"cpu", "memory", "ephemeral-storage"}
        expected = {GPU_RESOURCE, RDMA_RESOURCE} if case.gpu and role in WORKERS else set()
        assert extended == expected, (role, c["name"])
    memory_volumes = [
        v
        for r in ROLES
        for v in pod_spec(m.deployment(r))["volumes"]
        if v.get("emptyDir", {}).get("medium") == "Memory"
    ]
    assert len(memory_volumes) == (len(WORKERS) if case.gpu else 0)
    assert (m.config()["SPLITSERVE_TRANSFER_BACKEND"] == "ucx") == case.gpu


@pytest.mark.parametrize("case", GPU_CASES, ids=lambda c: c.name, indirect=True)
def test_gpu_overlay_mounts_model_shm_and_sets_ucx(m: Manifests) -> None:
    config = m.config()
    assert {"UCX_TLS", "UCX_NET_DEVICES", "UCX_IB_ADDR_TYPE"} <= config.keys()
    [claim] = m.of_kind("PersistentVolumeClaim")
    assert claim["spec"]["accessModes"] == ["ReadOnlyMany"]
    for role in ROLES:
        spec = pod_spec(m.deployment(role))
        volumes = {v["name"]: v for v in spec["volumes"]}
        mounts = {v["mountPath"]: v for v in spec["containers"][0]["volumeMounts"]}
        model = volumes[mounts["/models"]["name"]]
        assert model["persistentVolumeClaim"] == {"claimName": claim["metadata"]["name"], "readOnly": True}
        assert mounts["/models"]["readOnly"] is True
        if role in WORKERS:
            assert volumes[mounts["/dev/shm"]["name"]]["emptyDir"]["medium"] == "Memory"
            other = next(r for r in WORKERS if r != role)
            anti = spec["affinity"]["podAntiAffinity"]["preferredDuringSchedulingIgnoredDuringExecution"]
            assert [t["podAffinityTerm"]["topologyKey"] for t in anti] == ["kubernetes.io/hostname"]
            assert selector_matches(anti[0]["podAffinityTerm"]["labelSelector"], m.pod_labels(other))
            assert not selector_matches(anti[0]["podAffinityTerm"]["labelSelector"], m.pod_labels(role))
            [zone] = spec["affinity"]["podAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"]
            assert zone["topologyKey"] == "topology.kubernetes.io/zone"
            assert selector_matches(zone["labelSelector"], m.pod_labels(role))  # the first pod schedules


@pytest.mark.parametrize("case", [c for c in CASES if not c.gpu], ids=lambda c: c.name, indirect=True)
def test_cpu_overlay_builds_the_tiny_model_in_every_pod(m: Manifests) -> None:
    model_dir = m.config()["SPLITSERVE_MODEL"]
    for role in ROLES:
        spec = pod_spec(m.deployment(role))
        [init] = spec["initContainers"]
        assert init["args"][:2] == ["make-tiny-model", "$(SPLITSERVE_MODEL)"]
        [env] = init["env"]
        assert env["valueFrom"]["configMapKeyRef"]["key"] == "SPLITSERVE_MODEL"
        written = {v["name"] for v in init["volumeMounts"] if model_dir.startswith(v["mountPath"] + "/")}
        read = {v["name"] for v in spec["containers"][0]["volumeMounts"] if v["mountPath"] == "/models"}
        assert written == read and len(read) == 1


def test_termination_grace_exceeds_drain_timeout(m: Manifests) -> None:
    for role in ROLES:
        spec = pod_spec(m.deployment(role))
        drain = flag(spec["containers"][0]["args"], "--drain-timeout")
        assert drain is not None, role
        assert spec["terminationGracePeriodSeconds"] > float(drain), role


def test_workers_advertise_pod_ip_and_register_with_the_coordinator_service(m: Manifests) -> None:
    coordinator_args = m.deployment("coordinator")["spec"]["template"]["spec"]["containers"][0]["args"]
    control_port = int(flag(coordinator_args, "--control-port") or 0)
    assert control_port == m.container_ports("coordinator")["control"]
    [service] = [s for s in m.of_kind("Service") if m.selects(s, "coordinator")]
    service_ports = {
        p["port"] for p in service["spec"]["ports"] if p["targetPort"] in ("control", control_port)
    }
    for role in WORKERS:
        c = pod_spec(m.deployment(role))["containers"][0]
        env = {e["name"]: e for e in c["env"]}
        assert env["POD_IP"]["valueFrom"]["fieldRef"]["fieldPath"] == "status.podIP"
        assert flag(c["args"], "--advertise-host") == "$(POD_IP)"
        assert env["POD_NAME"]["valueFrom"]["fieldRef"]["fieldPath"] == "metadata.name"
        assert flag(c["args"], "--worker-id") == "$(POD_NAME)"  # unique identity on the ROUTER
        host, _, port = (flag(c["args"], "--coordinator") or "").rpartition(":")
        name, *domain = host.split(".")
        assert name == service["metadata"]["name"] and int(port) in service_ports
        if domain:
            assert domain[0] == "$(POD_NAMESPACE)" and domain[1:] in (
                [],
                ["svc"],
                ["svc", "cluster", "local"],
            )
            assert env["POD_NAMESPACE"]["valueFrom"]["fieldRef"]["fieldPath"] == "metadata.namespace"
        ports = m.container_ports(role)
        for port_flag in ("control", "transfer", "metrics"):
            assert int(flag(c["args"], f"--{port_flag}-port") or 0) == ports[port_flag]
    # KV goes pod to pod: the only Services selecting workers are headless.
    for s in m.of_kind("Service"):
        if any(m.selects(s, r) for r in WORKERS):
            assert s["spec"]["clusterIP"] == "None", s["metadata"]["name"]


def test_every_variable_reference_is_defined(m: Manifests) -> None:
    config = m.config()
    for role, c, _ in m.containers():
        defined = {e["name"] for e in c.get("env", [])}
        if c.get("envFrom"):
            defined |= config.keys()
        used = {v for a in c["args"] for v in re.findall(r"\$\((\w+)\)", a)}
        assert used <= defined, (role, c["name"], used - defined)


@pytest.mark.parametrize("case", [c for c in CASES if c.components], ids=lambda c: c.name, indirect=True)
def test_autoscalers_own_the_worker_replica_counts(m: Manifests) -> None:
    targets = {h["spec"]["scaleTargetRef"]["name"]: h for h in m.of_kind("HorizontalPodAutoscaler")}
    assert targets.keys() == {m.deployment(r)["metadata"]["name"] for r in WORKERS}
    for role in WORKERS:
        deploy = m.deployment(role)
        hpa = targets[deploy["metadata"]["name"]]
        assert "replicas" not in deploy["spec"]
        assert 1 <= hpa["spec"]["minReplicas"] <= hpa["spec"]["maxReplicas"]
        assert [metric["type"] for metric in hpa["spec"]["metrics"]] == ["Pods"]


def _dockerfile() -> Iterator[tuple[str, str]]:
    text = (REPO / "deploy" / "Dockerfile").read_text().replace("\\\n", " ")
    args = dict(re.findall(r"^ARG (\w+)=(\S*)", text, re.M))
    for line in text.splitlines():
        if line and not line.startswith("#"):
            word, _, rest = line.partition(" ")
            yield word, re.sub(r"\$\{(\w+)\}", lambda v: args.get(v.group(1), v.group(0)), rest)


def test_image_build_is_pinned_non_root_and_ships_every_package() -> None:
    instructions = list(_dockerfile())
    stages = {rest.split()[-1] for word, rest in instructions if word == "FROM" and " AS " in rest}
    for word, rest in instructions:
        if word == "FROM" and rest.split()[0] not in stages:
            image = rest.split()[0]
            assert ":" in image and not image.endswith(":latest"), image
    user = [rest for word, rest in instructions if word == "USER"][-1]
    uid = int(user.split(":")[0])
    base = yaml.safe_load((K8S / "base" / "coordinator.yaml").read_text().split("\n---\n")[0])
    assert uid == base["spec"]["template"]["spec"]["securityContext"]["runAsUser"] > 0
    assert [rest for word, rest in instructions if word == "ENTRYPOINT"] == ['["splitserve"]']
    # .dockerignore is an allowlist: it must let in every package that `pip install .` packs.
    lines = (REPO / ".dockerignore").read_text().splitlines()
    allowed = [line.strip() for line in lines if line.strip() and not line.startswith("#")]
    assert allowed[0] == "*" and {"!pyproject.toml", "!README.md", "!setup.py"} <= set(allowed)
    # the C++ CPU kernels build at image build time, against the image's torch (setup.py)
    installs = [
        rest for word, rest in instructions if word == "RUN" and "pip install --no-build-isolation ." in rest
    ]
    assert installs, "the image must build the package (and its C++ kernels) with --no-build-isolation"
    packages = tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"]["find"]
    for pattern in packages["include"]:
        assert f"!{pattern.rstrip('*')}" in allowed, pattern


def test_autoscalers_read_series_the_workers_export(m: Manifests) -> None:
    """An HPA on a metric no worker exports would never scale: check names and labels against the
    workers' real registry."""
    from engine.worker.metrics import WorkerMetrics

    metrics = WorkerMetrics("prefill", "p0")
    metrics.observe_queues({"waiting": 0, "running": 0})
    exported = {
        sample.name: sample.labels for family in metrics.registry.collect() for sample in family.samples
    }
    hpas = m.of_kind("HorizontalPodAutoscaler")
    for hpa in hpas:
        for spec in hpa["spec"]["metrics"]:
            metric = spec["pods"]["metric"]
            assert metric["name"] in exported, f"{hpa['metadata']['name']}: {metric['name']} is not exported"
            for key in metric.get("selector", {}).get("matchLabels", {}):
                assert key in exported[metric["name"]], f"{metric['name']} has no label {key}"


def _cli_flags(command: str) -> set[str]:
    from splitserve.cli import build_parser

    parser = build_parser(command)
    sub = next(a for a in parser._actions if a.dest == "command").choices[command]  # type: ignore[union-attr]
    return {s for a in sub._actions for s in a.option_strings}


def test_every_container_command_parses_with_the_real_cli(m: Manifests) -> None:
    """The manifests call `splitserve <command> --flag=...`: each flag must exist in that command."""
    from splitserve.cli import build_parser

    for role, container, _ in m.containers():
        args = [re.sub(r"\$\((\w+)\)", "x", a) for a in container.get("args", [])]
        command = args[0]
        build_parser(command).parse_args(args)  # exits (fails the test) on an unknown flag
        flags = {a.split("=")[0] for a in args[1:] if a.startswith("--")}
        assert flags <= _cli_flags(command), f"{role}/{container['name']}: {flags - _cli_flags(command)}"


def test_configmap_settings_are_worker_flags(m: Manifests) -> None:
    """Every SPLITSERVE_<FLAG> the ConfigMap sets is read by some role (else it is silently ignored)."""
    flags = _cli_flags("prefill") | _cli_flags("decode") | _cli_flags("coordinator")
    for cm in m.of_kind("ConfigMap"):
        for key in cm.get("data", {}):
            if key.startswith("SPLITSERVE_"):
                flag = "--" + key.removeprefix("SPLITSERVE_").lower().replace("_", "-")
                assert flag in flags, f"{key} matches no flag of any role"


def test_readme_kvbench_commands_parse_with_the_real_kvbench() -> None:
    """deploy/README.md's RDMA check must be runnable as written."""
    from kvtransfer.bench.cli import parse_args

    lines = re.findall(r"-- (kvbench (?:serve|run) [^&\n]*)", (REPO / "deploy/README.md").read_text())
    assert len(lines) == 2
    for line in lines:
        argv = [re.sub(r'"?\$[A-Z_]+"?', "10.0.0.5", a).strip('"') for a in line.split()[1:]]
        parse_args(argv)  # exits (fails the test) on an unknown or missing flag


def test_the_coordinator_serves_grpc_over_tls_from_a_cert_manager_secret(m: Manifests) -> None:
    spec = pod_spec(m.deployment("coordinator"))
    [c] = spec["containers"]
    args = c["args"]
    assert flag(args, "--host") == "0.0.0.0" and flag(args, "--insecure-grpc") is None
    mounts = {v["name"]: v["mountPath"] for v in c["volumeMounts"]}
    [tls] = [v for v in spec["volumes"] if v.get("secret", {}).get("secretName") == "splitserve-grpc-tls"]
    assert tls["name"] in mounts
    assert flag(args, "--tls-cert") == f"{mounts[tls['name']]}/tls.crt"  # cert-manager's key names
    assert flag(args, "--tls-key") == f"{mounts[tls['name']]}/tls.key"
    # kubelet probes cannot speak TLS: they use the plaintext health-only listener
    health = int(flag(args, "--health-port") or 0)
    assert health and health != int(flag(args, "--port") or 0)
    for probe in (c["startupProbe"], c["livenessProbe"], c["readinessProbe"]):
        assert probe["grpc"]["port"] == health
