#!/usr/bin/env python3
"""A model of what RPC init and membership cost as the number of workers grows.

It replays the store requests and connection set-ups every worker makes during
init_rpc in a discrete-event simulation: every store server is one FIFO queue with a
per-request service time (docs/store.md measures 25-40k ops/s for one TCPStore
server, i.e. 25-40 us of server time per request), every host is a pool of cores that
runs the client side of each request and each connection set-up, and a get or wait
whose key is not there yet is parked at the server and answered when the key is set.
Counts (store requests, values and bytes served, connections) come out of the same
replay, not out of formulas; only runs too large to replay (more than --max-requests
requests) fall back to a lower bound: the total server work divided by the number of
servers.

Schemes (what every worker does between its start and init_rpc's return):

  eager   ferry's TensorPipe agent before the agent rewrite: a Gloo full mesh over the
          store (every worker publishes one key holding N-1 pair addresses, then waits
          for and reads every other worker's key: N^2 requests, N^3 bytes), one record
          per worker read back by everybody (multi_get of N keys), one pipe to every
          worker opened and pinged at init (N^2 connections), a barrier.
  table   the rewrite: every worker publishes one record, joins one barrier (add +
          wait) and reads the whole table once (one multi_get of N records); pipes
          are opened on first use, so connections follow the call pattern.
  lazy    as table, but a worker reads a peer's record only when it first calls that
          peer (one get per distinct peer called).
  hier    the plan for 10,000 workers on many hosts: one leader per host gathers its
          local workers' records over local IPC and publishes one host record; only
          the H leaders touch the central store at init (set + barrier); the store is
          sharded over S servers by key; a host reads a remote host's record once,
          when one of its workers first calls a worker there, and shares it locally.

Call patterns decide the connections after first use: all (every worker calls every
worker), ps:S (N - S trainers each call all S servers), ring (each worker calls the
next), none.

    scripts/scale_model.py                       # the default tables (a few seconds)
    scripts/scale_model.py --json > model.json
    scripts/scale_model.py --workers 64,1024,10000 --per-host 8 --cores 32 \\
        --schemes table,lazy,hier --pattern ps:16 --shards 4

Python 3 standard library only.
"""

import argparse
import heapq
import itertools
import json
import math
import sys
import zlib
from dataclasses import asdict, dataclass

# ---- parameters ------------------------------------------------------------------------


@dataclass
class Params:
    """Costs, each an input: measured on the development host or taken from docs/store.md."""

    op_us: float = 25.0  # server time per store request (40k ops/s: docs/store.md, 16 clients)
    per_value_us: float = 1.0  # server time per extra value in a multi_get reply
    per_kib_us: float = 0.5  # server time per KiB sent or received
    client_us: float = 10.0  # client CPU per store request (docs/store.md: ~10 us)
    net_us: float = 15.0  # one-way latency between a worker and a store server
    # Calibrated on this host from `ferry bench init --transports uv` before the agent
    # rewrite (bench/results/init_eager_scheme.json): a worker's CPU grows by ~2.3 ms per peer
    # (one pipe each way plus half a Gloo pair) from ~16 ms at N -> 0. How the 2.3 ms
    # splits between pipes and Gloo pairs is a guess.
    start_cpu_us: float = 16000.0  # a worker's fixed start cost: context, listeners, threads
    conn_cpu_us: float = 1500.0  # CPU to set up one pipe (both ends), incl. its first round trip
    gloo_pair_cpu_us: float = 1600.0  # CPU to connect one Gloo pair (both ends)
    local_us: float = 20.0  # one local IPC step (worker <-> host leader)
    record_bytes: int = 128  # one worker's record: name, id, listening URLs
    gloo_addr_bytes: int = 136  # one Gloo TCP pair address (sockaddr_storage + sequence)
    # Busy-polling threads per worker (TensorPipe's shm reactor); an idle worker with the
    # default transports burns 100% of a core when the host has a core to spare.
    spin_threads: float = 0.0
    cores: int = 2  # cores per host
    per_host: int = 0  # workers per host; 0: all on one host
    shards: int = 1  # store servers ("hier" only; the others use one)
    pattern: str = "all"


