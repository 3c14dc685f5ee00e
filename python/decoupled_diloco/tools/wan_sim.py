"""scripts/wan-sim: the local cluster of scripts/run-local with every region behind a link of limited
rate. Run by scripts/wan-sim with the project's Python (standard library only); needs root
(network namespaces) and iproute2's `ip` and `tc`.

One network namespace per region and one for the broker, the mergers and the evaluator ("core").
Region k is joined to core by a veth pair; both ends get a token bucket (`tc ... tbf`: rate, burst,
queue limit), so a region's uplink (its learners' deltas, Kafka requests) and its downlink (new
versions, Kafka responses) are each limited to the region's rate. The core's services listen on one
address, 10.77.0.1 (on the core's loopback), which every region reaches through its own link:

    region r<k> (learners)  10.77.<k+1>.2 --veth, tbf both ways-- 10.77.<k+1>.1  core (broker, mergers,
                                                                              evaluator): 10.77.0.1

No latency is added: `netem` is not available here, and tbf's own queueing delay is the only delay
(at most `--queue` bytes at the link's rate). Everything the harness creates is named after its tag
(namespaces `<tag>-core`, `<tag>-r<k>`; interfaces `<tag>c<k>`, `<tag>r<k>`) and is removed on
exit, on Ctrl-C, on a failure, and, by a watchdog process of its own, when the harness itself is
killed (kill -9): the watchdog kills every process left in the namespaces and deletes them, which
removes the veth pairs and their queues with them. Only addresses inside these namespaces are used.

    scripts/wan-sim configs/tiny.toml --rate 20mbit                      # every region at 20 Mbit/s
    scripts/wan-sim --rate 4mbit --region-rate us=1mbit                 # the demo, one slow region
    scripts/wan-sim configs/tiny.toml --rate 20mbit --cut us@30+60      # us cut off at 30 s for 60 s
    scripts/wan-sim --dry-run ...                                       # the commands, nothing created
    scripts/wan-sim --cleanup TAG                                       # remove what a tag left

Every option of scripts/run-local works as there (learners, regions, budgets, --set). The run
folder gets wan.json (the links), wan.jsonl (the link events: up, cut, restored) and, after the
ordered stop, wan-check.json: `diloco-replay audit` and `verify` on the run's logs (exit 1 when
either fails).
"""

import argparse
import json
import os
import re
import signal
import subprocess
import sys
import time

from . import repository
from . import run_local as rl

SERVICE = "10.77.0.1"        # the core's services (broker, mergers) on the core's loopback
BROKER_PORT = 19092          # inside the core namespace, so it never meets the host's broker
RATE_RE = re.compile(r"^[0-9]+(\.[0-9]+)?(bit|kbit|mbit|gbit|bps|kbps|mbps|gbps)$")
SIZE_RE = re.compile(r"^[0-9]+(b|kb|mb|k|m)?$")


def say(message):
    print(f"wan-sim: {message}", flush=True)


def fail(message):
    print(f"wan-sim: {message}", file=sys.stderr, flush=True)
    sys.exit(1)


def sh(argv, check=True):
    result = subprocess.run(argv, capture_output=True, text=True)
    if check and result.returncode != 0:
        raise RuntimeError(f"{' '.join(argv)}: {result.stderr.strip() or result.stdout.strip()}")
    return result


