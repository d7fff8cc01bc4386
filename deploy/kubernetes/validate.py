#!/usr/bin/env python3
"""Validates rendered Kubernetes objects offline, and checks the facts Sluice depends on.

    kubectl kustomize deploy/kubernetes/overlays/production > rendered.yaml
    python3 deploy/kubernetes/validate.py rendered.yaml [--config-out sluice.yaml]
    python3 deploy/kubernetes/validate.py --write-prometheusrule

Core kinds are validated, strictly (unknown fields are errors), against the Kubernetes
schemas of the `kubernetes-validate` package; custom resources against the openAPIV3Schema of
the CRDs in schemas/. An object of any other kind is an error. Then Sluice's own facts: the
probes, the grace period against sluice.yaml's, the restricted security context, the admin
port's NetworkPolicy, and the PrometheusRule against deploy/prometheus/sluice-rules.yaml.
`--config-out` writes the rendered ConfigMap's sluice.yaml, for `sluice -t`.

`--write-prometheusrule` regenerates components/monitoring/prometheusrule.yaml from the rules
file (Kustomize cannot embed a file in a custom resource).
"""

import argparse
import pathlib
import sys

import jsonschema
import kubernetes_validate
import yaml

HERE = pathlib.Path(__file__).resolve().parent
RULES = HERE.parent / "prometheus" / "sluice-rules.yaml"
PROMETHEUS_RULE = HERE / "components" / "monitoring" / "prometheusrule.yaml"
KUBERNETES_VERSION = "1.32.0"
CRDS = {
    ("keda.sh/v1alpha1", "ScaledObject"): "keda.sh_scaledobjects.yaml",
    ("monitoring.coreos.com/v1", "ServiceMonitor"): "monitoring.coreos.com_servicemonitors.yaml",
    ("monitoring.coreos.com/v1", "PrometheusRule"): "monitoring.coreos.com_prometheusrules.yaml",
}
CORE_KINDS = {
    "ConfigMap", "Deployment", "HorizontalPodAutoscaler", "NetworkPolicy",
    "PodDisruptionBudget", "Secret", "Service", "ServiceAccount", "StatefulSet",
}


def prometheus_rule():
    groups = yaml.safe_load(RULES.read_text())["groups"]
    return {
        "apiVersion": "monitoring.coreos.com/v1",
        "kind": "PrometheusRule",
        "metadata": {"name": "sluice"},
        "spec": {"groups": groups},
    }


def crd_schema(api_version, kind):
    crd = yaml.safe_load((HERE / "schemas" / CRDS[(api_version, kind)]).read_text())
    group = crd["spec"]["group"]
    for version in crd["spec"]["versions"]:
        if f"{group}/{version['name']}" == api_version:
            return version["schema"]["openAPIV3Schema"]
    raise SystemExit(f"schemas/{CRDS[(api_version, kind)]} has no {api_version}")


def openapi_to_jsonschema(node):
    """Kubernetes' OpenAPI dialect as JSON Schema: int-or-string, and no unknown fields where
    the CRD does not preserve them (the API server prunes them; here they are mistakes)."""
    if isinstance(node, list):
        return [openapi_to_jsonschema(item) for item in node]
    if not isinstance(node, dict):
        return node
    node = {key: openapi_to_jsonschema(value) for key, value in node.items()}
    if node.pop("x-kubernetes-int-or-string", False):
        node.pop("type", None)
        node["anyOf"] = [{"type": "integer"}, {"type": "string"}]
    if (
        node.get("type") == "object"
        and "properties" in node
        and not node.get("x-kubernetes-preserve-unknown-fields")
        and "additionalProperties" not in node
    ):
        node["additionalProperties"] = False
    return node