# ---- the simulation --------------------------------------------------------------------


class Sim:
    """Event loop: a heap of (time, sequence, callback)."""

    def __init__(self):
        self.now = 0.0
        self.heap = []
        self.seq = itertools.count()

    def at(self, t, fn):
        heapq.heappush(self.heap, (t, next(self.seq), fn))

    def run(self):
        while self.heap:
            t, _, fn = heapq.heappop(self.heap)
            self.now = t
            fn()


class Server:
    """One store server: a FIFO queue served by one loop thread."""

    def __init__(self, sim, p):
        self.sim, self.p = sim, p
        self.busy_until = 0.0
        self.busy_us = 0.0
        self.keys = {}  # key -> value bytes
        self.prefix_count = {}  # "rec" -> how many "rec/<i>" keys exist
        self.prefix_bytes = {}
        self.parked_range = {}  # "rec" -> [(count, request)]
        self.counters = {}
        self.parked = {}  # key -> [waiting request]
        self.parked_now = 0
        self.parked_peak = 0
        self.requests = 0
        self.values_served = 0
        self.bytes_served = 0

    def work(self, us, then):
        start = max(self.sim.now, self.busy_until)
        self.busy_until = start + us
        self.busy_us += us
        self.sim.at(self.busy_until, then)

    def cost(self, values, nbytes):
        p = self.p
        return p.op_us + max(0, values - 1) * p.per_value_us + nbytes / 1024.0 * p.per_kib_us

    def arrive(self, req):
        """`req`: dict(op, keys, bytes, delta, reply(result))."""
        self.requests += 1
        op = req["op"]
        if op == "set":
            self.work(self.cost(1, req["bytes"]), lambda: self._set(req))
        elif op == "add":
            def done():
                v = self.counters.get(req["keys"][0], 0) + req["delta"]
                self.counters[req["keys"][0]] = v
                self._set_key(req["keys"][0], 8)
                req["reply"](v)
            self.work(self.cost(1, 8), done)
        else:  # get, multi_get, wait: answered once every key exists
            self.work(self.p.op_us, lambda: self._try(req, parked=False))

    def _set(self, req):
        self._set_key(req["keys"][0], req["bytes"])
        req["reply"](None)

    def _set_key(self, key, nbytes):
        if key not in self.keys and "/" in key:
            prefix = key.rsplit("/", 1)[0]
            c = self.prefix_count[prefix] = self.prefix_count.get(prefix, 0) + 1
            self.prefix_bytes[prefix] = self.prefix_bytes.get(prefix, 0) + nbytes
            still = []
            for count, waiting in self.parked_range.pop(prefix, []):
                if count <= c:
                    self.parked_now -= 1
                    self._try(waiting, parked=True)
                else:
                    still.append((count, waiting))
            if still:
                self.parked_range[prefix] = still
        self.keys[key] = nbytes
        for waiting in self.parked.pop(key, []):
            self.parked_now -= 1
            self._try(waiting, parked=True)

    def _try(self, req, parked):
        if "range" in req:  # every key prefix/0 .. prefix/count-1, without listing them
            prefix, count = req["range"]
            if self.prefix_count.get(prefix, 0) < count:
                self.parked_range.setdefault(prefix, []).append((count, req))
                self.parked_now += 1
                self.parked_peak = max(self.parked_peak, self.parked_now)
                return
            self._answer(req, parked, count, self.prefix_bytes[prefix])
            return
        missing = [k for k in req["keys"] if k not in self.keys]
        if missing:
            self.parked.setdefault(missing[0], []).append(req)
            self.parked_now += 1
            self.parked_peak = max(self.parked_peak, self.parked_now)
            return
        if req["op"] == "wait":
            self._answer(req, parked, 0, 0)
        else:
            self._answer(req, parked, len(req["keys"]), sum(self.keys[k] for k in req["keys"]))

    def _answer(self, req, parked, nvalues, nbytes):
        self.values_served += nvalues
        self.bytes_served += nbytes
        # The reply's bytes (and, for a parked request, answering it) cost server time.
        extra = max(0, nvalues - 1) * self.p.per_value_us + nbytes / 1024.0 * self.p.per_kib_us
        if parked:
            extra += self.p.op_us / 2
        if extra > 0:
            self.work(extra, lambda: req["reply"](nbytes))
        else:
            req["reply"](nbytes)


