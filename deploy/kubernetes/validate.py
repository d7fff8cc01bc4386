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
restricted security context (init containers included), the admin port's NetworkPolicy (no
peer outside the cluster, none that is every namespace or every pod: a concrete selector), the
PrometheusRule against deploy/prometheus/sluice-rules.yaml, and for each pool with
`discovery.kubernetes` the Service it names (with a selector and the port), a Role bound to the
Deployment's ServiceAccount that lets it list and watch that namespace's EndpointSlices, and the
service-account token mounted (hence vllm-discovery/ rendered beside an overlay). For each
Redis URL of the config: a password, never written in the ConfigMap but read from the Sluice
container's environment (`url: {from_env: VAR}`), VAR composed from a Secret's value
(`redis://:$(PASSWORD)@host:port/db`, PASSWORD from a secretKeyRef); a rendered Redis behind it
that requires that same Secret's password; and the tenants' keys, limits and budgets in a
Redis of their own that evicts nothing (`noeviction`), apart from the cache's.
`--config-out` writes the rendered ConfigMap's sluice.yaml, for `sluice -t`. The config is the
ConfigMap the Sluice container's `-c` file comes from: mounted directly, or through an init
container that writes it into an emptyDir.

`--write-prometheusrule` regenerates components/monitoring/prometheusrule.yaml from the rules
file (Kustomize cannot embed a file in a custom resource).
"""

import argparse
import pathlib
import posixpath
import re
import sys
import urllib.parse

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


def config_source(pod, container):
    """Where the Sluice container's `-c` file comes from: (ConfigMap name, its key, the init
    container that writes the file or None), or an error."""
    args = container.get("args", [])
    if len(args) != 2 or args[0] != "-c":
        return f"the container must run -c <a mounted directory>/sluice.yaml, not {args}"
    directory, key = posixpath.split(args[1])
    volumes = {v["name"]: v for v in pod.get("volumes", [])}
    mounts = [
        m for m in container.get("volumeMounts", []) if m["mountPath"].rstrip("/") == directory
    ]
    if len(mounts) != 1 or mounts[0]["name"] not in volumes:
        return f"the container must run -c <a mounted directory>/sluice.yaml, not {args}"
    volume = volumes[mounts[0]["name"]]
    if "configMap" in volume:
        return volume["configMap"]["name"], key, None
    if "emptyDir" not in volume:
        return f"-c {args[1]}: its volume {volume['name']} is neither a ConfigMap nor an emptyDir"
    writers = [
        i for i in pod.get("initContainers", [])
        if any(m["name"] == volume["name"] and not m.get("readOnly") for m in i.get("volumeMounts", []))
    ]
    if len(writers) != 1:
        return f"-c {args[1]}: exactly one init container must write the emptyDir {volume['name']}"
    templates = [
        volumes[m["name"]]["configMap"]["name"] for m in writers[0].get("volumeMounts", [])
        if "configMap" in volumes.get(m["name"], {})
    ]
    if len(templates) != 1:
        return f"initContainer {writers[0]['name']} writes the config from no (or several) ConfigMap"
    return templates[0], key, writers[0]


def admits_port(rule, name, number):
    """Whether a NetworkPolicy ingress rule lets in the port of that name or number."""
    ports = rule.get("ports", [])
    if not ports:
        return True
    for port in ports:
        value = port.get("port")
        if value is None or value in (name, number):
            return True
        if isinstance(value, int) and value <= number <= port.get("endPort", value):
            return True
    return False


def concrete(selector):
    """A label selector that selects some pods or namespaces, not all (`{}`)."""
    return bool(
        selector and (selector.get("matchLabels") or selector.get("matchExpressions"))
    )


def admin_peer_errors(peers, sluice_labels):
    """The admin port (no authentication, no connection cap) is for Prometheus: each peer must
    name pods by label, and a namespace by label when it is not Sluice's own."""
    errors = []
    for peer in peers:
        namespaces, pods = peer.get("namespaceSelector"), peer.get("podSelector")
        if namespaces is not None and not concrete(namespaces):
            errors.append(
                "the admin port's peer has namespaceSelector {} (every namespace): "
                "name Prometheus's namespace by label"
            )
        if not concrete(pods):
            errors.append(
                "the admin port's peer has no concrete podSelector (every pod of "
                f"{'the selected namespaces' if namespaces is not None else 'the namespace'}): "
                "name Prometheus's pods by label"
            )
        elif (pods.get("matchLabels") or {}).items() >= sluice_labels.items():
            errors.append(
                "the admin port's peer selects Sluice's own labels (a kustomization's `labels` "
                "rewrite matchLabels: use matchExpressions), so no Prometheus reaches it"
            )
    return errors


