#!/usr/bin/env python3
"""Validates rendered Kubernetes objects offline, and checks the facts Sluice depends on.

    kubectl kustomize deploy/kubernetes/overlays/production > rendered.yaml
    kubectl kustomize deploy/kubernetes/vllm-discovery > vllm.yaml
    python3 deploy/kubernetes/validate.py rendered.yaml vllm.yaml [--config-out sluice.yaml]
    python3 deploy/kubernetes/validate.py --write-prometheusrule

Core kinds are validated, strictly (unknown fields are errors), against the Kubernetes
schemas of the `kubernetes-validate` package; custom resources against the openAPIV3Schema of
the CRDs in schemas/. An object of any other kind is an error. Then Sluice's own facts, over
the objects of every file given: the probes, the grace period against sluice.yaml's, the
restricted security context, the admin port's NetworkPolicy, the PrometheusRule against
deploy/prometheus/sluice-rules.yaml, and for each pool with `discovery.kubernetes` the
Service it names (with a selector and the port), a Role bound to the Deployment's
ServiceAccount that lets it list and watch that namespace's EndpointSlices, and the
service-account token mounted (hence vllm-discovery/ rendered beside an overlay).
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
    "PodDisruptionBudget", "Role", "RoleBinding", "Secret", "Service", "ServiceAccount",
    "StatefulSet",
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


def namespace_of(obj):
    return obj.get("metadata", {}).get("namespace")


def grants(rule, group, resource, verbs):
    """Whether an RBAC rule allows `verbs` on `resource` of API `group`."""
    return (
        ({group, "*"} & set(rule.get("apiGroups", [])))
        and ({resource, "*"} & set(rule.get("resources", [])))
        and ("*" in rule.get("verbs", []) or verbs <= set(rule.get("verbs", [])))
    )


def discovery_facts(by_kind, config, deployment, pod):
    """What the pools' discovery sources need from the cluster: the ServiceAccount, its token,
    its right to list and watch EndpointSlices where a `kubernetes` pool looks, and Services
    that select pods and carry the port; a `dns` name of a rendered Service is headless."""
    errors = []
    home = namespace_of(deployment)   # None: the base, whose namespace the overlay sets
    account = pod.get("serviceAccountName", "default")
    accounts = [
        a for a in by_kind.get("ServiceAccount", [])
        if a["metadata"]["name"] == account and namespace_of(a) == home
    ]
    if account != "default" and not accounts:
        errors.append(f"the Deployment's serviceAccountName {account} is not rendered")
    mounted = pod.get(
        "automountServiceAccountToken",
        accounts[0].get("automountServiceAccountToken", True) if accounts else True,
    )
    pools = [p for p in config.get("pools", []) if isinstance(p.get("discovery"), dict)]
    watching = [
        (p["name"], p["discovery"]["kubernetes"]) for p in pools if "kubernetes" in p["discovery"]
    ]
    needs_token = any(not k.get("kubeconfig") for _, k in watching)
    if needs_token and mounted is not True:
        errors.append(
            "kubernetes discovery reads EndpointSlices with the service-account token: "
            "automountServiceAccountToken must be true"
        )
    if not needs_token and mounted is not False:
        errors.append("securityContext: no service account token (no pool watches Kubernetes)")

    def in_namespace(kind, name, namespace):
        return [
            o for o in by_kind.get(kind, [])
            if o["metadata"]["name"] == name and namespace_of(o) == namespace
        ]

    for pool, source in watching:
        if source.get("kubeconfig"):
            continue   # another cluster's credentials: nothing here to check
        namespace = source.get("namespace") or home
        shown = namespace or "<Sluice's namespace>"
        where = f"{shown}/{source['service']}"
        services = in_namespace("Service", source["service"], namespace)
        if not services:
            errors.append(f"pool {pool}: its Service {where} is not rendered")
        for service in services:
            spec = service["spec"]
            if not spec.get("selector"):
                errors.append(f"pool {pool}: Service {where} has no selector, so no EndpointSlices")
            # A port by name is the slices' name for it, the Service's port name.
            port = source["port"]
            if isinstance(port, str) and port not in {p.get("name") for p in spec["ports"]}:
                errors.append(f"pool {pool}: Service {where} has no port named {port}")
        allowed = False
        for binding in by_kind.get("RoleBinding", []):
            if namespace_of(binding) != namespace:
                continue
            bound = any(
                s.get("kind") == "ServiceAccount" and s.get("name") == account
                and (home is None or s.get("namespace", namespace) == home)
                for s in binding.get("subjects", [])
            )
            ref = binding["roleRef"]
            scope = namespace if ref["kind"] == "Role" else None   # a ClusterRole has none
            roles = in_namespace(ref["kind"], ref["name"], scope)
            if bound and any(
                grants(rule, "discovery.k8s.io", "endpointslices", {"list", "watch"})
                for role in roles for rule in role.get("rules", [])
            ):
                allowed = True
        if not allowed:
            errors.append(
                f"pool {pool}: no rendered Role in namespace {shown} lets "
                f"ServiceAccount {account} list and watch discovery.k8s.io endpointslices "
                "(render deploy/kubernetes/vllm-discovery with it)"
            )

    # A `dns` name of a rendered Service: headless, or it answers one address, not the pods.
    for p in pools:
        name = p["discovery"].get("dns", {}).get("name", "")
        labels = name.rstrip(".").split(".")
        if len(labels) >= 3 and labels[2] == "svc":
            for service in in_namespace("Service", labels[0], labels[1]):
                if service["spec"].get("clusterIP") != "None":
                    errors.append(
                        f"pool {p['name']}: {name} is not a headless Service (clusterIP: None), "
                        "so it answers one address for every pod"
                    )
    return errors


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

    errors += discovery_facts(by_kind, config, deployment, pod)

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
    parser.add_argument(
        "rendered", nargs="*", help="output of kubectl kustomize (several: checked together)"
    )
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
    objects = [
        o for path in args.rendered for o in yaml.safe_load_all(pathlib.Path(path).read_text()) if o
    ]
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
