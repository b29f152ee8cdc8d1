"""Checks of the deployment files: configs/kubernetes/*.yaml and configs/Dockerfile.

Every manifest is parsed, and the fields that make the deployment work are checked against
each other and against the egressd config embedded in the ConfigMap: native sidecar, probe
paths and ports, Prometheus annotations, the non-root security context, what the app container
can and cannot see, the Service/PDB/NetworkPolicy wiring of the gateway, and the Dockerfile's
stages. The embedded configs are validated by the real `egressd --check` and started once with
their paths moved to a temporary directory (EGRESSD_BIN; those checks skip when it is unset).
"""

import ipaddress
import os
import posixpath
import re
import shlex
import socket
import subprocess
import time
import urllib.request
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[2]
K8S = ROOT / "configs" / "kubernetes"
DOCKERFILE = ROOT / "configs" / "Dockerfile"
INSTALL_DEPS = ROOT / "scripts" / "install-deps.sh"

ADMIN_ENDPOINTS = {"/healthz", "/readyz", "/metrics"}
# Variables that replace a client's trust store (they name the bundle: roots + run CA), and
# the one that adds to Node's roots (the run CA alone).
BUNDLE_ENV = ["SSL_CERT_FILE", "REQUESTS_CA_BUNDLE", "GIT_SSL_CAINFO", "CURL_CA_BUNDLE"]
CA_ENV = ["NODE_EXTRA_CA_CERTS"]


# --- helpers ----------------------------------------------------------------------------------

def load(name):
    docs = [d for d in yaml.safe_load_all((K8S / name).read_text()) if d is not None]
    assert docs, f"{name}: no documents"
    return docs


def one(docs, kind):
    found = [d for d in docs if d["kind"] == kind]
    assert len(found) == 1, f"expected one {kind}, found {len(found)}"
    return found[0]


def pod_spec(docs):
    for d in docs:
        if d["kind"] == "Pod":
            return d["metadata"], d["spec"]
        if d["kind"] in ("Deployment", "StatefulSet", "DaemonSet", "Job"):
            return d["spec"]["template"]["metadata"], d["spec"]["template"]["spec"]
    raise AssertionError("no Pod or workload with a pod template")


def container(spec, name, where=("containers", "initContainers")):
    for key in where:
        for c in spec.get(key) or []:
            if c["name"] == name:
                return key, c
    raise AssertionError(f"no container {name!r} in {where}")


def volume(spec, name):
    for v in spec.get("volumes") or []:
        if v["name"] == name:
            return v
    raise AssertionError(f"volume {name!r} is mounted but not declared")


def host_port(addr):
    host, _, port = addr.rpartition(":")
    return host.strip("[]"), int(port)


def resolve_port(c, port):
    """A probe or Service port: a number, or the name of one of the container's ports."""
    if isinstance(port, int):
        return port
    if isinstance(port, str) and port.isdigit():
        return int(port)
    for p in c.get("ports") or []:
        if p.get("name") == port:
            return p["containerPort"]
    raise AssertionError(f"container {c['name']!r} has no port named {port!r}")


def seconds(value):
    m = re.fullmatch(r"(\d+)(ms|s|m|h)?", str(value))
    assert m, f"unparsable duration {value!r}"
    n = int(m.group(1))
    return {"ms": n / 1000, "s": n, None: n, "m": n * 60, "h": n * 3600}[m.group(2)]


def embedded_config(docs, cm_name):
    cm = [d for d in docs if d["kind"] == "ConfigMap" and d["metadata"]["name"] == cm_name]
    assert cm, f"no ConfigMap {cm_name!r}"
    text = cm[0]["data"]["egressd.yaml"]
    return text, yaml.safe_load(text)


