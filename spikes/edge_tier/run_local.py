"""Spike orchestrator: cloud SuperLink + 1 edge (SuperNode of cloud, SuperLink of clients,
edge.py process) + K client SuperNodes, on 127.0.0.1. Optional TLS + SuperNode auth on both tiers.
Samples per-connection TCP counters (ss -tinp) of the processes it started."""
import argparse, json, os, re, signal, subprocess, sys, threading, time
from pathlib import Path

VENV = Path("/work/main/.venv/bin")
HERE = Path(__file__).resolve().parent
H = "127.0.0.1"
CLOUD, CLOUD_NODE_RT, EDGE_LINK = 9500, 9501, 9510  # client SuperNodes: 9511..

ap = argparse.ArgumentParser()
ap.add_argument("--tls", action="store_true")
ap.add_argument("--clients", type=int, default=2)
ap.add_argument("--cloud-rounds", type=int, default=2)
ap.add_argument("--edge-rounds", type=int, default=3)
ap.add_argument("--dim", type=int, default=10000)
ap.add_argument("--lr", type=float, default=0.5)
ap.add_argument("--flat", action="store_true", help="clients connect to the cloud directly")
a = ap.parse_args()

W = HERE / "runs" / time.strftime("%H%M%S"); W.mkdir(parents=True)
procs: list[subprocess.Popen] = []
env0 = dict(os.environ, PATH=f"{VENV}:{os.environ['PATH']}", FLWR_TELEMETRY_ENABLED="0",
            FLWR_DISABLE_UPDATE_CHECK="1", FLWR_DISABLE_RUNTIME_DEPENDENCY_INSTALLATION="1",
            PYTHONUNBUFFERED="1", PYTHONPATH=str(HERE / "wiretap"),
            WIRETAP_DIR=str(W / "wire"), WIRETAP_PORTS=f"{CLOUD},{EDGE_LINK}")
(W / "wire").mkdir()


def home(name):
    d = W / "home" / name; d.mkdir(parents=True, exist_ok=True); return d


def start(name, cmd, home_name=None):
    env = dict(env0, FLWR_HOME=str(home(home_name or name)))
    p = subprocess.Popen(cmd, stdout=open(W / f"{name}.log", "w"), stderr=subprocess.STDOUT,
                         env=env, start_new_session=True)
    procs.append(p); print(f"started {name} pid {p.pid}", flush=True); return p


def cli(name, port, args):
    h = home(name)
    conn = f'[superlink]\ndefault = "{name}"\n\n[superlink.{name}]\naddress = "{H}:{port}"\n'
    conn += f'root-certificates = "{certs}/ca.crt"\n' if a.tls else "insecure = true\n"
    (h / "config.toml").write_text(conn)
    return subprocess.run([str(VENV / "flwr"), *args], env=dict(env0, FLWR_HOME=str(h)),
                          capture_output=True, text=True, timeout=400)


def superlink(name, port, extra=()):
    cmd = [str(VENV / "flower-superlink"), "--host", H, "--port", str(port),
           "--disable-runtime-dependency-installation", *extra]
    if a.tls:
        cmd += ["--ssl-certfile", f"{certs}/server.crt", "--ssl-keyfile", f"{certs}/server.key",
                "--ssl-ca-certfile", f"{certs}/ca.crt", "--enable-supernode-auth"]
    else:
        cmd += ["--insecure"]
    return start(name, cmd)


def supernode(name, link, port, node_config, key_i, extra=()):
    cmd = [str(VENV / "flower-supernode"), "--superlink", f"{H}:{link}", "--host", H,
           "--port", str(port), "--node-config", node_config, *extra]
    cmd += (["--root-certificates", f"{certs}/ca.crt", "--auth-supernode-private-key",
             f"{certs}/supernode-{key_i}"] if a.tls else ["--insecure"])
    return start(name, cmd)


# ---------------- traffic sampler: ss -tinp, keep the last counters of every connection ------
conns: dict[tuple, dict] = {}
stop_sampling = threading.Event()
pid_role: dict[int, str] = {}