class Net:
    """The namespaces, links and token buckets of one harness run, named after `tag`."""

    def __init__(self, tag, regions, rates, burst, queue):
        self.tag, self.regions, self.rates, self.burst, self.queue = tag, regions, rates, burst, queue
        self.core = f"{tag}-core"
        self.region_ns = {r: f"{tag}-r{k}" for k, r in enumerate(regions)}
        self.core_if = {r: f"{tag}c{k}" for k, r in enumerate(regions)}
        self.region_if = {r: f"{tag}r{k}" for k, r in enumerate(regions)}

    def commands(self):
        """What create() runs, in order."""
        cmds = [["ip", "netns", "add", self.core], ["ip", "-n", self.core, "link", "set", "lo", "up"],
                ["ip", "-n", self.core, "addr", "add", f"{SERVICE}/32", "dev", "lo"]]
        for k, r in enumerate(self.regions):
            ns, c, x = self.region_ns[r], self.core_if[r], self.region_if[r]
            core_addr, region_addr = f"10.77.{k + 1}.1", f"10.77.{k + 1}.2"
            tbf = ["root", "tbf", "rate", self.rates[r], "burst", self.burst, "limit", self.queue]
            cmds += [["ip", "netns", "add", ns], ["ip", "-n", ns, "link", "set", "lo", "up"],
                     ["ip", "link", "add", c, "netns", self.core, "type", "veth", "peer", "name", x, "netns", ns],
                     ["ip", "-n", self.core, "addr", "add", f"{core_addr}/30", "dev", c],
                     ["ip", "-n", ns, "addr", "add", f"{region_addr}/30", "dev", x],
                     ["ip", "-n", self.core, "link", "set", c, "up"], ["ip", "-n", ns, "link", "set", x, "up"],
                     ["ip", "-n", ns, "route", "add", f"{SERVICE}/32", "via", core_addr],
                     ["tc", "-n", ns, "qdisc", "add", "dev", x, *tbf],           # uplink of the region
                     ["tc", "-n", self.core, "qdisc", "add", "dev", c, *tbf]]    # its downlink
        return cmds

    def create(self):
        for cmd in self.commands():
            sh(cmd)

    def set_link(self, region, up):
        state = "up" if up else "down"
        sh(["ip", "-n", self.core, "link", "set", self.core_if[region], state])
        sh(["ip", "-n", self.region_ns[region], "link", "set", self.region_if[region], state])
        if up:  # a link that went down lost its route
            sh(["ip", "-n", self.region_ns[region], "route", "replace", f"{SERVICE}/32", "via",
                f"10.77.{self.regions.index(region) + 1}.1"])

    def describe(self):
        return {"tag": self.tag, "service_address": SERVICE, "core_namespace": self.core,
                "latency": "none added (no netem); tbf queueing only",
                "links": {r: {"namespace": self.region_ns[r], "interfaces": [self.core_if[r], self.region_if[r]],
                              "rate": self.rates[r], "burst": self.burst, "queue_limit": self.queue}
                          for r in self.regions}}


def namespaces_of(tag):
    out = sh(["ip", "netns", "list"], check=False).stdout
    names = [line.split()[0] for line in out.splitlines() if line.strip()]
    return [n for n in names if n == f"{tag}-core" or re.fullmatch(re.escape(tag) + r"-r[0-9]+", n)]