def config_mount(spec, c):
    """The ConfigMap name and the in-container path of egressd.yaml, from args and mounts."""
    args = c.get("args") or []
    assert args[:1] == ["--config"] and len(args) == 2, f"args: {args}"
    path = args[1]
    for m in c.get("volumeMounts") or []:
        v = volume(spec, m["name"])
        if "configMap" not in v:
            continue
        if m.get("subPath"):
            if m["mountPath"] == path:
                return v["configMap"]["name"], path, m
        elif posixpath.dirname(path) == m["mountPath"].rstrip("/"):
            items = v["configMap"].get("items")
            key = posixpath.basename(path)
            if items:
                key = next(i["key"] for i in items if i["path"] == posixpath.basename(path))
            assert key == "egressd.yaml", f"{path} comes from ConfigMap key {key!r}"
            return v["configMap"]["name"], path, m
    raise AssertionError(f"{path} is not mounted from a ConfigMap")


def writable_dirs(spec, c):
    dirs = []
    for m in c.get("volumeMounts") or []:
        v = volume(spec, m["name"])
        if not m.get("readOnly") and "emptyDir" in v:
            dirs.append(m["mountPath"].rstrip("/"))
    return dirs


def under(path, dirs):
    return any(path == d or path.startswith(d + "/") for d in dirs)


def assert_hardened(c, pod):
    sc = c.get("securityContext") or {}
    assert sc.get("runAsNonRoot") is True
    assert sc.get("runAsUser") == 65532
    assert sc.get("readOnlyRootFilesystem") is True
    assert sc.get("allowPrivilegeEscalation") is False
    assert sc.get("capabilities", {}).get("drop") == ["ALL"]
    seccomp = sc.get("seccompProfile") or (pod.get("securityContext") or {}).get("seccompProfile")
    assert seccomp == {"type": "RuntimeDefault"}
    res = c.get("resources") or {}
    for kind in ("requests", "limits"):
        assert {"cpu", "memory"} <= set(res.get(kind, {})), f"resources.{kind}: {res}"


def assert_prometheus(meta, port):
    ann = meta.get("annotations") or {}
    assert ann.get("prometheus.io/scrape") == "true"
    assert ann.get("prometheus.io/port") == str(port)
    assert ann.get("prometheus.io/path") == "/metrics"


def assert_writable_paths(cfg, spec, c):
    """readOnlyRootFilesystem: everything egressd writes must be on a writable volume."""
    dirs = writable_dirs(spec, c)
    paths = {
        "admin.token_file": (cfg.get("admin") or {}).get("token_file", "var/admin.token"),
        "keys.master_key_file": (cfg.get("keys") or {}).get("master_key_file", "var/master.key"),
        "state.path": (cfg.get("state") or {}).get("path", "var/state"),
    }
    for i, run in enumerate(cfg.get("runs") or []):
        paths[f"runs[{i}].ca_cert_out"] = run.get("ca_cert_out", f"var/run-{run['id']}-ca.pem")
        if "ca_bundle_out" in run:
            paths[f"runs[{i}].ca_bundle_out"] = run["ca_bundle_out"]
    audit = (cfg.get("audit") or {}).get("path", "var/audit.jsonl")
    if audit != "-":
        paths["audit.path"] = audit
    for key, p in paths.items():
        assert p.startswith("/") and under(p, dirs), \
            f"{key} = {p} is not on a writable volume of {c['name']} ({dirs})"


# exec probes of the gateway: bash /dev/tcp to the loopback admin listener
EXEC_PROBE = re.compile(r"/dev/tcp/(?P<host>[0-9.]+)/(?P<port>\d+)\b.*'GET (?P<path>/\S*) HTTP/1\.1"
                        r"\\r\\nHost: (?P<hosthdr>[^\\]+)\\r\\n")