def validate_object(obj):
    api_version, kind = obj.get("apiVersion"), obj.get("kind")
    name = f"{kind}/{obj.get('metadata', {}).get('name')}"
    if (api_version, kind) in CRDS:
        schema = openapi_to_jsonschema(crd_schema(api_version, kind))
        # metadata is the API server's, not the CRD's: check it is an object with a name.
        schema.setdefault("properties", {})["metadata"] = {
            "type": "object", "required": ["name"], "properties": {"name": {"type": "string"}},
        }
        errors = sorted(
            jsonschema.Draft7Validator(schema).iter_errors(obj), key=lambda e: list(e.path)
        )
        return [f"{name}: {'.'.join(map(str, e.path))}: {e.message}" for e in errors]
    if kind not in CORE_KINDS:
        return [f"{name}: no schema for {api_version} {kind}"]
    try:
        kubernetes_validate.validate(obj, KUBERNETES_VERSION, strict=True)
    except kubernetes_validate.ValidationError as error:
        path = ".".join(map(str, error.path))
        return [f"{name}: {path}: {error.message}"]
    return []


def seconds(duration):
    return int(duration)


def check_facts(objects, config_out):
    errors = []
    by_kind = {}
    for obj in objects:
        by_kind.setdefault(obj["kind"], []).append(obj)
    deployments = [d for d in by_kind.get("Deployment", []) if d["metadata"]["name"] == "sluice"]
    if len(deployments) != 1:
        return ["exactly one Deployment `sluice` expected"]
    deployment = deployments[0]
    pod = deployment["spec"]["template"]["spec"]
    container = next(c for c in pod["containers"] if c["name"] == "sluice")
    ports = {p["name"]: p["containerPort"] for p in container["ports"]}

    # The config the pod mounts.
    config_name = next(v["configMap"]["name"] for v in pod["volumes"] if v["name"] == "config")
    config_maps = [c for c in by_kind.get("ConfigMap", []) if c["metadata"]["name"] == config_name]
    if len(config_maps) != 1:
        return [f"the Deployment mounts ConfigMap {config_name}, which is not rendered"]
    config_text = config_maps[0]["data"]["sluice.yaml"]
    config = yaml.safe_load(config_text)
    if config_out:
        pathlib.Path(config_out).write_text(config_text)
    mount = next(m for m in container["volumeMounts"] if m["name"] == "config")["mountPath"]
    if container["args"] != ["-c", f"{mount}/sluice.yaml"]:
        errors.append(f"the container must run -c {mount}/sluice.yaml, not {container['args']}")

    admin_port = int(config["admin"]["address"].rsplit(":", 1)[1])
    proxy_port = int(config["listeners"][0]["address"].rsplit(":", 1)[1])
    if ports.get("admin") != admin_port or ports.get("http") != proxy_port:
        errors.append(f"container ports {ports} differ from sluice.yaml's {proxy_port}/{admin_port}")
    for probe, path in (("readinessProbe", "/readyz"), ("livenessProbe", "/healthz")):
        get = container.get(probe, {}).get("httpGet", {})
        if get.get("path") != path or get.get("port") not in ("admin", admin_port):
            errors.append(f"{probe} must GET {path} on the admin port, not {get}")

    # Grace: the pod is killed only after preStop and Sluice's whole drain.
    pingora = config.get("pingora", {})
    drain = pingora.get("grace_period_seconds", 60) + pingora.get(
        "graceful_shutdown_timeout_seconds", 5
    )
    pre_stop = container.get("lifecycle", {}).get("preStop", {}).get("sleep", {}).get("seconds", 0)
    grace = pod.get("terminationGracePeriodSeconds", 30)
    if pre_stop < 1:
        errors.append("preStop must sleep while endpoints drop the pod (the image has no shell)")
    if grace < pre_stop + drain:
        errors.append(
            f"terminationGracePeriodSeconds {grace} < preStop {pre_stop} + Sluice's drain {drain}"
        )

    # The restricted profile.
    pod_sc, sc = pod.get("securityContext", {}), container.get("securityContext", {})
    restricted = {
        "runAsNonRoot": sc.get("runAsNonRoot", pod_sc.get("runAsNonRoot")) is True,
        "runAsUser non-zero": (sc.get("runAsUser", pod_sc.get("runAsUser")) or 0) > 0,
        "readOnlyRootFilesystem": sc.get("readOnlyRootFilesystem") is True,
        "allowPrivilegeEscalation false": sc.get("allowPrivilegeEscalation") is False,
        "capabilities drop ALL": sc.get("capabilities", {}).get("drop") == ["ALL"],
        "seccompProfile RuntimeDefault": sc.get("seccompProfile", pod_sc.get("seccompProfile", {})).get("type") == "RuntimeDefault",
        "no service account token": pod.get("automountServiceAccountToken") is False,
    }
    errors += [f"securityContext: {what}" for what, ok in restricted.items() if not ok]
    writable = {m["mountPath"] for m in container["volumeMounts"] if not m.get("readOnly")}
    for path in (pingora.get("pid_file"), pingora.get("upgrade_sock")):
        if path and not any(path.startswith(w.rstrip("/") + "/") for w in writable):
            errors.append(f"{path} is on the read-only root: mount a volume there")

    # The admin port is reachable from inside the cluster only.
    labels = deployment["spec"]["template"]["metadata"]["labels"]
    policies = [
        p for p in by_kind.get("NetworkPolicy", [])
        if p["spec"]["podSelector"].get("matchLabels", {}).items() <= labels.items()
        and p["spec"]["podSelector"].get("matchLabels")
    ]
    if not policies:
        errors.append("no NetworkPolicy selects Sluice's pods")
    for policy in policies:
        for rule in policy["spec"].get("ingress", []):
            rule_ports = {p.get("port") for p in rule.get("ports", [])}
            if not rule_ports or rule_ports & {"admin", admin_port}:
                peers = rule.get("from", [])
                if not peers or any("ipBlock" in peer for peer in peers):
                    errors.append(
                        f"NetworkPolicy {policy['metadata']['name']} lets the admin port in from outside the cluster"
                    )

    # prometheus-operator loads exactly the shipped rules.
    for rule in by_kind.get("PrometheusRule", []):
        if rule["spec"] != prometheus_rule()["spec"]:
            errors.append(
                "PrometheusRule differs from deploy/prometheus/sluice-rules.yaml: "
                "run deploy/kubernetes/validate.py --write-prometheusrule"
            )
    return errors


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("rendered", nargs="?", help="output of kubectl kustomize")
    parser.add_argument("--config-out", help="write the ConfigMap's sluice.yaml here")
    parser.add_argument("--schemas-only", action="store_true", help="skip Sluice's facts")
    parser.add_argument("--write-prometheusrule", action="store_true")
    args = parser.parse_args()
    if args.write_prometheusrule:
        PROMETHEUS_RULE.write_text(
            "# Generated from deploy/prometheus/sluice-rules.yaml by\n"
            "#   python3 deploy/kubernetes/validate.py --write-prometheusrule\n"
            "# (tests/deploy_kubernetes.rs fails when the two differ). Edit the rules file.\n"
            + yaml.safe_dump(prometheus_rule(), sort_keys=False, width=100)
        )
        return 0
    if not args.rendered:
        parser.error("give the rendered objects, or --write-prometheusrule")
    objects = [o for o in yaml.safe_load_all(pathlib.Path(args.rendered).read_text()) if o]
    errors = [e for obj in objects for e in validate_object(obj)]
    if not args.schemas_only and not errors:
        errors = check_facts(objects, args.config_out)
    for error in errors:
        print(error, file=sys.stderr)
    kinds = sorted({o["kind"] for o in objects})
    print(f"{len(objects)} objects ({', '.join(kinds)}): {'invalid' if errors else 'valid'}")
    return 1 if errors else 0


if __name__ == "__main__":
    sys.exit(main())