def redis_uses(config):
    """The Redis servers the config talks to: (where in sluice.yaml, role, URL)."""
    plugins = config.get("plugins") or {}
    uses = []

    def add(where, role, section):
        if not isinstance(section, dict):
            return
        if section.get("url"):
            uses.append((f"{where}.url", role, section["url"]))
        for i, node in enumerate(section.get("cluster_nodes") or []):
            uses.append((f"{where}.cluster_nodes[{i}]", role, node))

    cache = plugins.get("cache") or {}
    if cache.get("enabled") and cache.get("store") == "redis":
        add("plugins.cache.redis", "cache", cache.get("redis"))
    tenants = plugins.get("tenants") or {}
    if tenants.get("enabled"):
        add("plugins.tenants.keys_from_redis", "key directory", tenants.get("keys_from_redis"))
        store = tenants.get("limits_store") or {}
        if store.get("kind") == "redis":
            add("plugins.tenants.limits_store.redis", "limits and budgets", store.get("redis"))
    return uses


def secret_ref(container, variable):
    """(Secret, key) that a container's environment variable comes from, or None."""
    for env in container.get("env", []):
        if env.get("name") == variable:
            ref = env.get("valueFrom", {}).get("secretKeyRef")
            return (ref["name"], ref["key"]) if ref else None
    return None


def redis_server(by_kind, host, port, home):
    """The rendered Service a Redis URL's host names, and the container behind it:
    (Service name, container or None), or None when the host is not a rendered Service."""
    labels = host.rstrip(".").split(".")
    namespace = labels[1] if len(labels) >= 2 else home
    if len(labels) >= 3 and labels[2] != "svc":
        return None
    services = [
        s for s in by_kind.get("Service", [])
        if s["metadata"]["name"] == labels[0] and namespace_of(s) == namespace
    ]
    if not services:
        return None
    service = services[0]
    name = f"Service {labels[0]}"
    selector = service["spec"].get("selector") or {}
    targets = {p.get("targetPort", p["port"]) for p in service["spec"]["ports"] if p["port"] == port}
    for kind in ("StatefulSet", "Deployment"):
        for workload in by_kind.get(kind, []):
            template = workload["spec"]["template"]
            if namespace_of(workload) != namespace or not selector or not (
                selector.items() <= (template["metadata"].get("labels") or {}).items()
            ):
                continue
            for c in template["spec"]["containers"]:
                if any({p.get("name"), p["containerPort"]} & targets for p in c.get("ports", [])):
                    return name, c
    return name, None


def redis_flags(container):
    """A Redis container's command-line configuration: flag → value."""
    words = container.get("command", []) + container.get("args", [])
    return {
        word[2:]: (words[i + 1] if i + 1 < len(words) else "")
        for i, word in enumerate(words) if word.startswith("--")
    }


def env_value(container, variable):
    """The literal value of a container's environment variable, or None."""
    for env in container.get("env", []):
        if env.get("name") == variable:
            return env.get("value")
    return None


def redis_url(where, url, sluice):
    """A Redis URL of the config as the pod will read it: (URL with the password's variable
    in place of the password, the (Secret, key) the password comes from), or an error."""
    if isinstance(url, dict) and set(url) == {"from_env"}:
        variable = url["from_env"]
        value = env_value(sluice, variable)
        if value is None:
            if secret_ref(sluice, variable):
                return None   # the whole URL in a Secret: nothing here to check
            return f"{where}: from_env {variable}, which the Sluice container does not define"
        reference = re.search(r"//:\$\((\w+)\)@", value)
        if not reference:
            return (
                f"{where}: {variable} must carry the password as $(VAR), VAR from a Secret "
                "(redis://:$(REDIS_PASSWORD)@host:port/db)"
            )
        secret = secret_ref(sluice, reference.group(1))
        if not secret:
            return f"{where}: {variable}'s password variable {reference.group(1)} is not from a Secret"
        return value, secret
    if isinstance(url, dict):
        return None   # from_file: a mounted Secret, not checked here
    shown = re.sub(r"//[^@/]*@", "//***@", url)
    try:
        has_password = bool(urllib.parse.urlsplit(url).password)
    except ValueError:
        return None   # sluice -t says why
    if has_password:
        return (
            f"{where}: the Redis password is written in the ConfigMap: read the URL from the "
            "environment ({from_env: VAR}, VAR composed from a Secret: overlays/redis/deployment.yaml)"
        )
    return (
        f"{where}: {shown} has no password: Redis must require one (url: {{from_env: VAR}}, "
        "VAR composed from a Secret)"
    )