def probe_target(c, probe):
    """(path, port, kind) of an httpGet or bash /dev/tcp exec probe."""
    if "httpGet" in probe:
        return probe["httpGet"]["path"], resolve_port(c, probe["httpGet"]["port"]), "httpGet"
    cmd = probe["exec"]["command"]
    assert cmd[:2] == ["bash", "-c"], cmd
    m = EXEC_PROBE.search(cmd[2])
    assert m, f"unrecognised exec probe: {cmd[2]}"
    assert m.group("hosthdr") == f"{m.group('host')}:{m.group('port')}", \
        "the Host header must match the loopback address (egressd pins it)"
    assert cmd[2].rstrip().endswith('[ "$code" = 200 ]'), "the probe must require status 200"
    return m.group("path"), int(m.group("port")), "exec"


def assert_probes(c, admin_port):
    expected = {"startupProbe": "/readyz", "readinessProbe": "/readyz", "livenessProbe": "/healthz"}
    kinds = set()
    for name, path in expected.items():
        assert name in c, f"{c['name']}: no {name}"
        got_path, port, kind = probe_target(c, c[name])
        assert (got_path, port) == (path, admin_port), f"{name}: {got_path} on {port}"
        kinds.add(kind)
    return kinds


def egressd_bin():
    binary = os.environ.get("EGRESSD_BIN")
    if not binary:
        pytest.skip("EGRESSD_BIN is not set: cannot run `egressd --check` on the embedded "
                    "config (ctest sets it; or export EGRESSD_BIN=build/egressd)")
    assert Path(binary).is_file(), f"EGRESSD_BIN={binary} does not exist"
    return binary


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def relocate(cfg_text, cfg, tmp_path):
    """The embedded config with listeners on free loopback ports and absolute paths in tmp."""
    proxy, admin = free_port(), free_port()
    text = cfg_text.replace(cfg["listen"]["proxy"], f"127.0.0.1:{proxy}")
    text = text.replace(cfg["listen"]["admin"], f"127.0.0.1:{admin}")
    paths = re.findall(r"(?<=[\s:])/(?:var|run|etc)/[\w/.-]+", text)
    for prefix in sorted({posixpath.dirname(p) for p in paths}, key=len, reverse=True):
        target = tmp_path / prefix.strip("/").replace("/", "_")
        target.mkdir(exist_ok=True)
        text = re.sub(re.escape(prefix) + r"(?=/)", str(target), text)
    assert not re.search(r"[\s:]/(var|run|etc)/", text), text
    path = tmp_path / "egressd.yaml"
    path.write_text(text)
    return path, proxy, admin


class Egressd:
    def __init__(self, binary, config, admin, tmp_path):
        self.admin = admin
        self.log = open(tmp_path / "egressd.log", "w+")
        self.proc = subprocess.Popen([binary, "--config", str(config)], cwd=tmp_path,
                                     stdout=self.log, stderr=subprocess.STDOUT)

    def get(self, path):
        req = urllib.request.Request(f"http://127.0.0.1:{self.admin}{path}")
        with urllib.request.urlopen(req, timeout=5) as r:
            return r.status, r.read().decode()

    def wait_ready(self):
        deadline = time.monotonic() + 15
        while time.monotonic() < deadline:
            assert self.proc.poll() is None, self.output()
            try:
                if self.get("/readyz")[0] == 200:
                    return
            except OSError:
                pass
            time.sleep(0.05)
        raise AssertionError("egressd did not become ready:\n" + self.output())

    def output(self):
        self.log.flush()
        self.log.seek(0)
        return self.log.read()

    def stop(self):
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.log.close()
        return self.proc.returncode


# --- every manifest ---------------------------------------------------------------------------

MANIFESTS = sorted(p.name for p in K8S.glob("*.yaml"))


def test_manifest_set():
    assert {"sidecar.yaml", "gateway.yaml"} <= set(MANIFESTS)


@pytest.mark.parametrize("name", MANIFESTS)
def test_manifest_parses(name):
    for d in load(name):
        assert d.get("apiVersion") and d.get("kind"), d
        assert d["metadata"].get("name"), d
        assert "namespace" not in d["metadata"], "leave the namespace to kubectl -n"