class Host:
    """A pool of cores running client-side CPU bursts, first come first served. Busy-
    polling threads slow every burst down: with S of them on C cores, a burst gets
    C / (S + 1) of a core once S + 1 > C."""

    def __init__(self, sim, cores, spinners):
        self.sim = sim
        self.free = [0.0] * cores
        self.slowdown = max(1.0, (spinners + 1) / cores) if spinners > 0 else 1.0
        self.cpu_us = 0.0

    def burst(self, us, then):
        t = heapq.heappop(self.free)
        start = max(self.sim.now, t)
        end = start + us * self.slowdown
        heapq.heappush(self.free, end)
        self.cpu_us += us
        self.sim.at(end, then)


@dataclass
class Result:
    scheme: str
    workers: int
    hosts: int
    pattern: str
    simulated: bool
    init_ms: float  # the last worker's init_rpc return (simulated), or a lower bound
    first_use_ms: float  # ... plus every worker's first calls resolved (lookups + pipes)
    store_requests: int
    store_requests_per_worker_max: int
    store_values_served: int
    store_bytes_served: int
    store_busy_ms: float  # total server time
    store_utilization: float  # server busy time / init time (one server: <= 1)
    parked_peak: int
    connections_init: int
    connections_after_first_use: int
    gloo_pairs: int


def callees(pattern, n, rank):
    """The workers `rank` calls under `pattern` (itself included for "all")."""
    if pattern == "all":
        return range(n)
    if pattern == "none":
        return []
    if pattern == "ring":
        return [(rank + 1) % n] if n > 1 else []
    if pattern.startswith("ps:"):
        s = min(int(pattern[3:]), n)
        return range(s) if rank >= s else []  # ranks 0..s-1 serve
    raise ValueError(f"unknown pattern {pattern!r}; expected all, none, ring or ps:S")


def host_of(p, n, rank):
    per = p.per_host if p.per_host > 0 else n
    return rank // per


def hosts_for(p, n):
    per = p.per_host if p.per_host > 0 else n
    return (n + per - 1) // per


def called_pairs(pattern, n):
    """Ordered (caller, callee) pairs with caller != callee."""
    if pattern == "all":
        return n * (n - 1)
    return sum(sum(1 for q in callees(pattern, n, r) if q != r) for r in range(n))


def expected_requests(scheme, n, p):
    """How many store requests a scheme makes: decides whether to replay or bound it."""
    if scheme == "eager":
        return n * (2 * (n - 1) + 8)
    if scheme == "table":
        return n * 4
    if scheme == "lazy":
        return n * 3 + called_pairs(p.pattern, n)
    return hosts_for(p, n) * 3 + sum(remote_hosts_called(p, n, h) for h in range(hosts_for(p, n)))