def redis_facts(by_kind, config, home, pod, sluice):
    """Redis requires a password, Sluice knows it without a ConfigMap holding it, and nothing
    that evicts can drop the tenants' keys, limits or budgets (N14)."""
    errors = []
    servers = {}   # name → roles
    for where, role, written in redis_uses(config):
        read = redis_url(where, written, sluice)
        if read is None:
            continue
        if isinstance(read, str):
            errors.append(read)
            continue
        url, filled_from = read
        try:
            parts = urllib.parse.urlsplit(re.sub(r"\$\(\w+\)", "password", url))
            host, port = parts.hostname or "", parts.port or 6379
        except ValueError:
            continue   # sluice -t says why
        found = redis_server(by_kind, host, port, home)
        if found is None:
            continue   # a Redis outside these objects (managed): its settings are not here
        name, container = found
        servers.setdefault(name, (container, set()))[1].add(role)
        if container is None:
            errors.append(f"{where}: no rendered container serves {name}'s port {port}")
            continue
        flags = redis_flags(container)
        if "aclfile" in flags:
            continue   # users and passwords from a file: not checked here
        required = flags.get("requirepass", "")
        variable = re.fullmatch(r"\$\((\w+)\)", required)
        if not required:
            errors.append(
                f"Redis {name} requires no password: give it --requirepass $(VAR), VAR from a Secret"
            )
        elif not variable or not secret_ref(container, variable.group(1)):
            errors.append(
                f"Redis {name}: its --requirepass is written in the manifest: take it from a "
                "Secret ($(VAR), VAR from a secretKeyRef)"
            )
        elif filled_from and secret_ref(container, variable.group(1)) != filled_from:
            errors.append(
                f"{where}: Sluice's Redis password comes from Secret {'/'.join(filled_from)}, "
                f"but {name} requires Secret {'/'.join(secret_ref(container, variable.group(1)))}'s"
            )

    # Eviction. Every limits and budget key expires (a TTL), so volatile-* evicts them as
    # allkeys-* does; the key directory does not, but allkeys-* evicts it. maxmemory and its
    # policy are per instance, not per DB number.
    for name, (container, roles) in sorted(servers.items()):
        kept = sorted(roles - {"cache"})
        if container is None or not kept:
            continue
        policy = redis_flags(container).get("maxmemory-policy", "noeviction")
        if "cache" in roles:
            errors.append(
                f"the cache and the tenants' {', '.join(kept)} share Redis {name} "
                f"(maxmemory-policy {policy}; DB numbers share one maxmemory): cache writes "
                "evict them, or fail them when nothing may be evicted. Give the cache a Redis "
                "of its own"
            )
        if policy != "noeviction":
            errors.append(
                f"Redis {name} holds the tenants' {', '.join(kept)} with maxmemory-policy "
                f"{policy}, which evicts them ("
                + ("any key" if policy.startswith("allkeys") else "their keys all expire")
                + "): an evicted spend or debt lets a tenant in again. Use noeviction"
            )
    return errors


def unrestricted(container, pod_sc):
    """What `container` (in a pod whose securityContext is `pod_sc`) lacks of the restricted
    Pod Security profile."""
    sc = container.get("securityContext", {})
    restricted = {
        "runAsNonRoot": sc.get("runAsNonRoot", pod_sc.get("runAsNonRoot")) is True,
        "runAsUser non-zero": (sc.get("runAsUser", pod_sc.get("runAsUser")) or 0) > 0,
        "readOnlyRootFilesystem": sc.get("readOnlyRootFilesystem") is True,
        "allowPrivilegeEscalation false": sc.get("allowPrivilegeEscalation") is False,
        "capabilities drop ALL": sc.get("capabilities", {}).get("drop") == ["ALL"],
        "seccompProfile RuntimeDefault": sc.get("seccompProfile", pod_sc.get("seccompProfile", {})).get("type") == "RuntimeDefault",
    }
    return [what for what, ok in restricted.items() if not ok]


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

    # The config the pod reads: a ConfigMap mounted where `-c` points, or written there by an
    # init container from a ConfigMap it mounts.
    found = config_source(pod, container)
    if isinstance(found, str):
        return [found]
    config_name, key, _renderer = found
    config_maps = [c for c in by_kind.get("ConfigMap", []) if c["metadata"]["name"] == config_name]
    if len(config_maps) != 1:
        return [f"the Deployment mounts ConfigMap {config_name}, which is not rendered"]
    if key not in config_maps[0].get("data", {}):
        return [f"ConfigMap {config_name} has no {key}, the file the container's -c names"]
    config_text = config_maps[0]["data"][key]
    config = yaml.safe_load(config_text)
    if config_out:
        pathlib.Path(config_out).write_text(config_text)

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

    # The restricted profile, for Sluice and for every init container of its pod, and for
    # every container of the overlay's other Deployments (the monitoring component's collector).
    pod_sc = pod.get("securityContext", {})
    for c, prefix in [(container, "")] + [
        (i, f"initContainer {i['name']}: ") for i in pod.get("initContainers", [])
    ]:
        errors += [f"{prefix}securityContext: {what}" for what in unrestricted(c, pod_sc)]
    for other in by_kind.get("Deployment", []):
        name = other["metadata"]["name"]
        if name == "sluice":
            continue
        other_pod = other["spec"]["template"]["spec"]
        for c in other_pod.get("containers", []) + other_pod.get("initContainers", []):
            errors += [
                f"Deployment {name}, container {c['name']}: securityContext: {what}"
                for what in unrestricted(c, other_pod.get("securityContext", {}))
            ]
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
            if not admits_port(rule, "admin", admin_port):
                continue
            peers = rule.get("from", [])
            name = policy["metadata"]["name"]
            if not peers or any("ipBlock" in peer for peer in peers):
                errors.append(f"NetworkPolicy {name} lets the admin port in from outside the cluster")
                continue
            errors += [f"NetworkPolicy {name}: {e}" for e in admin_peer_errors(peers, labels)]

    errors += discovery_facts(by_kind, config, deployment, pod)
    errors += redis_facts(by_kind, config, namespace_of(deployment), pod, container)

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