# --- sidecar ----------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def sidecar():
    docs = load("sidecar.yaml")
    meta, spec = pod_spec(docs)
    where, c = container(spec, "egressd")
    _, app = container(spec, "app", ("containers",))
    cm_name, cfg_path, _ = config_mount(spec, c)
    text, cfg = embedded_config(docs, cm_name)
    return {"docs": docs, "meta": meta, "spec": spec, "where": where, "egressd": c, "app": app,
            "cfg_text": text, "cfg": cfg}


def test_sidecar_kinds(sidecar):
    kinds = sorted(d["kind"] for d in sidecar["docs"])
    assert kinds == ["ConfigMap", "Pod", "Secret"] or \
        kinds == ["ConfigMap", "Deployment", "Secret"]
    for d in sidecar["docs"]:
        if d["kind"] == "Deployment":
            assert d["spec"]["replicas"] == 1


def test_sidecar_is_native(sidecar):
    c = sidecar["egressd"]
    assert sidecar["where"] == "initContainers"
    assert c.get("restartPolicy") == "Always"
    assert c["image"] == "egressd:latest"
    assert c["args"] == ["--config", "/etc/egressd/egressd.yaml"]


def test_sidecar_config(sidecar):
    cfg = sidecar["cfg"]
    assert cfg["listen"]["proxy"] == "127.0.0.1:3128"
    assert cfg["listen"]["admin"] == "0.0.0.0:9901"
    assert cfg["audit"]["path"] == "-"
    runs = cfg["runs"]
    assert len(runs) == 1 and runs[0]["id"] == "app" and runs[0]["token_file"] is None
    assert runs[0]["ca_cert_out"] == "/run/egress/ca.pem"
    assert runs[0]["ca_bundle_out"] == "/run/egress/bundle.pem"
    pins = runs[0]["pins"]
    assert [p["host"] for p in pins] == ["api.github.com"]
    assert pins[0]["secret_file"] == "/var/run/secrets/github/token"


def test_sidecar_probes_and_metrics(sidecar):
    c, cfg = sidecar["egressd"], sidecar["cfg"]
    host, admin_port = host_port(cfg["listen"]["admin"])
    # kubelet httpGet probes and Prometheus connect to the pod IP: not a loopback listener.
    assert not ipaddress.ip_address(host).is_loopback
    assert assert_probes(c, admin_port) == {"httpGet"}
    assert admin_port in [p["containerPort"] for p in c["ports"]]
    assert_prometheus(sidecar["meta"], admin_port)


def test_sidecar_security(sidecar):
    spec, c = sidecar["spec"], sidecar["egressd"]
    assert spec["securityContext"]["runAsNonRoot"] is True
    assert_hardened(c, spec)
    assert_writable_paths(sidecar["cfg"], spec, c)


def test_sidecar_grace_period_covers_drain(sidecar):
    drain = seconds(sidecar["cfg"]["limits"]["drain_timeout"])
    assert drain == 25
    assert sidecar["spec"]["terminationGracePeriodSeconds"] >= drain + 5


