"""Reading rendered Kubernetes objects: label selectors, NetworkPolicy reachability, quantities.

Just enough of the Kubernetes semantics for tests/deploy to assert on what `kubectl kustomize`
produced; nothing here talks to a cluster.
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

Obj = dict[str, Any]
COMPONENT = "app.kubernetes.io/component"
_QUANTITY = re.compile(r"^([0-9.]+)([a-zA-Z]*)$")
_SUFFIX = {
    "": 1.0,
    "m": 1e-3,
    "k": 1e3,
    "M": 1e6,
    "G": 1e9,
    "T": 1e12,
    "Ki": 2.0**10,
    "Mi": 2.0**20,
    "Gi": 2.0**30,
    "Ti": 2.0**40,
}


def parse_quantity(q: str | int) -> float:
    """A resource quantity ("500m", "2", "96Gi") as a number of base units."""
    match = _QUANTITY.match(str(q))
    assert match and match.group(2) in _SUFFIX, f"unparsed quantity {q!r}"
    return float(match.group(1)) * _SUFFIX[match.group(2)]


def flag(args: list[str], name: str) -> str | None:
    """The value of `name` in an argv written as `--flag=value` or `--flag value`."""
    for i, arg in enumerate(args):
        if arg == name and i + 1 < len(args):
            return args[i + 1]
        if arg.startswith(name + "="):
            return arg[len(name) + 1 :]
    return None


def selector_matches(selector: Obj, labels: dict[str, str]) -> bool:
    """metav1.LabelSelector semantics; an empty selector matches every pod."""
    if any(labels.get(k) != v for k, v in selector.get("matchLabels", {}).items()):
        return False
    for expr in selector.get("matchExpressions", []):
        key, op, values = expr["key"], expr["operator"], expr.get("values", [])
        ok = {
            "In": key in labels and labels[key] in values,
            "NotIn": labels.get(key) not in values,
            "Exists": key in labels,
            "DoesNotExist": key not in labels,
        }[op]
        if not ok:
            return False
    return True


def peer_roles(peer: Obj, role_labels: dict[str, dict[str, str]]) -> set[str] | None:
    """Roles a NetworkPolicy `from` peer admits; None when it admits pods or addresses beyond
    this namespace's pods (a namespaceSelector, an ipBlock)."""
    if peer.keys() != {"podSelector"}:
        return None
    return {role for role, labels in role_labels.items() if selector_matches(peer["podSelector"], labels)}


def _covers(ports: list[Obj] | None, port: int, named: dict[str, int]) -> bool:
    if not ports:
        return True
    for p in ports:
        if "port" not in p:
            return True
        first: int = named.get(p["port"], -1) if isinstance(p["port"], str) else p["port"]
        if first <= port <= p.get("endPort", first):
            return True
    return False


def pod_spec(deployment: Obj) -> Obj:
    spec: Obj = deployment["spec"]["template"]["spec"]
    return spec


def probe_ports(probes: list[Obj]) -> set[str | int]:
    return {p[kind]["port"] for p in probes for kind in ("httpGet", "tcpSocket", "grpc") if kind in p}


@dataclass(frozen=True)
class Manifests:
    """The objects of one rendering; roles are told apart by the component label of the pods."""

    objects: tuple[Obj, ...]

    def of_kind(self, kind: str) -> list[Obj]:
        return [o for o in self.objects if o["kind"] == kind]

    def deployment(self, role: str) -> Obj:
        [deploy] = [d for d in self.of_kind("Deployment") if self.pod_labels_of(d).get(COMPONENT) == role]
        return deploy

    @staticmethod
    def pod_labels_of(deployment: Obj) -> dict[str, str]:
        labels: dict[str, str] = deployment["spec"]["template"]["metadata"]["labels"]
        return labels

    def pod_labels(self, role: str) -> dict[str, str]:
        return self.pod_labels_of(self.deployment(role))

    def role_labels(self) -> dict[str, dict[str, str]]:
        return {self.pod_labels_of(d)[COMPONENT]: self.pod_labels_of(d) for d in self.of_kind("Deployment")}

    def selects(self, obj: Obj, role: str) -> bool:
        """Whether a Service, PodDisruptionBudget or NetworkPolicy applies to `role`'s pods."""
        spec = obj["spec"]
        selector = {"matchLabels": spec["selector"]} if obj["kind"] == "Service" else spec.get("selector")
        return selector_matches(selector or spec["podSelector"], self.pod_labels(role))

    def containers(self) -> Iterator[tuple[str, Obj, bool]]:
        """(role, container, is_init) for every container of every Deployment."""
        for role in self.role_labels():
            spec = pod_spec(self.deployment(role))
            for c in spec.get("initContainers", []):
                yield role, c, True
            for c in spec["containers"]:
                yield role, c, False

    def container_ports(self, role: str) -> dict[str, int]:
        ports = pod_spec(self.deployment(role))["containers"][0]["ports"]
        return {p["name"]: p["containerPort"] for p in ports}

    def config(self) -> dict[str, str]:
        [config_map] = self.of_kind("ConfigMap")
        data: dict[str, str] = config_map["data"]
        return data

    def allowed_roles(self, role: str, port: int) -> set[str] | None:
        """Roles whose pods the NetworkPolicies let open TCP `port` on `role`'s pods; None when
        sources beyond this namespace's pods may too. Kubelet probes are outside this model."""
        policies = [
            p
            for p in self.of_kind("NetworkPolicy")
            if "Ingress" in p["spec"].get("policyTypes", ["Ingress"]) and self.selects(p, role)
        ]
        assert policies, f"no NetworkPolicy selects the {role} pods: all ingress is open"
        named = self.container_ports(role)
        allowed: set[str] = set()
        for policy in policies:
            for rule in policy["spec"].get("ingress", []):
                if not _covers(rule.get("ports"), port, named):
                    continue
                if not rule.get("from"):
                    return None
                for peer in rule["from"]:
                    roles = peer_roles(peer, self.role_labels())
                    if roles is None:
                        return None
                    allowed |= roles
        return allowed