def sample():
    pat = re.compile(r"^\d+\s+\d+\s+(\S+):(\d+)\s+(\S+):(\d+)\s+users:\(\(\"[^\"]*\",pid=(\d+)")
    while not stop_sampling.is_set():
        out = subprocess.run(["ss", "-tinpH", "state", "established", f"( dport = :{CLOUD} or dport = :{EDGE_LINK} )"], capture_output=True,
                             text=True).stdout.splitlines()
        i = 0
        while i < len(out):
            m = pat.match(out[i].replace("\t", " ")) if not out[i].startswith((" ", "\t")) else None
            info = out[i + 1] if i + 1 < len(out) and out[i + 1].startswith((" ", "\t")) else ""
            if m:
                lport, rport, pid = int(m.group(2)), int(m.group(4)), int(m.group(5))
                role = pid_role.get(pid)
                if role and rport in (CLOUD, EDGE_LINK):
                    s = re.search(r"bytes_sent:(\d+)", info); r = re.search(r"bytes_received:(\d+)", info)
                    conns[(role, lport, rport)] = {"sent": int(s.group(1)) if s else 0,
                                                   "recv": int(r.group(1)) if r else 0}
            i += 2 if info else 1
        stop_sampling.wait(0.2)


def totals():
    t: dict[str, dict] = {}
    for (role, lport, rport), v in conns.items():
        d = t.setdefault(f"{role}->{rport}", {"conns": 0, "sent": 0, "recv": 0})
        d["conns"] += 1; d["sent"] += v["sent"]; d["recv"] += v["recv"]
    return t


def ours():
    """pids of processes whose environment names this run's folder (detached SuperExec etc.)."""
    found = []
    for d in Path("/proc").iterdir():
        if d.name.isdigit() and int(d.name) != os.getpid():
            try:
                if f"WIRETAP_DIR={W}/wire".encode() in (d / "environ").read_bytes():
                    found.append(int(d.name))
            except OSError:
                pass
    return found


def stop_all():
    for p in reversed(procs):
        try: os.killpg(p.pid, signal.SIGTERM)
        except ProcessLookupError: pass
    time.sleep(3)
    for p in procs:
        try: os.killpg(p.pid, signal.SIGKILL)
        except ProcessLookupError: pass
        p.wait()
    for pid in ours():
        print("killing leftover", pid, flush=True)
        try: os.kill(pid, signal.SIGKILL)
        except ProcessLookupError: pass


certs = W / "certs"


def sec_args():
    return ["--superexec-auth-secret-file", f"{certs}/superexec.secret"] if a.tls else []