def test_sidecar_secret_is_mounted_into_egressd_only(sidecar):
    spec, c, app = sidecar["spec"], sidecar["egressd"], sidecar["app"]
    secret = one(sidecar["docs"], "Secret")
    assert secret["type"] == "Opaque"
    assert set(secret.get("stringData") or secret.get("data")) == {"token"}
    # The file ships a placeholder, labelled so `kubectl apply -l 'placeholder!=true'` skips it.
    assert secret["stringData"]["token"].startswith("REPLACE")
    assert secret["metadata"]["labels"].get("placeholder") == "true"
    assert all(d["metadata"].get("labels", {}).get("placeholder") is None
               for d in sidecar["docs"] if d is not secret)
    secret_file = sidecar["cfg"]["runs"][0]["pins"][0]["secret_file"]
    mounts = [m for m in c["volumeMounts"] if "secret" in volume(spec, m["name"])]
    assert len(mounts) == 1
    m = mounts[0]
    assert m["readOnly"] is True
    assert m["mountPath"].rstrip("/") == posixpath.dirname(secret_file)
    v = volume(spec, m["name"])["secret"]
    assert v["secretName"] == secret["metadata"]["name"]
    assert posixpath.basename(secret_file) == "token"
    # uid 65532 reads a root-owned secret file through the pod's fsGroup
    assert spec["securityContext"].get("fsGroup") == 65532
    assert v.get("defaultMode", 0o644) & 0o040

    for m in app.get("volumeMounts") or []:
        assert "secret" not in volume(spec, m["name"]), f"app mounts secret volume {m['name']}"
        assert "projected" not in volume(spec, m["name"])
    assert not app.get("envFrom")
    for e in app.get("env") or []:
        assert "valueFrom" not in e, f"app env {e['name']} comes from {e.get('valueFrom')}"
    assert spec.get("automountServiceAccountToken") is False


def test_sidecar_app_uses_proxy_and_run_ca(sidecar):
    spec, c, app, cfg = sidecar["spec"], sidecar["egressd"], sidecar["app"], sidecar["cfg"]
    env = {e["name"]: e.get("value") for e in app["env"]}
    proxy_url = "http://" + cfg["listen"]["proxy"]
    assert env["HTTPS_PROXY"] == proxy_url and env["HTTP_PROXY"] == proxy_url
    assert set(env["NO_PROXY"].split(",")) >= {"localhost", "127.0.0.1"}
    ca = cfg["runs"][0]["ca_cert_out"]
    for name in CA_ENV:
        assert env.get(name) == ca, name
    bundle = cfg["runs"][0]["ca_bundle_out"]
    assert posixpath.dirname(bundle) == posixpath.dirname(ca)  # the same shared emptyDir
    for name in BUNDLE_ENV:
        assert env.get(name) == bundle, name

    # The CA file is on an emptyDir that egressd writes and the app mounts read-only.
    app_mounts = [m for m in app["volumeMounts"] if m["mountPath"].rstrip("/") ==
                  posixpath.dirname(ca)]
    assert len(app_mounts) == 1 and app_mounts[0]["readOnly"] is True
    shared = app_mounts[0]["name"]
    assert "emptyDir" in volume(spec, shared)
    sidecar_mounts = [m for m in c["volumeMounts"] if m["name"] == shared]
    assert len(sidecar_mounts) == 1 and not sidecar_mounts[0].get("readOnly")
    assert sidecar_mounts[0]["mountPath"].rstrip("/") == posixpath.dirname(ca)


def test_sidecar_config_is_valid(sidecar, tmp_path):
    binary = egressd_bin()
    path = tmp_path / "egressd.yaml"
    path.write_text(sidecar["cfg_text"])
    r = subprocess.run([binary, "--check", "--config", str(path)], capture_output=True,
                       text=True, timeout=30)
    assert r.returncode == 0, r.stdout + r.stderr


def test_sidecar_config_serves_probes(sidecar, tmp_path):
    """The embedded config, paths moved to tmp: /readyz, /healthz, /metrics and the run CA."""
    binary = egressd_bin()
    cfg_path, _, admin = relocate(sidecar["cfg_text"], sidecar["cfg"], tmp_path)
    d = Egressd(binary, cfg_path, admin, tmp_path)
    try:
        d.wait_ready()
        assert d.get("/healthz")[0] == 200
        status, body = d.get("/metrics")
        assert status == 200 and "egressd_requests_total" in body
        ca = tmp_path / "run_egress" / "ca.pem"
        assert ca.read_text().startswith("-----BEGIN CERTIFICATE-----")
        # The bundle: the system roots (this machine's), then that CA.
        bundle = (tmp_path / "run_egress" / "bundle.pem").read_text()
        assert bundle.endswith(ca.read_text()) and bundle.count("BEGIN CERTIFICATE") > 1
    finally:
        assert d.stop() == 0, d.output() if not d.log.closed else ""