def remove(tag, broker_env=None):
    """Stops the broker (cleanly when it can), kills every process left in the tag's namespaces and
    deletes them; their veth pairs and queues go with them. Safe to call more than once."""
    spaces = namespaces_of(tag)
    core = f"{tag}-core"
    if broker_env and core in spaces:
        subprocess.run(["ip", "netns", "exec", core, os.path.join(repository.root(), "scripts", "broker"), "stop"],
                       env={**os.environ, **broker_env}, capture_output=True, timeout=60)
    for ns in spaces:
        for _ in range(50):
            pids = [int(p) for p in sh(["ip", "netns", "pids", ns], check=False).stdout.split()]
            if not pids:
                break
            for pid in pids:
                try:
                    os.kill(pid, signal.SIGCONT)
                    os.kill(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
            time.sleep(0.1)
        sh(["ip", "netns", "del", ns], check=False)
    return spaces


def watchdog(tag, parent, broker_dir):
    """Runs in a session of its own: when the harness dies without cleaning up (kill -9), remove
    what it created. SIGTERM from the harness (which cleaned up itself) ends it quietly."""
    signal.signal(signal.SIGTERM, lambda *_: os._exit(0))
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    while True:
        try:
            os.kill(parent, 0)
        except ProcessLookupError:
            break
        time.sleep(0.5)
    env = {"DILOCO_BROKER_DIR": broker_dir, "DILOCO_BROKER_HOST": SERVICE, "DILOCO_BROKER_PORT": str(BROKER_PORT)}
    removed = remove(tag, env)
    print(f"wan-sim watchdog: harness {parent} gone; removed {', '.join(removed) or 'nothing'}", flush=True)


class WanCluster(rl.Cluster):
    """run-local's cluster with learners in their region's namespace and the rest in the core."""

    def __init__(self, wan, *args, **kwargs):
        super().__init__(*args, **kwargs)
        rates = {r: wan.rate for r in self.regions}
        for item in wan.region_rate:
            region, _, rate = item.partition("=")
            if region not in rates:
                fail(f"--region-rate {item}: no region '{region}' in this run ({','.join(self.regions)})")
            rates[region] = rate
        if len(self.regions) > 250:
            fail("at most 250 regions")
        self.net = Net(wan.tag, self.regions, rates, wan.burst, wan.queue)
        self.cuts = [parse_cut(c, self.regions) for c in wan.cut]
        self.broker_env = {"DILOCO_BROKER_DIR": os.path.join(self.run_dir, "broker"), "DILOCO_BROKER_HOST": SERVICE,
                           "DILOCO_BROKER_PORT": str(BROKER_PORT)}
        if self.secure_dir:
            if not wan.secure_dir:
                # The run's own: the brokers' certificate must name the service address.
                common = self.secure_overrides()
                self.secure_dir = os.path.join(self.run_dir, "secure")
                self.overrides = [o for o in self.overrides if o not in common] + self.secure_overrides()
            self.broker_env["DILOCO_BROKER_SECURE"] = self.secure_dir

    def namespace_of(self, name, role):
        if role == "learner":
            return self.net.region_ns[self.region_of(self.learner_names.index(name))]
        return self.net.core

    def command(self, name, role, argv):
        return ["ip", "netns", "exec", self.namespace_of(name, role), *argv]

    def merger_args(self, name):
        return ["--bind", f"tcp://{SERVICE}:*"]

    def secure_host(self):
        return SERVICE

    def prepare_broker(self, partitions=None):
        """A broker of the run's own inside the core namespace (stopped by remove())."""
        self.prepare_secure()
        say(f"starting the Kafka broker in {self.net.core} at {SERVICE}:{BROKER_PORT}")
        broker = os.path.join(repository.root(), "scripts", "broker")
        result = subprocess.run(["ip", "netns", "exec", self.net.core, broker, "start", "--run", self.run_id,
                                 "--regions", ",".join(self.regions), "--partitions", str(partitions or self.fragments)],
                                env={**os.environ, **self.broker_env, "KAFKA_HEAP_OPTS": "-Xms256m -Xmx768m"},
                                capture_output=True, text=True)
        if result.returncode != 0:
            raise RuntimeError(f"the broker did not start in {self.net.core}:\n{result.stderr.strip()}")
        self.servers = f"{SERVICE}:{BROKER_PORT}"
        self.info["bootstrap"] = self.servers
        self.info["wan"] = self.net.describe()


class Cuts:
    """Takes regions' links down and up again at times of the run, and logs every link event."""

    def __init__(self, net, cuts, path):
        self.net, self.pending, self.path = net, sorted(cuts, key=lambda c: c[1]), path
        self.down = {}  # region -> time to restore
        self.log({"event": "links_up", "regions": net.regions})

    def log(self, record):
        with open(self.path, "a") as f:
            f.write(json.dumps({"time_us": int(time.time() * 1e6), **record}) + "\n")

    def tick(self, elapsed):
        while self.pending and elapsed >= self.pending[0][1]:
            region, start, length = self.pending.pop(0)
            self.net.set_link(region, False)
            self.down[region] = start + length
            self.log({"event": "cut", "region": region, "t": round(elapsed, 2), "seconds": length})
            say(f"{region}: link cut at {elapsed:.1f} s for {length:g} s")
        for region, until in list(self.down.items()):
            if elapsed >= until:
                self.net.set_link(region, True)
                del self.down[region]
                self.log({"event": "restored", "region": region, "t": round(elapsed, 2)})
                say(f"{region}: link restored at {elapsed:.1f} s")


def check(cluster):
    """The invariants of the finished run, from its logs while the broker still runs: diloco-replay
    audit (every delta merged once or dropped with a reason, none lost, no version skipped) and
    verify (every version rebuilds to its checksum). Writes wan-check.json; True when both pass."""
    def replay(*argv):
        return subprocess.run(["ip", "netns", "exec", cluster.net.core, os.path.join(cluster.bin_dir, "diloco-replay"),
                               "-c", os.path.join(cluster.run_dir, "config.toml"), "--bootstrap", cluster.servers,
                               *[a for o in cluster.overrides for a in ("--set", o)], *argv],
                              capture_output=True, text=True, cwd=repository.root())
    audit_run = replay("audit", "--json")
    try:
        audit = json.loads(audit_run.stdout.strip().splitlines()[-1])
    except (ValueError, IndexError):
        audit = {"ok": False, "problems": [f"diloco-replay audit failed: {audit_run.stderr.strip()[-400:]}"]}
    verify_run = replay("verify")
    result = {"audit": audit.get("ok", False), "verify": verify_run.returncode == 0,
              "problems": audit.get("problems", []) +
              ([] if verify_run.returncode == 0 else [(verify_run.stdout + verify_run.stderr).strip()[-400:]]),
              "counts": {k: v for k, v in audit.items() if k not in ("versions", "problems", "ok")}}
    with open(os.path.join(cluster.run_dir, "wan-check.json"), "w") as f:
        json.dump(result, f, indent=2)
    ok = result["audit"] and result["verify"]
    say(f"checks: audit {'pass' if result['audit'] else 'FAIL'}, verify {'pass' if result['verify'] else 'FAIL'}"
        + ("" if ok else "; " + "; ".join(result["problems"][:5])))
    return ok


def parse_cut(text, regions):
    m = re.fullmatch(r"([A-Za-z0-9_-]+)@([0-9.]+)\+([0-9.]+)", text)
    if not m or m.group(1) not in regions:
        fail(f"--cut '{text}': expected REGION@START+SECONDS with REGION one of {','.join(regions)}, e.g. us@30+60")
    return m.group(1), float(m.group(2)), float(m.group(3))


def parse_args(argv=None):
    p = argparse.ArgumentParser(prog="scripts/wan-sim", description=__doc__.split("\n\n")[0].replace("\n", " "),
                                formatter_class=argparse.RawDescriptionHelpFormatter,
                                epilog="\n\n".join(__doc__.split("\n\n")[1:]))
    p.add_argument("--rate", default="100mbit", help="every region's link rate, each direction, as tc writes it "
                                                     "(e.g. 20mbit, 512kbit; default 100mbit)")
    p.add_argument("--region-rate", action="append", default=[], metavar="REGION=RATE",
                   help="one region's rate instead of --rate (repeatable), e.g. us=1mbit")
    p.add_argument("--burst", default="32kb", help="token bucket size of each link (default 32kb)")
    p.add_argument("--queue", default="256kb", help="bytes a link queues before it drops (tbf limit; default 256kb)")
    p.add_argument("--cut", action="append", default=[], metavar="REGION@START+SECONDS",
                   help="take REGION's link down START seconds into the run for SECONDS (repeatable)")
    p.add_argument("--tag", default=f"dd{os.getpid() % 100000}",
                   help="prefix of every namespace and interface (at most 8 letters and digits; default dd<pid>)")
    p.add_argument("--no-check", action="store_true",
                   help="skip the invariant checks after the run (diloco-replay audit and verify)")
    p.add_argument("--dry-run", action="store_true", help="print the network commands, create no namespace")
    p.add_argument("--cleanup", metavar="TAG", help="remove the namespaces a harness of this tag left, and exit")
    p.add_argument("--watchdog", nargs=3, metavar=("TAG", "PID", "BROKER_DIR"), help=argparse.SUPPRESS)
    rl.add_cluster_args(p)
    return p.parse_args(argv)


def main(argv=None) -> int:
    """scripts/wan-sim: the exit status (1 when a process or a check failed)."""
    args = parse_args(argv)
    if args.watchdog:
        tag, parent, broker_dir = args.watchdog
        watchdog(tag, int(parent), broker_dir)
        return 0
    if not re.fullmatch(r"[A-Za-z0-9]{1,8}", args.cleanup or args.tag):
        fail(f"--tag '{args.cleanup or args.tag}': 1 to 8 letters and digits (interface names are at most 15 characters)")
    if os.geteuid() != 0 and not args.dry_run:
        fail("network namespaces need root: run as root, or with sudo")
    for tool in ("ip", "tc"):
        if sh(["sh", "-c", f"command -v {tool}"], check=False).returncode != 0:
            fail(f"'{tool}' is missing: install iproute2 (scripts/bootstrap does)")
    if args.cleanup:
        removed = remove(args.cleanup)
        say(f"removed {', '.join(removed) or 'nothing'}")
        return 0
    for text in [args.rate] + [r.split("=", 1)[-1] for r in args.region_rate]:
        if not RATE_RE.match(text):
            fail(f"rate '{text}': a number and a unit as tc writes it (bit, kbit, mbit, gbit), e.g. 20mbit")
    for name, text in (("--burst", args.burst), ("--queue", args.queue)):
        if not SIZE_RE.match(text):
            fail(f"{name} '{text}': a size in bytes, kb or mb, e.g. 32kb")
    if namespaces_of(args.tag):
        fail(f"namespaces of tag {args.tag} exist already: scripts/wan-sim --cleanup {args.tag}, or another --tag")
    repository.root()
    args.bin_dir = args.bin_dir or repository.default_bin_dir()
    cluster = rl.cluster_from_args(args, make=lambda *a: WanCluster(args, *a))
    net = cluster.net
    if args.dry_run:
        for cmd in net.commands():
            print(" ".join(cmd))
        return 0
    # The watchdog first, so that nothing this harness creates can outlive it.
    log = open(os.path.join(cluster.run_dir, "wan-watchdog.log"), "a")
    guard = subprocess.Popen([sys.executable, "-m", __spec__.name, "--watchdog", args.tag, str(os.getpid()),
                              cluster.broker_env["DILOCO_BROKER_DIR"]],
                             start_new_session=True, stdin=subprocess.DEVNULL, stdout=log, stderr=log)
    try:
        net.create()
        say(f"{len(net.regions)} region(s) behind their links: " +
            ", ".join(f"{r} {net.rates[r]} ({net.region_ns[r]})" for r in net.regions) + f"; core {net.core} at {SERVICE}")
        with open(os.path.join(cluster.run_dir, "wan.json"), "w") as f:
            json.dump(net.describe(), f, indent=2)
        timeline = Cuts(net, cluster.cuts, os.path.join(cluster.run_dir, "wan.jsonl"))
        status = rl.run(cluster, args, on_tick=timeline.tick)
        if not args.no_check and not check(cluster):
            status = 1
    finally:
        removed = remove(args.tag, cluster.broker_env)
        guard.terminate()
        guard.wait(5)
        say(f"removed {', '.join(removed) or 'nothing'}")
    return status


if __name__ == "__main__":
    sys.exit(main())