def remote_hosts_called(p, n, h):
    """How many other hosts the workers of host `h` call (each read once per host)."""
    nhosts = hosts_for(p, n)
    per = p.per_host if p.per_host > 0 else n
    if p.pattern == "none" or nhosts == 1:
        return 0
    if p.pattern == "all":
        return nhosts - 1
    if p.pattern == "ring":
        return 1
    s = min(int(p.pattern[3:]), n)
    callers = any(r >= s for r in range(h * per, min(n, (h + 1) * per)))
    return len({q // per for q in range(s)} - {h}) if callers else 0


def simulate(scheme, n, p):
    sim = Sim()
    nhosts = hosts_for(p, n)
    shards = p.shards if scheme == "hier" else 1
    servers = [Server(sim, p) for _ in range(shards)]
    local = [sum(1 for r in range(n) if host_of(p, n, r) == h) for h in range(nhosts)]
    hosts = [Host(sim, p.cores, p.spin_threads * local[h]) for h in range(nhosts)]
    per_worker = [0] * n
    init_done = [0.0] * n
    used_done = [0.0] * n

    def server_for(key):
        return servers[zlib.crc32(key.encode()) % shards]

    # A worker is a generator yielding steps; the loop sends each step's result back.
    def drive(rank, gen, on_done):
        def step(value=None):
            try:
                s = gen.send(value)
            except StopIteration:
                on_done()
                return
            kind = s[0]
            h = hosts[host_of(p, n, rank)]
            if kind == "cpu":
                h.burst(s[1], step)
            elif kind == "local":
                sim.at(sim.now + p.local_us, step)
            elif kind == "wait_event":
                s[1].append(step)
            else:  # a store request: client CPU, network, server, network
                op, keys = kind, s[1]
                nbytes = s[2] if len(s) > 2 else 0
                per_worker[rank] += 1

                def reply(result):
                    sim.at(sim.now + p.net_us, lambda: step(result))

                req = {"op": op, "keys": keys, "bytes": nbytes, "delta": 1, "reply": reply}
                if op == "multi_get_all":  # every record: one request, N values
                    req = {"op": "multi_get", "keys": [], "range": ("rec", n), "bytes": 0, "delta": 1,
                           "reply": reply}
                    keys = ["rec/0"]
                h.burst(p.client_us, lambda: sim.at(sim.now + p.net_us, lambda: server_for(keys[0]).arrive(req)))

        sim.at(0.0, step)

    def barrier(name, members):
        count = yield ("add", [name + "/arrived"])
        if count == members:
            yield ("set", [name + "/done"], 1)
        yield ("wait", [name + "/done"])

    def first_use(rank, lookup):
        peers = [q for q in callees(p.pattern, n, rank)]
        if lookup:
            for q in peers:
                if q != rank:
                    yield ("get", [f"rec/{q}"])
        if peers:
            yield ("cpu", len(peers) * p.conn_cpu_us)

    def worker(rank):
        yield ("cpu", p.start_cpu_us)
        if scheme == "eager":
            yield ("add", [f"pg/count/{rank}"])
            yield ("add", ["pg/world_size"])  # compare_set: one request
            yield ("cpu", (n - 1) * 20.0)  # create the N-1 Gloo pairs
            yield ("set", [f"gloo/{rank}"], (n - 1) * p.gloo_addr_bytes)
            for q in range(n):
                if q != rank:
                    yield ("wait", [f"gloo/{q}"])
                    yield ("get", [f"gloo/{q}"])
            yield ("cpu", (n - 1) / 2 * p.gloo_pair_cpu_us)  # each pair connected once, by either end
            yield ("set", [f"rec/{rank}"], p.record_bytes)
            yield ("multi_get_all", None)
            yield ("cpu", n * p.conn_cpu_us)  # a pipe to every worker, pinged
            yield from barrier("init", n)  # (Gloo's barrier runs over the mesh: modelled on the store)
            init_done[rank] = sim.now
            return
        if scheme in ("table", "lazy"):
            yield ("set", [f"rec/{rank}"], p.record_bytes)
            yield from barrier("init", n)
            if scheme == "table":
                yield ("multi_get_all", None)
            init_done[rank] = sim.now
            yield from first_use(rank, lookup=(scheme == "lazy"))
            used_done[rank] = sim.now
            return
        raise AssertionError(scheme)

    # ---- hier: leaders speak for their hosts --------------------------------------------
    host_ready = [[] for _ in range(nhosts)]  # callbacks of local workers waiting for the leader
    host_ready_flag = [False] * nhosts
    host_known = [dict() for _ in range(nhosts)]  # remote host -> [callbacks] (pending) or True

    def leader(h):
        yield ("local",)  # gather the local records (workers push theirs)
        yield ("set", [f"host/{h}"], local[h] * p.record_bytes)
        yield from barrier("init", nhosts)
        host_ready_flag[h] = True
        for cb in host_ready[h]:
            sim.at(sim.now + p.local_us, cb)

    def hier_worker(rank):
        h = host_of(p, n, rank)
        yield ("cpu", p.start_cpu_us)
        if not host_ready_flag[h]:
            yield ("wait_event", host_ready[h])
        init_done[rank] = sim.now
        peers = list(callees(p.pattern, n, rank))
        for q in peers:
            rh = host_of(p, n, q)
            if rh == h:
                continue
            state = host_known[h].get(rh)
            if state is True:
                continue
            if state is None:  # this worker fetches the record for its whole host
                host_known[h][rh] = []
                yield ("get", [f"host/{rh}"])
                waiting = host_known[h][rh]
                host_known[h][rh] = True
                for cb in waiting:
                    sim.at(sim.now + p.local_us, cb)
            else:
                yield ("wait_event", state)
        if peers:
            yield ("cpu", len(peers) * p.conn_cpu_us)
        used_done[rank] = sim.now

    if scheme == "hier":
        # Leaders run on their hosts' cores; count their requests separately.
        leader_requests = [0] * nhosts

        def drive_leader(h):
            gen = leader(h)

            def step(value=None):
                try:
                    s = gen.send(value)
                except StopIteration:
                    return
                if s[0] == "local":
                    sim.at(sim.now + p.local_us * max(1, math.log2(max(2, local[h]))), step)
                    return
                leader_requests[h] += 1

                def reply(result):
                    sim.at(sim.now + p.net_us, lambda: step(result))

                req = {"op": s[0], "keys": s[1], "bytes": s[2] if len(s) > 2 else 0, "delta": 1, "reply": reply}
                hosts[h].burst(p.client_us, lambda: sim.at(sim.now + p.net_us,
                                                           lambda: server_for(s[1][0]).arrive(req)))

            sim.at(0.0, step)

        for h in range(nhosts):
            drive_leader(h)
        for r in range(n):
            drive(r, hier_worker(r), lambda: None)
    else:
        for r in range(n):
            drive(r, worker(r), lambda: None)
    sim.run()

    init_us = max(init_done) if n else 0.0
    used_us = max(max(used_done), init_us)
    busy = sum(s.busy_us for s in servers)
    pairs = n * (n - 1) // 2 if scheme == "eager" else 0
    conns_init = n * n if scheme == "eager" else 0
    conns_used = n * n if scheme == "eager" else sum(len(callees(p.pattern, n, r)) for r in range(n))
    requests = sum(s.requests for s in servers)
    per_worker_max = max(per_worker) if scheme != "hier" else max(
        [max(per_worker)] + ([max(leader_requests)] if nhosts else []))
    return Result(scheme, n, nhosts, p.pattern, True, init_us / 1e3,
                  (used_us if scheme != "eager" else init_us) / 1e3, requests, per_worker_max,
                  sum(s.values_served for s in servers), sum(s.bytes_served for s in servers), busy / 1e3,
                  busy / shards / init_us if init_us > 0 else 0.0, max(s.parked_peak for s in servers),
                  conns_init, conns_used, pairs)


def bound(scheme, n, p):
    """Too large to replay: count the requests and bytes exactly and bound the time by
    the server work alone (every request served back to back, no waiting)."""
    if scheme == "eager":
        gloo_value = (n - 1) * p.gloo_addr_bytes
        requests = n * (2 * (n - 1) + 7) + 1  # the last to reach the barrier sets its "done"
        values = n * (n - 1) + n * n
        nbytes = n * (n - 1) * gloo_value + n * n * p.record_bytes
        per_worker = 2 * (n - 1) + 8
        conns_init = conns_used = n * n
        pairs = n * (n - 1) // 2
    elif scheme == "lazy":
        lookups = called_pairs(p.pattern, n)
        requests = 3 * n + 1 + lookups
        values = lookups
        nbytes = lookups * p.record_bytes
        # set, add, wait, and the last to arrive sets "done"; then its lookups
        per_worker = 4 + max(sum(1 for q in callees(p.pattern, n, r) if q != r) for r in range(min(n, 64)))
        conns_init = 0
        conns_used = sum(len(callees(p.pattern, n, r)) for r in range(n))
        pairs = 0
    elif scheme == "hier":
        nhosts = hosts_for(p, n)
        lookups = sum(remote_hosts_called(p, n, h) for h in range(nhosts))
        requests = 3 * nhosts + 1 + lookups
        values = lookups
        nbytes = lookups * (p.per_host or n) * p.record_bytes
        # a leader: set, add, wait (+ "done"); one worker per host fetches its host's lookups
        per_worker = max(4, max(remote_hosts_called(p, n, h) for h in range(nhosts)))
        conns_init = 0
        conns_used = called_pairs(p.pattern, n) + (n if p.pattern == "all" else 0)
        pairs = 0
    else:
        raise AssertionError(f"{scheme} is always replayed")
    busy_us = requests * p.op_us + nbytes / 1024.0 * p.per_kib_us + max(0, values - requests) * p.per_value_us
    servers = p.shards if scheme == "hier" else 1
    busy_us_per_server = busy_us / servers
    if scheme == "eager":
        init_us = busy_us
    elif scheme == "lazy":
        init_us = 3 * n * p.op_us
    else:
        init_us = 3 * hosts_for(p, n) * p.op_us / servers
    init_us += p.start_cpu_us
    return Result(scheme, n, hosts_for(p, n), p.pattern, False, init_us / 1e3,
                  max(init_us, busy_us_per_server + p.start_cpu_us) / 1e3, requests,
                  per_worker, values, nbytes, busy_us / 1e3, 1.0, 0, conns_init, conns_used, pairs)


def model(scheme, n, p, max_requests):
    if scheme != "table" and expected_requests(scheme, n, p) > max_requests:
        return bound(scheme, n, p)
    return simulate(scheme, n, p)


# ---- output ------------------------------------------------------------------------------


def human(x):
    for unit, scale in (("T", 1e12), ("G", 1e9), ("M", 1e6), ("k", 1e3)):
        if abs(x) >= scale:
            return f"{x / scale:.1f}{unit}"
    return f"{x:.0f}" if isinstance(x, int) or x == int(x) else f"{x:.1f}"


def fmt_ms(ms, simulated):
    s = f"{ms / 1e3:.2f} s" if ms >= 1000 else f"{ms:.1f} ms"
    return s if simulated else ">= " + s


def table(title, params, results):
    lines = [f"## {title}",
             f"cores/host {params.cores}, workers/host {params.per_host or 'all'}, store servers "
             f"{params.shards} (hier), pattern {params.pattern}, op {params.op_us:g} us, "
             f"net {params.net_us:g} us, pipe set-up {params.conn_cpu_us:g} us, spinning threads/worker "
             f"{params.spin_threads:g}",
             "",
             "| scheme | N | hosts | init | + first use | store req | req/worker (max) | values served "
             "| bytes served | server busy | parked peak | conns at init | conns after use | Gloo pairs |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in results:
        lines.append(
            f"| {r.scheme} | {r.workers} | {r.hosts} | {fmt_ms(r.init_ms, r.simulated)} | "
            f"{fmt_ms(r.first_use_ms, r.simulated)} | {human(r.store_requests)} | {r.store_requests_per_worker_max} | "
            f"{human(r.store_values_served)} | {human(r.store_bytes_served)}B | "
            f"{fmt_ms(r.store_busy_ms, True)} | {r.parked_peak if r.simulated else '-'} | "
            f"{human(r.connections_init)} | "
            f"{human(r.connections_after_first_use)} | {human(r.gloo_pairs)} |")
    return "\n".join(lines)


# The default study: this host (one host, 2 cores, loopback) to check the model against
# `ferry bench init`, then a cluster of 8-worker hosts up to 10,000 workers.
def default_studies(quick):
    local_ns = [2, 8] if quick else [2, 8, 16, 32, 64]
    cluster_ns = [64, 512] if quick else [64, 512, 2048, 10000]
    return [
        ("This host, TensorPipe's shm transport (one busy-polling thread per worker)",
         Params(spin_threads=1.0), ["eager", "table"], local_ns),
        ("This host, uv transport only (no busy polling)",
         Params(), ["eager", "table", "lazy"], local_ns),
        ("Cluster, all-to-all calls: 8 workers per host, 32 cores per host, 50 us to the store",
         Params(cores=32, per_host=8, net_us=50.0, shards=4, pattern="all"), ["eager", "table", "lazy", "hier"],
         cluster_ns),
        ("Cluster, parameter server (every trainer calls 16 servers): 8 workers per host",
         Params(cores=32, per_host=8, net_us=50.0, shards=4, pattern="ps:16"), ["eager", "table", "lazy", "hier"],
         cluster_ns),
    ]


def parse_args(argv):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--workers", help="comma-separated worker counts (default: the built-in studies)")
    ap.add_argument("--schemes", default="eager,table,lazy,hier", help="comma-separated: eager, table, lazy, hier")
    ap.add_argument("--per-host", type=int, default=0, help="workers per host (0: one host)")
    ap.add_argument("--cores", type=int, default=2, help="cores per host")
    ap.add_argument("--shards", type=int, default=1, help="store servers for hier")
    ap.add_argument("--pattern", default="all", help="all, none, ring or ps:S")
    ap.add_argument("--spin-threads", type=float, default=0.0, help="busy-polling threads per worker")
    for name, default in (("op-us", Params.op_us), ("net-us", Params.net_us), ("client-us", Params.client_us),
                          ("conn-cpu-us", Params.conn_cpu_us), ("per-kib-us", Params.per_kib_us)):
        ap.add_argument("--" + name, type=float, default=default)
    ap.add_argument("--max-requests", type=int, default=400000,
                    help="replay runs up to this many store requests; larger eager runs are bounded")
    ap.add_argument("--quick", action="store_true", help="small default studies (for tests)")
    ap.add_argument("--json", action="store_true", help="print one JSON object instead of tables")
    args = ap.parse_args(argv)
    schemes = [s for s in args.schemes.split(",") if s]
    for s in schemes:
        if s not in ("eager", "table", "lazy", "hier"):
            ap.error(f"--schemes: unknown scheme {s!r}; expected eager, table, lazy or hier")
    try:
        callees(args.pattern, 4, 3)
    except ValueError as e:
        ap.error(f"--pattern: {e}")
    if args.per_host < 0 or args.cores < 1 or args.shards < 1:
        ap.error("--per-host must be >= 0, --cores and --shards >= 1")
    workers = None
    if args.workers:
        try:
            workers = [int(w) for w in args.workers.split(",")]
        except ValueError:
            ap.error(f"--workers: expected comma-separated integers, got {args.workers!r}")
        if any(w < 1 or w > 100000 for w in workers):
            ap.error("--workers: every count must be between 1 and 100000")
    return args, schemes, workers


def main(argv):
    args, schemes, workers = parse_args(argv)
    if workers is None:
        studies = default_studies(args.quick)
    else:
        p = Params(op_us=args.op_us, net_us=args.net_us, client_us=args.client_us, conn_cpu_us=args.conn_cpu_us,
                   per_kib_us=args.per_kib_us, spin_threads=args.spin_threads, cores=args.cores,
                   per_host=args.per_host, shards=args.shards, pattern=args.pattern)
        studies = [("Custom", p, schemes, workers)]
    out = {"model": "scripts/scale_model.py", "studies": []}
    text = []
    for title, p, study_schemes, ns in studies:
        results = [model(s, n, p, args.max_requests) for n in ns for s in study_schemes]
        out["studies"].append({"title": title, "params": asdict(p), "results": [asdict(r) for r in results]})
        text.append(table(title, p, results))
    if args.json:
        json.dump(out, sys.stdout, indent=1)
        sys.stdout.write("\n")
    else:
        print("\n\n".join(text))
        print("\ninit: the last worker's init_rpc return; '+ first use': until every worker's first calls "
              "have their peers' records and pipes; '>=': too large to replay, bounded by server work alone.")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