# --- gateway ----------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def gateway():
    docs = load("gateway.yaml")
    meta, spec = pod_spec(docs)
    where, c = container(spec, "egressd")
    cm_name, _, _ = config_mount(spec, c)
    text, cfg = embedded_config(docs, cm_name)
    return {"docs": docs, "meta": meta, "spec": spec, "where": where, "egressd": c,
            "cfg_text": text, "cfg": cfg, "cm": cm_name}


def matches(selector, labels):
    return all(labels.get(k) == v for k, v in selector.items())


def test_gateway_kinds(gateway):
    kinds = sorted(d["kind"] for d in gateway["docs"])
    assert kinds == ["ConfigMap", "Deployment", "NetworkPolicy", "PodDisruptionBudget", "Service"]
    dep = one(gateway["docs"], "Deployment")
    assert dep["spec"]["replicas"] == 2
    assert matches(dep["spec"]["selector"]["matchLabels"], gateway["meta"]["labels"])
    assert gateway["where"] == "containers"
    assert gateway["egressd"]["image"] == "egressd:latest"
    assert gateway["egressd"]["args"] == ["--config", "/etc/egressd/egressd.yaml"]


def test_gateway_config(gateway):
    cfg = gateway["cfg"]
    host, port = host_port(cfg["listen"]["proxy"])
    assert (host, port) == ("0.0.0.0", 3128)
    admin_host, _ = host_port(cfg["listen"]["admin"])
    assert ipaddress.ip_address(admin_host).is_loopback, "gateway admin API must stay in the pod"
    # A run's proxy_url names the Service (its DNS name and port), not the 0.0.0.0 bind,
    # which would give sandbox pods 127.0.0.1: themselves.
    svc = one(gateway["docs"], "Service")
    adv_host, adv_port = host_port(cfg["listen"]["advertise"])
    assert adv_host.split(".")[0] == svc["metadata"]["name"], adv_host
    assert adv_host.endswith(".svc.cluster.local"), adv_host
    assert adv_port in [p["port"] for p in svc["spec"]["ports"] if p["name"] == "proxy"]
    assert cfg["state"]["backend"] == "file"
    assert "state.backend: etcd" in gateway["cfg_text"] or "backend: etcd" in gateway["cfg_text"]
    assert_writable_paths(cfg, gateway["spec"], gateway["egressd"])
    drain = seconds(cfg["limits"]["drain_timeout"])
    assert gateway["spec"]["terminationGracePeriodSeconds"] >= drain + 5


def test_gateway_probes_security_metrics(gateway):
    spec, c, cfg = gateway["spec"], gateway["egressd"], gateway["cfg"]
    _, admin_port = host_port(cfg["listen"]["admin"])
    # Loopback admin: kubelet httpGet cannot reach it, so the probes run inside the container.
    assert assert_probes(c, admin_port) == {"exec"}
    assert spec["securityContext"]["runAsNonRoot"] is True
    assert_hardened(c, spec)
    for other in spec["containers"]:
        sc = other.get("securityContext") or {}
        assert sc.get("runAsNonRoot") is True and sc.get("allowPrivilegeEscalation") is False
        assert sc.get("readOnlyRootFilesystem") is True
        assert sc.get("capabilities", {}).get("drop") == ["ALL"]

    # Prometheus scrapes the metrics gate, which forwards only the read-only endpoints to the
    # loopback admin listener.
    _, gate = container(spec, "metrics", ("containers",))
    gate_port = resolve_port(gate, "metrics")
    assert_prometheus(gateway["meta"], gate_port)
    cm = [d for d in gateway["docs"] if d["kind"] == "ConfigMap"][0]
    nginx = cm["data"]["nginx.conf"]
    assert re.search(rf"\blisten {gate_port};", nginx)
    locations = re.findall(r"location\s+(=?)\s*(\S+)\s*\{([^{}]*(?:\{[^{}]*\}[^{}]*)*)\}", nginx)
    forwarded = {path for exact, path, body in locations if "proxy_pass" in body}
    assert forwarded == ADMIN_ENDPOINTS
    for exact, path, body in locations:
        if "proxy_pass" in body:
            assert exact == "=", f"{path} must be an exact match"
            assert f"proxy_pass http://127.0.0.1:{admin_port};" in body
            assert f"proxy_set_header Host 127.0.0.1:{admin_port};" in body
            assert "limit_except GET" in body
        else:
            assert "return 404" in body
    mounts = {m["mountPath"]: m for m in gate["volumeMounts"]}
    assert mounts["/etc/nginx/nginx.conf"]["subPath"] == "nginx.conf"