try:
    t0 = time.time()
    if a.tls:
        sys.path.insert(0, "/work/main")
        from fedhier.engines.deployment.certs import generate_certificates
        generate_certificates(certs, num_supernodes=1 + a.clients)
        (certs / "superexec.secret").write_bytes(os.urandom(32)); os.chmod(certs / "superexec.secret", 0o600)
    superlink("cloud-superlink", CLOUD)
    if not a.flat:
        superlink("edge-superlink", EDGE_LINK, ["--isolation", "process", *sec_args()])
    time.sleep(6)
    if a.tls:  # SuperNode keys: 0 = the edge's cloud-side SuperNode, 1.. = clients
        if not a.flat:
            print(cli("cloud-cli", CLOUD, ["supernode", "register", f"{certs}/supernode-0.pub", "cloud-cli"]).stdout.strip()[-200:])
        for i in range(a.clients):
            r = cli("edge-cli" if not a.flat else "cloud-cli", EDGE_LINK if not a.flat else CLOUD,
                    ["supernode", "register", f"{certs}/supernode-{i+1}.pub",
                     "edge-cli" if not a.flat else "cloud-cli"])
            print("register", i + 1, r.returncode, r.stdout.strip()[-200:], r.stderr.strip()[-200:])
    link_for_clients = CLOUD if a.flat else EDGE_LINK
    for i in range(a.clients):
        p = supernode(f"client-{i}", link_for_clients, 9511 + i,
                      f"partition-id={i} num-partitions={a.clients}", i + 1)
        pid_role[p.pid] = f"client-{i}"
    if not a.flat:
        p = supernode("edge-supernode", CLOUD, CLOUD_NODE_RT, "edge-id=0", 0, ["--isolation", "process", *sec_args()])
        pid_role[p.pid] = "edge-supernode"
        cli("edge-cli", EDGE_LINK, ["--version"])  # writes edge-cli/config.toml
        e = start("edge", [str(VENV / "python"), str(HERE / "edge.py"), "--edge-link", f"{H}:{EDGE_LINK}",
                           "--cloud-node", f"{H}:{CLOUD_NODE_RT}", "--clients", str(a.clients),
                           "--app", str(HERE / "app"), "--connection", "edge-cli",
                           *(["--ca", f"{certs}/ca.crt", "--superexec-secret", f"{certs}/superexec.secret"] if a.tls else [])], home_name="edge-cli")
        # edge.py runs `flwr run` with FLWR_HOME = its own home: point it at edge-cli's config
        pid_role[e.pid] = "edge-proc"
    threading.Thread(target=sample, daemon=True).start()
    out = W / "result.json"
    rc = "cloud-rounds=%d edge-rounds=%d dim=%d lr=%r num-edges=%d out='%s'" % (
        a.cloud_rounds, 1 if a.flat else a.edge_rounds, a.dim, a.lr, a.clients if a.flat else 1, out)
    if a.flat:  # flat: the cloud ServerApp talks to the clients; one edge round per cloud round
        rc = rc.replace("num-edges=%d" % a.clients, "num-edges=%d" % a.clients)
    r = cli("cloud-cli", CLOUD, ["run", str(HERE / "app"), "cloud-cli", "--run-config", rc, "--stream"])
    (W / "flwr-run-cloud.log").write_text(r.stdout + r.stderr)
    print("cloud flwr run rc", r.returncode, "elapsed %.1fs" % (time.time() - t0))
    time.sleep(1)
    stop_sampling.set()
    res = json.loads(out.read_text()) if out.exists() else None
    # reference: the same math in one process
    tg = [i + 1.0 for i in range(a.clients)]; n = [10 * (i + 1) for i in range(a.clients)]
    w = 0.0
    for _ in range(a.cloud_rounds):
        for _ in range(1 if a.flat else a.edge_rounds):
            w = sum(ni * (w - a.lr * (w - ti)) for ni, ti in zip(n, tg)) / sum(n)
    print("RESULT", json.dumps(res), "reference w0", w,
          "absdiff", None if res is None else abs(res["w0"] - w))
    print("TRAFFIC (client side of each connection; bytes_sent/bytes_received from tcp_info)")
    for k, v in sorted(totals().items()):
        print("  ", k, v)
    print("WIRE (in-process TCP_INFO at close / periodic; client end of each connection)")
    wire = {}
    for f in sorted((W / "wire").glob("*.json")):
        d = json.loads(f.read_text()); pid = int(f.stem)
        role = pid_role.get(pid, Path(d["argv"][0]).name + ("" if len(d["argv"]) < 2 else " " + Path(d["argv"][1]).name))
        for k, (sent, recv) in d["conns"].items():
            lp, pp = map(int, k.split(">"))
            if pp in (CLOUD, EDGE_LINK):
                t = wire.setdefault(f"{role}->{pp}", {"conns": 0, "sent": 0, "recv": 0})
                t["conns"] += 1; t["sent"] += sent; t["recv"] += recv
    for k, v in sorted(wire.items()):
        print("  ", k, v)
    (W / "traffic.json").write_text(json.dumps({"totals": totals(), "conns": {str(k): v for k, v in conns.items()}}, indent=1))
finally:
    stop_all()
    print("workdir", W)