def test_gateway_ports_agree(gateway):
    docs, c, cfg = gateway["docs"], gateway["egressd"], gateway["cfg"]
    labels = gateway["meta"]["labels"]
    _, proxy_port = host_port(cfg["listen"]["proxy"])
    assert proxy_port in [p["containerPort"] for p in c["ports"]]

    svc = one(docs, "Service")
    assert svc["spec"].get("type", "ClusterIP") == "ClusterIP"
    assert matches(svc["spec"]["selector"], labels)
    assert len(svc["spec"]["ports"]) == 1
    sp = svc["spec"]["ports"][0]
    assert sp["port"] == 3128
    assert resolve_port(c, sp.get("targetPort", sp["port"])) == proxy_port

    pdb = one(docs, "PodDisruptionBudget")
    assert matches(pdb["spec"]["selector"]["matchLabels"], labels)
    replicas = one(docs, "Deployment")["spec"]["replicas"]
    assert "minAvailable" in pdb["spec"] or "maxUnavailable" in pdb["spec"]
    if "minAvailable" in pdb["spec"]:
        assert 0 < pdb["spec"]["minAvailable"] < replicas

    np_ = one(docs, "NetworkPolicy")
    assert matches(np_["spec"]["podSelector"]["matchLabels"], labels)
    assert "Ingress" in np_["spec"]["policyTypes"]
    proxy_rules = []
    for rule in np_["spec"]["ingress"]:
        ports = [p["port"] for p in rule.get("ports") or []]
        assert ports, "a rule without ports would open every port"
        if proxy_port in ports or "proxy" in ports:
            proxy_rules.append(rule)
    assert len(proxy_rules) == 1
    peers = proxy_rules[0].get("from")
    assert peers, "the proxy port must not be open to everyone"
    for peer in peers:
        assert "ipBlock" not in peer
        assert peer["podSelector"]["matchLabels"] == {"egress-client": "true"}
        assert not peer["podSelector"].get("matchExpressions")


def test_gateway_config_is_valid(gateway, tmp_path):
    binary = egressd_bin()
    path = tmp_path / "egressd.yaml"
    path.write_text(gateway["cfg_text"])
    r = subprocess.run([binary, "--check", "--config", str(path)], capture_output=True,
                       text=True, timeout=30)
    assert r.returncode == 0, r.stdout + r.stderr


def test_gateway_exec_probes_work(gateway, tmp_path):
    """The exec probes, run against the embedded config (moved to tmp): 0 while up, not after."""
    binary = egressd_bin()
    cfg_path, _, admin = relocate(gateway["cfg_text"], gateway["cfg"], tmp_path)
    _, admin_port = host_port(gateway["cfg"]["listen"]["admin"])
    c = gateway["egressd"]

    def run_probe(name):
        script = c[name]["exec"]["command"][2].replace(str(admin_port), str(admin))
        return subprocess.run(["bash", "-c", script], capture_output=True, timeout=10).returncode

    d = Egressd(binary, cfg_path, admin, tmp_path)
    try:
        d.wait_ready()
        for name in ("startupProbe", "readinessProbe", "livenessProbe"):
            assert run_probe(name) == 0, name
    finally:
        assert d.stop() == 0
    assert run_probe("livenessProbe") != 0


# --- Dockerfile -------------------------------------------------------------------------------

def dockerfile_instructions():
    text = re.sub(r"\\\n", " ", DOCKERFILE.read_text())
    out = []
    for line in text.splitlines():
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        word, _, rest = line.partition(" ")
        out.append((word.upper(), rest.strip()))
    return out


def stages():
    result = []
    for word, rest in dockerfile_instructions():
        if word == "FROM":
            result.append({"from": rest, "steps": []})
        else:
            assert result, f"{word} before FROM"
            result[-1]["steps"].append((word, rest))
    return result


def apt_packages(steps):
    pkgs = []
    for word, rest in steps:
        if word != "RUN":
            continue
        for m in re.finditer(r"apt-get install ([^&;|]*)", rest):
            pkgs += [t for t in shlex.split(m.group(1)) if not t.startswith("-")]
    return pkgs


def test_dockerfile_is_multistage_debian12():
    st = stages()
    assert len(st) >= 2
    assert re.fullmatch(r"debian:12 +AS +build", st[0]["from"], re.I)
    assert st[-1]["from"] == "debian:12-slim"
    runtime = st[-1]["steps"]
    assert ("COPY", "--from=build /out/egressd /out/egressctl /usr/local/bin/") in runtime


def test_dockerfile_build_stage():
    build = stages()[0]["steps"]
    pkgs = apt_packages(build)
    script = INSTALL_DEPS.read_text()
    for p in pkgs:
        assert re.search(rf"(?<![\w.-]){re.escape(p)}(?![\w.-])", script), \
            f"{p} is not in scripts/install-deps.sh"
    runs = " ".join(rest for word, rest in build if word == "RUN")
    assert "-DEGRESS_BUILD_TESTS=OFF" in runs and "-DEGRESS_BUILD_BENCH=OFF" in runs
    assert re.search(r"cmake --build \S+ --target egressd egressctl\b", runs)


def test_dockerfile_runtime_stage():
    runtime = stages()[-1]["steps"]
    pkgs = apt_packages(runtime)
    assert pkgs, "runtime stage installs its shared libraries"
    assert not [p for p in pkgs if p.endswith("-dev")], pkgs
    assert not {"build-essential", "cmake", "gcc", "g++", "curl"} & set(pkgs)
    for lib in ("libssl3", "libnghttp2-14", "libc-ares2", "libyaml-cpp0.7", "libspdlog1.10",
                "libboost-json1.81.0", "libboost-url1.81.0", "ca-certificates"):
        assert lib in pkgs, lib
    users = [rest for word, rest in runtime if word == "USER"]
    assert users and users[-1] == "65532:65532"
    last_user = max(i for i, (w, _) in enumerate(runtime) if w == "USER")
    assert not [w for w, _ in runtime[last_user:] if w == "RUN"], "RUN after USER runs as root"
    words = dict(runtime)
    assert set(words["EXPOSE"].split()) == {"3128", "9901"}
    assert words["ENTRYPOINT"] == '["/usr/local/bin/egressd"]'
    assert words["CMD"] == '["--config", "/etc/egressd/egressd.yaml"]'


def test_dockerfile_user_matches_manifests():
    uid = stages()[-1]["steps"]
    user = [rest for word, rest in uid if word == "USER"][-1]
    for name in ("sidecar.yaml", "gateway.yaml"):
        _, spec = pod_spec(load(name))
        _, c = container(spec, "egressd")
        assert f"{c['securityContext']['runAsUser']}:{c['securityContext']['runAsGroup']}" == user


def test_dockerignore_keeps_build_dirs_out():
    ignore = (ROOT / ".dockerignore").read_text().split()
    assert {".git", "build", "build-*"} <= set(ignore)
