"""A simulated GPU fleet against a real `evenflow server` on PostgreSQL.

    python bench/fleet.py [--hosts 1250] [--gpus 8] [--jobs 200 per 1,250 hosts] [--seconds 120]
                          [--ramp-max-s 300] [--job-seconds 30-150] [--telemetry-per host|rank]
                          [--workers 1] [--neighbours 0]

Lightweight asyncio clients, no torch: every host registers its GPUs through the agent API and
heartbeats every 2 s, reporting its workers' states; every running job's workers post their
timings at the job's iteration rate (1 to 5 iterations/s), batched every 2 s: one post per host
and job, as each agent's telemetry relay sends them (`agent/relay.py`), or, `--telemetry-per
rank`, one per rank, as ranks posted before the relay; each job's leader
long-polls its plan and trains at the batch sizes it says; jobs finish and new ones are
submitted throughout; 10 jobs get a scripted 3x straggler. Bounded in time and count, loopback
only.

The fleet's start comes first and is reported on its own (``ramp``): all ``--jobs`` submitted
at once, until they have all started (every rank placed and launched with a fresh credential)
and as long again (up to 60 s: the ranks' running reports, the jobs' first iterations), with
the time it took and the heartbeat and telemetry latency meanwhile. That is a cold start, or a
control plane back from an outage, not the running fleet's load: the ``--seconds`` measured
after it are.

Reported for the running fleet: heartbeat and telemetry latency (p50/p99) and errors, ingest
lag (newest iteration stored behind newest sent, in seconds of training), controller round
time against live jobs (from the controller's own log summary), straggler detection delay at
load against the same job alone (end to end: the newest iteration sent when the event shows,
and the iterations the job had run by then on its own clock; the iterations it had run when
the controller stored the event, without the events API's own latency at load; and the
detector's own, the event's ``detected_iteration``; the 10 straggler jobs are submitted at once
30% into the window, and the fleet runs on after it, unmeasured, until each has shown,
``--straggler-grace-s``), placement time of a 64-worker job
on the whole inventory (before the load, and at load first in the queue, given up after 30 s),
the cores used by each kind of process (and the controller's nice value), how fast the machine
ran a bare Python loop before and after (``machine_speed_m_steps``: this machine is shared, and
only runs at a like speed compare; ``--neighbours`` plays busy tenants on purpose), the API
process's
event-loop lag (its ``/metrics``: how long a request waited before the server could read
it), the requests that waited in the
generator for a client connection (``--connections``; their wait is inside their latency),
and database growth. A window's requests are those sent in it (answered up to ``DRAIN_S``
after it). Each heartbeat's latency is split into the app's own time (its ``Server-Timing``)
and the rest, over all of them and over the slowest 1%; the API's and the generator's garbage
collections are reported with their pauses (each holds a whole process), and the generator's
loop lag with its maximum. ``--requests-to`` writes every request of the window as a line.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import gc
import itertools
import json
import os
import random
import re
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections import defaultdict
from collections.abc import Iterator
from dataclasses import dataclass, field, replace
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import httpx
import orjson
import psutil
import psycopg
from prometheus_client.parser import text_string_to_metric_families
from sqlalchemy import create_engine, make_url, text

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.http_client import LeanClient
from bench.ingest import database
from bench.stack import TOKEN
from contract.base import PROTOCOL_VERSION
from evenflow.local_cluster import free_port
from server.metrics import GcPauses

AUTH = {"Authorization": f"Bearer {TOKEN}"}
HEARTBEAT_S = 2.0
FLUSH_S = 2.0
WINDOW_S = 10.0
"""The slices of the window some figures are also reported by (``..._by_10s``)."""
SIZES = [2, 4, 8, 16, 32, 64, 128, 256]
SIZE_WEIGHTS = [15, 15, 15, 15, 15, 12, 9, 4]
GPU_MODELS = [("NVIDIA H100 80GB HBM3", 0.5), ("NVIDIA A100-SXM4-80GB", 1.0), ("Tesla V100", 2.0)]
STRAGGLER_ONSET = 30
DRAIN_S = 10.0
"""After the measured window, how long its requests still in flight are waited for: a request
sent in it and answered later counts in it, unless it took longer than this past its end."""
SUBMITTERS = 16
"""Job submissions in flight at once while the fleet fills up (``Fleet.keep_jobs``)."""
CLIENTS = ("api", "controller", "bus", "bench")
"""The clients of PostgreSQL the CPU meter tells apart (``application_name`` ``evenflow-*``); a
backend it never saw named (a parallel worker, one gone before its first sample) is "other"."""
CPU_SAMPLE_S = 3.0
"""How often the CPU meter reads every process of the machine (psutil): each second, it took
a twelfth of the generator. A process that exits loses at most this much of its CPU time."""
STRAGGLER_FACTOR = 3.0
JUMP_RECORDS = 3
EVENTS_POLL_S = 0.1
"""How often a straggler job's events are polled (10 jobs: a tenth of a second adds at most half
an iteration to the end-to-end delay at 5 iterations/s)."""
RAMP_SETTLE_S = 2 * HEARTBEAT_S
RAMP_SETTLE_MAX_S = 60.0
"""After the fleet's jobs have all started, the start is measured as long again as that took,
at least ``RAMP_SETTLE_S`` and at most ``RAMP_SETTLE_MAX_S`` (``Fleet.ramp``)."""
"""Iterations into a slowdown at which the runtime posts at once, marked urgent."""


# ------------------------------------------------------------------------------ the server


@dataclass
class Server:
    base: str
    pid: int


class CpuMeter:
    """CPU seconds used by the server's API processes, its controller (and the CBC solver it
    runs for placement), PostgreSQL's backends and this generator: which one saturates the
    machine first.

    Processes come and go (the pools close overflow connections, and their backends exit), so
    the meter samples every process's CPU time (``sample``, every ``CPU_SAMPLE_S``) and adds up
    what each used while it was seen: one that exits loses at most what it used since the last
    sample. One that appears is counted from zero (it started within the window).

    Given the database's URL, it also shares PostgreSQL's CPU out by whose backend used it
    (``application_name``: the API's, the controller's, the buses', ``server.db.make_engine``),
    read from ``pg_stat_activity`` at each sample on a connection of its own: which of the
    server's processes the database works for."""

    def __init__(self, server_pid: int, database: str, db_url: str | None = None) -> None:
        self.server = psutil.Process(server_pid)
        self.database = database
        """PostgreSQL backends of this database only (the machine's other work uses others)."""
        self.t0 = time.monotonic()
        self.seen: dict[tuple[int, float], tuple[str, float, float]] = {}
        """(pid, start in clock ticks since boot) -> (kind, CPU seconds when first seen, when
        last seen). Not ``create_time()``: psutil adds the boot time, which moves when the
        machine's clock is stepped, and a process then seen anew was counted with all its CPU
        time (a run read 3.9 cores of controller on this 2-core machine)."""
        self.peak_mb: dict[str, float] = defaultdict(float)
        """Per kind, the most resident memory its processes held together at one sample."""
        self._sampling = threading.Lock()
        """One sample at a time: the periodic one and ``cores_used``'s run in threads."""
        self.whose: dict[tuple[int, float], str] = {}
        """A PostgreSQL backend's (as ``seen``) client: its ``application_name``."""
        self._activity: psycopg.Connection[Any] | None = None
        if db_url is not None:
            url = make_url(db_url).set(drivername="postgresql")
            url = url.update_query_dict({"application_name": "evenflow-bench"})
            self._activity = psycopg.connect(
                url.render_as_string(hide_password=False), autocommit=True
            )
        self.sample(first=True)

    def close(self) -> None:
        if self._activity is not None:
            self._activity.close()

    def _clients(self) -> dict[int, str]:
        """Backend pid -> its client's ``application_name`` (none without a URL)."""
        if self._activity is None or self._activity.closed:
            return {}
        rows = self._activity.execute(
            "SELECT pid, application_name FROM pg_stat_activity WHERE datname = current_database()"
        ).fetchall()
        return {pid: name for pid, name in rows}

    def _ours(self) -> list[tuple[psutil.Process, str]]:
        procs = [self.server, *self.server.children(recursive=True)]
        kinds = [(p, self._kind(p)) for p in procs]
        postgres = []  # one pass over the machine's processes (two took a twentieth of us)
        for p in psutil.process_iter(["name", "cmdline"]):
            if p.info["name"] == "postgres" and p.info["cmdline"]:
                postgres.append((p, " ".join(p.info["cmdline"])))
        backends = {p.pid: p for p, line in postgres if f" {self.database} " in line}
        kinds += [(p, "postgres") for p in backends.values()]
        kinds += [(p, "postgres") for p in self._parallel_workers(postgres, set(backends))]
        return [*kinds, (psutil.Process(), "generator")]

    @staticmethod
    def _parallel_workers(
        postgres: list[tuple[psutil.Process, str]], backends: set[int]
    ) -> list[psutil.Process]:
        """PostgreSQL's parallel workers for our backends' queries ("postgres: 15/main:
        parallel worker for PID 1234"): their command line names no database."""
        out = []
        for p, line in postgres:
            words = line.split()
            if "parallel" in words and words[-1].isdigit() and int(words[-1]) in backends:
                out.append(p)
        return out

    def sample(self, first: bool = False) -> None:
        with self._sampling:
            self._sample(first)

    def _sample(self, first: bool) -> None:
        held: dict[str, float] = defaultdict(float)
        clients = self._clients()
        for p, kind in self._ours():
            with contextlib.suppress(psutil.Error, OSError, ValueError):
                key = (p.pid, _start_ticks(p.pid))
                if kind == "postgres" and p.pid in clients:
                    self.whose.setdefault(key, clients[p.pid])
                t = p.cpu_times()
                used = t.user + t.system
                was = self.seen.get(key)
                start = was[1] if was is not None else (used if first else 0.0)
                self.seen[key] = (kind, start, used)
                held[kind] += p.memory_info().rss / 2**20
        for kind, mb in held.items():
            self.peak_mb[kind] = max(self.peak_mb[kind], mb)

    async def sample_every(self, seconds: float, stop: asyncio.Event) -> None:
        while not stop.is_set():
            await asyncio.sleep(seconds)
            await asyncio.to_thread(self.sample)

    @staticmethod
    def _kind(p: psutil.Process) -> str:
        """``controller``, ``solver`` (a CBC process of the controller's placement, which a
        pass over a fragmented inventory runs for seconds), or ``api``."""
        with contextlib.suppress(psutil.Error):
            if "server.controller" in p.cmdline():
                return "controller"
            if p.name().lower().startswith("cbc"):
                return "solver"
        return "api"

    def controller_nice(self) -> int | None:
        """The controller process's nice value (``EVENFLOW_CONTROLLER_NICE`` above the
        server's), None if it is not running."""
        for p in self.server.children():
            with contextlib.suppress(psutil.Error):
                if self._kind(p) == "controller":
                    return int(p.nice())
        return None

    def cores_used(self) -> dict[str, float]:
        """Mean cores busy per kind since the meter started (2.0 = both of this machine's).
        It scans the machine's processes: call it in a thread, not on the generator's loop
        (whose stalls count in the latency of every request in flight)."""
        self.sample()
        secs = time.monotonic() - self.t0
        used: dict[str, float] = defaultdict(float)
        for key, (kind, start, last) in self.seen.items():
            used[kind] += last - start
            if kind == "postgres" and self._activity is not None:
                client = self.whose.get(key, "").removeprefix("evenflow-")
                used[f"postgres_for_{client if client in CLIENTS else 'other'}"] += last - start
        out: dict[str, float] = {k: round(v / secs, 2) for k, v in used.items()}
        out["machine"] = os.cpu_count() or 0
        return out


def _start_ticks(pid: int) -> int:
    """When the process started, in clock ticks since boot (``/proc/<pid>/stat``, field 22):
    with the pid, what names one process for its whole life, whatever the clock does."""
    stat = Path(f"/proc/{pid}/stat").read_text()
    return int(stat[stat.rindex(")") + 2 :].split()[19])


@contextlib.contextmanager
def server(db_url: str, workers: int, log: Path) -> Iterator[Server]:
    """`evenflow server` with the controller summarising its rounds every 10 s into ``log``."""
    port = free_port()
    env = {
        **os.environ,
        "EVENFLOW_DATABASE_URL": db_url,
        "EVENFLOW_ADMIN_TOKEN": TOKEN,
        "EVENFLOW_CONTROLLER_REPORT_S": "10",
    }
    cmd = [sys.executable, "-m", "evenflow.cli", "server", "--port", str(port)]
    cmd += ["--log-level", "info", "--workers", str(workers)]
    with log.open("w") as out:
        proc = subprocess.Popen(cmd, env=env, stdout=out, stderr=subprocess.STDOUT)
        base = f"http://127.0.0.1:{port}"
        try:
            deadline = time.monotonic() + 60
            while True:
                with contextlib.suppress(httpx.TransportError):
                    if httpx.get(base + "/api/v1/health", timeout=1).status_code == 200:
                        break
                if time.monotonic() > deadline or proc.poll() is not None:
                    raise RuntimeError(f"server did not start; see {log}")
                time.sleep(0.2)
            yield Server(base, proc.pid)
        finally:
            proc.terminate()
            try:
                proc.wait(timeout=20)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()


def controller_rounds(log: Path) -> list[dict[str, float]]:
    pattern = re.compile(
        r"controller rounds: (\d+) in (\d+) s, live jobs (\d+)-(\d+), "
        r"swept per round ([\d.]+), round ms p50 ([\d.]+) p99 ([\d.]+) max ([\d.]+)"
        r"(?:; cpu s: rounds ([\d.]+), placement ([\d.]+) \((\d+) passes\))?"
        r"(?:; urgent jobs (\d+), waited ms p50 ([\d.]+) max ([\d.]+))?"
        r"(?:; paced s ([\d.]+))?"
    )
    out = []
    for m in pattern.finditer(log.read_text(errors="replace")):
        rounds, secs, _lo, hi, swept, p50, p99, mx, cpu, placement, passes, *rest = m.groups()
        urgent, paced = rest[:3], rest[3]
        window: dict[str, float] = {
            "rounds": int(rounds),
            "seconds": int(secs),
            "live_jobs": int(hi),
            "swept_per_round": float(swept),
            "p50_ms": float(p50),
            "p99_ms": float(p99),
            "max_ms": float(mx),
        }
        if cpu is not None:  # the CPU of the rounds and of the placement passes in the window
            window |= {
                "rounds_cpu_s": float(cpu),
                "placement_cpu_s": float(placement),
                "placement_passes": int(passes),
            }
        if urgent[0] is not None:  # jobs poked as urgent, and how long they waited for a round
            window |= {
                "urgent_jobs": int(urgent[0]),
                "urgent_wait_ms_p50": float(urgent[1]),
                "urgent_wait_ms_max": float(urgent[2]),
            }
        if paced is not None:  # how long the rounds waited for their pace (controller_cores)
            window["paced_s"] = float(paced)
        out.append(window)
    return out


# ------------------------------------------------------------------------------ the fleet


@dataclass
class Host:
    name: str
    model: str
    per_sample_ms: float
    token: str = ""
    id: int = 0
    reports: dict[tuple[int, int], str] = field(default_factory=dict)
    """(job, rank) -> the state this host reports for it."""
    sent: tuple[tuple[tuple[int, int], str], ...] | None = None
    body: bytes = b""
    """The heartbeat body last encoded and the reports it says: sent again, byte for byte, while
    they are the same, as an agent does (encoding each one took a tenth of this generator)."""


@dataclass
class Job:
    id: int
    size: int
    rate: float
    iterations: int
    straggler: bool = False
    ranks: dict[int, Host] = field(default_factory=dict)
    batch_sizes: list[int] = field(default_factory=list)
    version: int = 0
    sent: int = -1
    """Newest iteration posted and answered."""
    in_flight: int = -1
    """Newest iteration posted, answered or not: ingest lag is what is stored behind it (behind
    ``sent`` it was 0 by construction, since a post is answered once its rows are stored)."""
    in_flight_since: float = 0.0
    """When the post of ``in_flight`` went out (monotonic)."""
    submitted_at: float = 0.0
    started: bool = False
    finished: bool = False
    detected_at_iteration: int | None = None
    """Newest iteration sent when the straggler's event was first seen (end to end)."""
    trained_from: float = 0.0
    """When its iteration 0 began (monotonic): its iterations run on this clock at ``rate``."""
    trained_from_wall: float = 0.0
    """The same on the wall clock, to compare with the time the server stored its event."""
    run_until_seen: float | None = None
    """Iterations the job had run past the slowdown's first slow iteration when the event was
    first seen: the end-to-end delay on the job's own clock (``detected_at_iteration`` counts
    the iterations *posted*, which move in steps of up to ten, every ``FLUSH_S``)."""
    urgent_post_wall: tuple[float, float, float] | None = None
    """When the straggler's urgent post was due (its ``JUMP_RECORDS`` slow iterations done),
    when it went out (after the job's post in flight: a host's relay posts one at a time) and
    when it was answered (its rows stored), on the wall clock: where the detection delay at
    load goes (``detection_breakdown``)."""
    stored_wall: float | None = None
    """When the server stored the straggler's event (its ``created_at``)."""
    detector_iteration: int | None = None
    """The iteration at which the server's detector raised it (the event's
    ``detail.detected_iteration``): the detector's own delay, without the posting cadence, the
    controller's round or this poll."""


@dataclass
class Stats:
    latency: dict[str, list[float]] = field(default_factory=lambda: defaultdict(list))
    sent_at: dict[str, list[float]] = field(default_factory=lambda: defaultdict(list))
    """When each request of ``latency`` was sent (monotonic), in the same order."""
    app_s: dict[str, list[float | None]] = field(default_factory=lambda: defaultdict(list))
    """The app's own time on each request of ``latency`` (its ``Server-Timing``), in the same
    order; None where an answer carried none."""
    connect_s: dict[str, list[float | None]] = field(default_factory=lambda: defaultdict(list))
    """How long opening its connection took, for each request of ``latency`` that opened the
    one it went on (None for the others), in the same order."""
    errors: dict[str, int] = field(default_factory=lambda: defaultdict(int))
    lag_s: list[float] = field(default_factory=list)
    worst_lag: dict[str, float] | None = None
    """The largest ``lag_s`` sample with what explains it: the job's size and rate, how long
    its post in flight had been out, and how long the read of the stored iterations took (the
    sample compares the iterations in flight after that read with what it found)."""
    queued_s: dict[str, list[float]] = field(default_factory=lambda: defaultdict(list))
    """Per kind, how long requests that found every client connection taken waited for one
    (``--connections``): time in the generator, inside ``latency``, that no server spent."""
    loop_lag_ms: list[float] = field(default_factory=list)
    """How late the generator's own event loop woke a 100 ms sleep: latency it adds to every
    figure above (a saturated machine delays the generator too)."""
    gc_pauses_ms: dict[int, list[float]] = field(default_factory=lambda: defaultdict(list))
    """The generator's garbage collections, by generation: how long each held its loop."""
    records: int = 0
    jobs_finished: int = 0
    jobs_submitted: int = 0

    def sent_between(self, start: float, end: float) -> Stats:
        """These stats with only the requests sent from ``start`` to ``end`` (monotonic): a
        window's requests are those it sent, not those that ended in it (one sent in the
        ramp before it and answered in it is the ramp's)."""
        out = replace(self, latency=defaultdict(list), sent_at=defaultdict(list))
        out.app_s, out.connect_s = defaultdict(list), defaultdict(list)
        for kind, sent in self.sent_at.items():
            rows = zip(
                sent, self.latency[kind], self.app_s[kind], self.connect_s[kind], strict=True
            )
            for at, latency, app, connect in rows:
                if start <= at <= end:
                    out.sent_at[kind].append(at)
                    out.latency[kind].append(latency)
                    out.app_s[kind].append(app)
                    out.connect_s[kind].append(connect)
        return out


class Fleet:
    def __init__(self, base: str, args: argparse.Namespace, db_url: str) -> None:
        self.base = base
        self.args = args
        self.db_url = db_url
        self.rng = random.Random(7)
        self.hosts: list[Host] = []
        self.jobs: dict[int, Job] = {}
        self.stats = Stats()
        self.stop = asyncio.Event()
        self.filled = asyncio.Event()
        """Set once ``keep_jobs`` has submitted its first ``--jobs`` (from ``filled_from``)."""
        self.filled_from = 0.0
        self.tasks: list[asyncio.Task[Any]] = []
        self.last_error: dict[str, str] = {}
        self._headers: dict[str, dict[str, str]] = {}
        """Per token, the headers of its requests (built once)."""
        self.http: LeanClient
        self.ended_at: list[float] = []
        """When each job's last iteration was posted (monotonic): the jobs' ends."""
        self.to_database: list[tuple[float, float]] = []
        """(monotonic time, the server's heartbeats answered by the database so far), every
        ``WINDOW_S`` of the measured window (:meth:`sample_sources`)."""

    async def request(
        self,
        kind: str,
        method: str,
        path: str,
        token: str = TOKEN,
        body: bytes | None = None,
        params: dict[str, str] | None = None,
        json: Any = None,
    ) -> tuple[int, Any]:
        """``body``: JSON already encoded (``json``: to encode). The answer's status and its
        JSON (its text where it is an error), or 0 and None where none came."""
        if json is not None:
            body = orjson.dumps(json)
        t0 = time.perf_counter()
        try:
            status, raw, app_s, connect_s = await self.http.request_timed(
                method, path, token, body, params, kind
            )
        except (OSError, TimeoutError) as exc:
            self.stats.errors[f"{kind}: {type(exc).__name__}"] += 1
            self.last_error[kind] = repr(exc)[:300]
            return 0, None
        took = time.perf_counter() - t0
        self.stats.latency[kind].append(took)
        self.stats.sent_at[kind].append(time.monotonic() - took)
        self.stats.app_s[kind].append(app_s)
        self.stats.connect_s[kind].append(connect_s)
        ok = status == 200 or status == 201
        answer: Any = orjson.loads(raw) if ok and raw else raw.decode(errors="replace")
        if status >= 400:
            self.stats.errors[f"{kind}: {status}"] += 1
            self.last_error[kind] = f"{status} {answer[:300]}"
        return status, answer

    def on_gc(self, generation: int, seconds: float) -> None:
        """Each of the generator's garbage collections (``Stats.gc_pauses_ms``): its pause
        delays every request whose answer is due meanwhile."""
        self.stats.gc_pauses_ms[generation].append(1000 * seconds)

    def queued(self, kind: str, seconds: float) -> None:
        """A request that waited for a free client connection (``Stats.queued_s``)."""
        self.stats.queued_s[kind].append(seconds)

    # -------------------------------------------------------------- setup

    async def register(self) -> None:
        sem = asyncio.Semaphore(16)

        async def one(i: int) -> None:
            model, per_sample = GPU_MODELS[i % len(GPU_MODELS)]
            host = Host(f"gpu-{i:05d}", model, per_sample)
            async with sem:
                status, body = await self.request(
                    "setup",
                    "POST",
                    "/api/v1/tokens",
                    json={"name": f"agent-{host.name}", "role": "agent", "host": host.name},
                )
                assert status == 201, body
                host.token = body["token"]
                devices = [
                    {"index": d, "kind": "cuda", "model": model, "memory_mb": 81_920}
                    for d in range(self.args.gpus)
                ]
                reg = {
                    "protocol_version": PROTOCOL_VERSION,
                    "name": host.name,
                    "address": "127.0.0.1",
                }
                status, body = await self.request(
                    "setup",
                    "POST",
                    "/api/v1/hosts/register",
                    host.token,
                    json={**reg, "devices": devices},
                )
                assert status == 201, body
                host.id = body["id"]
            self.hosts.append(host)
            # heartbeating from its registration on, as an agent does: hosts waiting for the
            # whole fleet to register (38 s at 1,250 hosts on a slow day) were marked lost
            self.loop_task(self.heartbeat_loop(host))

        await asyncio.gather(*(one(i) for i in range(self.args.hosts)))

    # -------------------------------------------------------------- hosts

    async def heartbeat_loop(self, host: Host) -> None:
        await asyncio.sleep(self.rng.random() * HEARTBEAT_S)
        while not self.stop.is_set():
            started = time.monotonic()
            await self.heartbeat(host)
            await asyncio.sleep(max(0.0, HEARTBEAT_S - (time.monotonic() - started)))

    async def heartbeat(self, host: Host, reverse: bool = False) -> int:
        """One heartbeat reporting the host's ranks (``reverse``: listed the other way round,
        the same report in another heartbeat); the answer updates them. Returns its status."""
        reports = tuple(host.reports.items())
        if reverse:
            reports = reports[::-1]
        if reports != host.sent:
            workers = [{"job_id": j, "rank": r, "state": s} for (j, r), s in reports]
            host.sent, host.body = reports, json.dumps({"workers": workers}).encode()
        status, ack = await self.request(
            "heartbeat", "POST", f"/api/v1/hosts/{host.id}/heartbeat", host.token, body=host.body
        )
        if status == 200:
            self.on_ack(host, ack)
        return status

    def on_ack(self, host: Host, ack: dict[str, Any]) -> None:
        live = set()
        for a in ack["assignments"]:
            key = (a["job_id"], a["rank"])
            live.add(key)
            job = self.jobs.get(a["job_id"])
            if a["desired"] == "stop":
                host.reports[key] = "stopped"
                continue
            if job is None:
                continue
            if job.finished:
                host.reports[key] = "succeeded"
                continue
            host.reports.setdefault(key, "running")
            job.ranks[a["rank"]] = host
            if not job.started and len(job.ranks) == job.size:
                job.started = True
                self.loop_task(self.train(job))
        for key in [k for k in host.reports if k not in live]:
            del host.reports[key]  # the server no longer lists it: nothing left to report

    # -------------------------------------------------------------- jobs

    async def submit(
        self, size: int | None = None, straggler: bool = False, priority: int = 0
    ) -> Job | None:
        size = size or self.rng.choices(SIZES, SIZE_WEIGHTS)[0]
        rate = self.rng.choice([1.0, 2.0, 3.0, 4.0, 5.0])
        iterations = int(rate * self.rng.uniform(*self.args.job_seconds))
        if straggler:
            iterations = max(iterations, STRAGGLER_ONSET + 60)
        spec = {
            "name": f"fleet-{size}",
            "workload": {"builtin": "mlp"},
            "global_batch": 64 * size,
            "iterations": iterations,
            "workers": size,
            "priority": priority,
        }
        t0 = time.monotonic()
        status, body = await self.request("submit", "POST", "/api/v1/jobs", json=spec)
        if status != 201:
            return None
        job = Job(body["id"], size, rate, iterations, straggler, submitted_at=t0)
        job.batch_sizes = [64] * size
        self.jobs[job.id] = job
        self.stats.jobs_submitted += 1
        return job

    async def ramp(self, max_s: float) -> dict[str, Any]:
        """Wait until the jobs submitted first have all started (or ended), at most ``max_s``;
        what the start cost the fleet's requests."""
        t0 = time.monotonic()
        await self.filled.wait()
        submitted_s = time.monotonic() - t0
        first = [j for j in self.jobs.values() if j.submitted_at >= self.filled_from]
        while time.monotonic() - t0 < max_s:
            if all(j.started or j.finished for j in first):
                break
            await asyncio.sleep(0.5)
        # Then every host reports its ranks running (the heartbeat after its assignments) and
        # the jobs' first iterations come in: part of the start, as long again as that took.
        await asyncio.sleep(min(RAMP_SETTLE_MAX_S, max(RAMP_SETTLE_S, time.monotonic() - t0)))
        s = self.stats
        return {
            "seconds": round(time.monotonic() - t0, 1),
            "submitted_s": round(submitted_s, 1),
            "jobs": len(first),
            "jobs_started": sum(1 for j in first if j.started),
            "ranks_started": sum(j.size for j in first if j.started),
            "heartbeat": quantiles(s.latency["heartbeat"]),
            "telemetry": quantiles(s.latency["telemetry"]),
            "errors": dict(s.errors),
        }

    async def keep_jobs(self) -> None:
        """Keep ``--jobs`` jobs live: submit one whenever one finishes. Those missing are
        submitted together, ``SUBMITTERS`` at a time, as users submit: one after another, the
        fleet's first 200 took 531 s to submit on a slow day (a submission waits for a
        database slot behind the heartbeats), so the start measured the submissions."""
        self.filled_from = time.monotonic()
        sem = asyncio.Semaphore(SUBMITTERS)

        async def one() -> None:
            async with sem:
                await self.submit()

        while not self.stop.is_set():
            live = sum(1 for j in self.jobs.values() if not j.finished)
            await asyncio.gather(*(one() for _ in range(self.args.jobs - live)))
            self.filled.set()
            await asyncio.sleep(1.0)

    def timings(self, job: Job, rank: int, iteration: int) -> tuple[float, float]:
        host = job.ranks[rank]
        b = job.batch_sizes[rank] if rank < len(job.batch_sizes) else 64
        compute = 2.0 + host.per_sample_ms * b
        if job.straggler and rank == 1 and iteration >= STRAGGLER_ONSET:
            compute *= STRAGGLER_FACTOR
        return compute, b

    async def train(self, job: Job) -> None:
        """Iterations at the job's rate on a real clock, posted every ``FLUSH_S``; a straggler's
        onset is posted ``JUMP_RECORDS`` iterations in at once and marked urgent, as the
        runtime's jump watch does (``agent.runtime.telemetry``)."""
        self.loop_task(self.leader(job))
        if job.straggler:
            self.loop_task(self.watch_events(job))
        t0 = job.trained_from = time.monotonic()
        job.trained_from_wall = time.time()
        next_flush = t0 + FLUSH_S
        urgent_at = STRAGGLER_ONSET + JUMP_RECORDS - 1 if job.straggler else None
        while not self.stop.is_set() and job.sent < job.iterations - 1:
            wake = next_flush
            if urgent_at is not None and job.sent < urgent_at:
                wake = min(wake, t0 + (urgent_at + 1) / job.rate)
            await asyncio.sleep(max(0.0, wake - time.monotonic()))
            now = time.monotonic()
            if now >= next_flush:
                next_flush = now + FLUSH_S
            done = min(job.iterations - 1, int((now - t0) * job.rate) - 1)
            if done <= job.sent:
                continue
            urgent = urgent_at is not None and job.sent < urgent_at <= done
            job.in_flight, job.in_flight_since = done, time.monotonic()
            sent_at = time.time()
            await self.post_iterations(job, job.sent + 1, done, urgent)
            if urgent and urgent_at is not None:
                due = job.trained_from_wall + (urgent_at + 1) / job.rate
                job.urgent_post_wall = (due, sent_at, time.time())
            job.sent = done
        job.finished = True
        self.stats.jobs_finished += 1
        self.ended_at.append(time.monotonic())

    async def post_iterations(self, job: Job, first: int, last: int, urgent: bool) -> None:
        groups: dict[Any, list[int]] = defaultdict(list)
        for rank, host in job.ranks.items():
            groups[rank if self.args.telemetry_per == "rank" else host.name].append(rank)
        now = time.time()
        its = list(range(first, last + 1))
        n, version = len(its), max(1, job.version)
        posts = []
        for ranks in groups.values():
            # Whole columns at once: the generator shares the machine with what it measures,
            # and building them value by value was a tenth of its time.
            cols: dict[str, list[Any]] = {
                "rank": [rank for rank in ranks for _ in its],
                "iteration": its * len(ranks),
                "plan_version": [version] * (n * len(ranks)),
                "batch_size": [],
                "data_ms": [1.0] * (n * len(ranks)),
                "compute_ms": [],
                "sync_ms": [5.0] * (n * len(ranks)),
                "ts": [now] * (n * len(ranks)),
            }
            for rank in ranks:
                timings = [self.timings(job, rank, it) for it in (first, last)]
                if timings[0] == timings[1]:  # the same all through (no onset in between)
                    cols["compute_ms"] += [timings[0][0]] * n
                    cols["batch_size"] += [timings[0][1]] * n
                else:
                    for compute, b in (self.timings(job, rank, it) for it in its):
                        cols["compute_ms"].append(compute)
                        cols["batch_size"].append(b)
            self.stats.records += len(cols["rank"])
            posts.append(
                self.request(
                    "telemetry",
                    "POST",
                    f"/api/v1/jobs/{job.id}/telemetry",
                    job.ranks[ranks[0]].token,
                    body=orjson.dumps({"columns": cols, "urgent": urgent}),
                )
            )
        await asyncio.gather(*posts)

    async def leader(self, job: Job) -> None:
        while not self.stop.is_set() and not job.finished:
            params = {"known_version": str(max(job.version, 0)), "wait_s": "10"}
            status, plan = await self.request(
                "plan-poll", "GET", f"/api/v1/jobs/{job.id}/plan", params=params
            )
            if status == 200:
                job.version, job.batch_sizes = plan["version"], plan["batch_sizes"]
            elif status not in (304,):
                await asyncio.sleep(1.0)

    async def watch_events(self, job: Job) -> None:
        while not self.stop.is_set() and job.detected_at_iteration is None:
            await asyncio.sleep(EVENTS_POLL_S)
            if job.sent < STRAGGLER_ONSET:
                continue
            status, body = await self.request("events", "GET", f"/api/v1/jobs/{job.id}/events")
            events = body.get("items", body) if isinstance(body, dict) else body
            hits = [e for e in events or [] if e.get("rank") == 1] if status == 200 else []
            if hits:
                job.detected_at_iteration = job.sent
                onset = job.trained_from + (STRAGGLER_ONSET + 1) / job.rate  # the slow one done
                job.run_until_seen = round((time.monotonic() - onset) * job.rate, 1)
                job.detector_iteration = (hits[0].get("detail") or {}).get("detected_iteration")

    def loop_task(self, coro: Any) -> None:
        self.tasks.append(asyncio.get_running_loop().create_task(coro))

    async def shut_down(self) -> None:
        """Stop every client loop before the HTTP session closes under them."""
        self.stop.set()
        for task in self.tasks:
            task.cancel()
        await asyncio.gather(*self.tasks, return_exceptions=True)

    # -------------------------------------------------------------- measurements

    async def sample_loop_lag(self) -> None:
        while not self.stop.is_set():
            t0 = time.monotonic()
            await asyncio.sleep(0.1)
            self.stats.loop_lag_ms.append(1000 * (time.monotonic() - t0 - 0.1))

    async def heartbeat_sources(self) -> dict[str, float]:
        """The server's heartbeat answers by source (``/metrics``: memory or database)."""
        _, raw = await self.http.request("GET", "/metrics")
        body = raw.decode()
        found = re.findall(r'evenflow_heartbeat_answers_total\{source="(\w+)"\} ([\d.e+]+)', body)
        why = r'evenflow_heartbeat_database_reasons_total\{reason="(\w+)"\} ([\d.e+]+)'
        found += [(f"database:{reason}", n) for reason, n in re.findall(why, body)]
        return {source: float(n) for source, n in found}

    async def liveness_hosts(self) -> dict[str, float]:
        """The hosts' times the API's liveness flushes wrote and left for the next, so far."""
        _, raw = await self.http.request("GET", "/metrics")
        found = re.findall(
            r'evenflow_liveness_hosts_total\{outcome="(\w+)"\} ([\d.e+]+)', raw.decode()
        )
        return {outcome: float(n) for outcome, n in found}

    async def loop_lag(self) -> dict[float, float]:
        """The API process's event-loop lag so far (``/metrics``): observations at most each
        bucket's bound, by bound."""
        return {
            le: n
            for (_, le), n in (await self.histogram("evenflow_event_loop_lag_seconds")).items()
        }

    async def histogram(self, name: str, label: str = "") -> dict[tuple[str, float], float]:
        """A histogram of the API process's ``/metrics`` so far: by (``label``'s value, bucket
        bound), the observations at most that bound."""
        _, raw = await self.http.request("GET", "/metrics")
        body = raw.decode()
        out: dict[tuple[str, float], float] = {}
        for family in text_string_to_metric_families(body):
            if family.name == name:
                for sample in family.samples:
                    if sample.name.endswith("_bucket"):
                        key = (sample.labels.get(label, ""), float(sample.labels["le"]))
                        out[key] = sample.value
        return out

    async def sample_sources(self, started: float) -> None:
        """The server's count of heartbeats answered by the database, at the window's start and
        every ``WINDOW_S`` after (for ``churn_by_10s``)."""
        n = 0
        while not self.stop.is_set():
            sources = await self.heartbeat_sources()
            self.to_database.append((time.monotonic(), sources.get("database", 0.0)))
            n += 1
            await asyncio.sleep(max(0.0, started + n * WINDOW_S - time.monotonic()))

    async def sample_lag(self) -> None:
        engine = create_engine(self.db_url)
        try:
            while not self.stop.is_set():
                await asyncio.sleep(5.0)
                asked = time.monotonic()
                rows = await asyncio.to_thread(self._stored, engine)
                now = time.monotonic()
                for job_id, stored in rows:
                    job = self.jobs.get(job_id)
                    if job is not None and not job.finished and job.in_flight >= 0:
                        lag = max(0, job.in_flight - stored) / job.rate
                        self.stats.lag_s.append(lag)
                        worst = self.stats.worst_lag
                        if worst is None or lag > worst["lag_s"]:
                            self.stats.worst_lag = {
                                "lag_s": round(lag, 2),
                                "job_size": job.size,
                                "rate": job.rate,
                                "post_out_s": round(now - job.in_flight_since, 2),
                                "read_s": round(now - asked, 2),
                            }
        finally:
            engine.dispose()

    @staticmethod
    def _stored(engine: Any) -> list[tuple[int, int]]:
        with engine.connect() as c:
            return [
                (int(j), int(i))
                for j, i in c.execute(
                    # per job, the newest iteration off the end of its (job_id, iteration)
                    # index: a GROUP BY read every running job's rows, millions of them at
                    # full fleet, every 5 s, and PostgreSQL's CPU counts in the bench
                    text(
                        "SELECT j.id, (SELECT max(t.iteration) FROM iteration_telemetry t "
                        "WHERE t.job_id = j.id) FROM jobs j WHERE j.status = 'running'"
                    )
                )
                if i is not None
            ]

    async def placement_time(self, size: int, limit_s: float = 30.0) -> float | None:
        """Seconds from the submission of a ``size``-worker job (first in the queue: top
        priority) to its placement; None if not placed within ``limit_s`` (on a full fleet it
        waits for devices, and smaller jobs behind it may take them first)."""
        job = await self.submit(size=size, priority=100)
        if job is None:
            return None
        deadline = time.monotonic() + limit_s
        while not self.stop.is_set() and time.monotonic() < deadline:
            status, body = await self.request("show", "GET", f"/api/v1/jobs/{job.id}")
            if status == 200 and body["status"] != "pending":
                return time.monotonic() - job.submitted_at
            await asyncio.sleep(0.05)
        return None


def db_size(db_url: str) -> int:
    engine = create_engine(db_url)
    try:
        with engine.connect() as c:
            return int(c.execute(text("SELECT pg_database_size(current_database())")).scalar_one())
    finally:
        engine.dispose()


def storage(db_url: str, iterations_per_s: float, mean_ranks: float) -> dict[str, Any]:
    """What the fleet's telemetry costs on disk, raw and retained. The 90 s run is far younger
    than the retention window, so its growth is all raw rows; this measures a raw row of the
    fleet's own telemetry, then rolls the fleet's rows up with the controller's own code
    (``server.services.retention``, with no window: every whole bucket of iterations) and
    measures a rollup row. Per worker-day at the fleet's mean iteration rate per worker:
    raw (every row kept), and retained (one rollup row per rank and bucket, and one per job and
    bucket), besides the raw window each worker keeps while it runs (``raw_window_mb``: its last
    ``telemetry_keep_iterations`` iterations or ``telemetry_keep_running_s`` seconds, whichever
    holds more; a finished job keeps the iterations)."""
    from server.config import Settings
    from server.db import make_engine, session_factory, transaction
    from server.services import retention

    fields = Settings.model_fields
    keep_iterations = int(fields["telemetry_keep_iterations"].default)
    keep_running_s = float(fields["telemetry_keep_running_s"].default)
    engine = make_engine(db_url, pool_size=1)
    try:
        raw = _table_bytes_per_row(engine, "iteration_telemetry")
        rolling = retention.Retention(retention.Window(0, 0.0))
        sessions = session_factory(engine)
        started, moved = time.monotonic(), 0
        with transaction(sessions) as session:
            jobs = rolling.candidates(session)
        for job_id in jobs:
            while True:
                with transaction(sessions) as session:
                    n = rolling.roll_up(session, job_id)
                moved += n
                if not n:
                    break
        roll_up_s = time.monotonic() - started
        rollup = _table_bytes_per_row(engine, "telemetry_rollups") if moved else None
    finally:
        engine.dispose()
    per_day = iterations_per_s * 86_400
    rollup_rows = per_day / retention.BUCKET * (1 + 1 / max(1.0, mean_ranks))
    window = max(keep_iterations, iterations_per_s * keep_running_s)
    return {
        "raw_bytes_per_row": round(raw, 1),
        "rollup_bytes_per_row": round(rollup, 1) if rollup else None,
        "iterations_per_s_per_worker": round(iterations_per_s, 2),
        "rows_rolled_up": moved,
        "roll_up_rows_per_s": round(moved / roll_up_s) if roll_up_s > 0 else None,
        "mb_per_worker_day_raw": round(per_day * raw / 2**20, 2),
        "mb_per_worker_day_retained": (
            round(rollup_rows * rollup / 2**20, 3) if rollup else None  # no whole bucket yet
        ),
        "raw_window_mb_per_worker": round(window * raw / 2**20, 2),
    }


def _table_bytes_per_row(engine: Any, table: str) -> float:
    """A row's share of the table with its indexes, dead rows compacted away first."""
    with engine.connect().execution_options(isolation_level="AUTOCOMMIT") as c:
        c.execute(text(f"VACUUM FULL {table}"))
        size = c.execute(text(f"SELECT pg_total_relation_size('{table}')")).scalar()
        rows = c.execute(text(f"SELECT count(*) FROM {table}")).scalar()
    return int(size or 0) / max(1, int(rows or 0))


def _rows(db_url: str, sql: str, params: dict[str, Any]) -> list[Any]:
    """One query's rows, on a connection of its own (the server's pools are not the bench's)."""
    engine = create_engine(db_url)
    try:
        with engine.connect() as c:
            return list(c.execute(text(sql), params).all())
    finally:
        engine.dispose()


def hosts_lost(db_url: str, since: datetime) -> dict[str, int]:
    """Hosts the reaper marked lost before the measured window and in it (every generated host
    heartbeats throughout, so each is the server's doing), and its pauses (``hosts.LossGuard``)."""
    rows = _rows(
        db_url,
        "SELECT action, at >= :since AS measured, count(*) FROM audit_log "
        "WHERE action IN ('host.lost', 'hosts.loss_paused') GROUP BY 1, 2",
        {"since": since},
    )
    counts = {(a, bool(m)): int(n) for a, m, n in rows}
    return {
        "before_measuring": counts.get(("host.lost", False), 0),
        "while_measuring": counts.get(("host.lost", True), 0),
        "reaper_pauses": counts.get(("hosts.loss_paused", False), 0)
        + counts.get(("hosts.loss_paused", True), 0),
    }


def stored_after_onset(db_url: str, jobs: list[Job]) -> dict[int, float]:
    """Per straggler job whose event the server stored, the iterations the job had run past the
    slowdown's first slow iteration when the controller stored it (the event's ``created_at``,
    on its job's clock): the control plane's detection delay, without the generator's poll of
    the events API (which, at load, waits its turn in the API process like any request)."""
    started = {j.id: j for j in jobs if j.trained_from_wall}
    if not started:
        return {}
    rows = _rows(
        db_url,
        "SELECT job_id, min(created_at) FROM straggler_events "
        "WHERE job_id = ANY(:ids) AND rank = 1 AND kind != 'oom' GROUP BY job_id",
        {"ids": sorted(started)},
    )
    out = {}
    for job_id, at in rows:
        job = started[job_id]
        stored = job.stored_wall = at.timestamp()  # timestamptz: aware times
        onset = job.trained_from_wall + (STRAGGLER_ONSET + 1) / job.rate
        out[job_id] = round((stored - onset) * job.rate, 1)
    return out


def detection_breakdown(jobs: list[Job]) -> list[dict[str, float]]:
    """Per straggler job whose event was stored, where its delay went, in seconds: the urgent
    post's wait behind the job's post in flight (a regular one, answered once its group of
    rows committed: the telemetry latency), its own round trip (the API storing its rows) and
    from its answer to the event's commit (the wake-up reaching the controller and its sweep),
    with the job's rate (iterations/s)."""
    out = []
    for j in jobs:
        if j.urgent_post_wall is None or j.stored_wall is None:
            continue
        due, sent, answered = j.urgent_post_wall
        out.append(
            {
                "rate": j.rate,
                "behind_s": round(max(0.0, sent - due), 2),
                "post_s": round(answered - sent, 2),
                "then_stored_s": round(j.stored_wall - answered, 2),
            }
        )
    return out


def quantiles(values: list[float]) -> dict[str, float]:
    if not values:
        return {}
    v = sorted(values)
    return {
        "n": len(v),
        "p50_ms": round(1000 * statistics.median(v), 1),
        "p99_ms": round(1000 * v[min(len(v) - 1, int(len(v) * 0.99))], 1),
    }


def churn_by_window(fleet: Fleet, started: float, elapsed: float) -> dict[str, Any]:
    """Per ``WINDOW_S`` of the window (as ``heartbeat_p99_ms_by_10s``): the jobs that ended and
    the heartbeats the database answered a second. The fleet's first jobs all start in the ramp
    and end 30 to 150 s later, so the churn, and with it the heartbeats the database works out,
    may still be rising through a short window: read the tail beside it."""
    n = max(1, round(elapsed / WINDOW_S))
    ended = [0] * n
    for at in fleet.ended_at:
        w = int((at - started) // WINDOW_S)
        if 0 <= w < n:
            ended[w] += 1
    rates = [
        round((b - a) / (tb - ta), 1)
        for (ta, a), (tb, b) in itertools.pairwise(fleet.to_database[: n + 1])
        if tb > ta
    ]
    return {"jobs_ended": ended, "heartbeats_to_database_per_s": rates}


def by_window(stats: Stats, kind: str, started: float, window_s: float) -> list[float]:
    """The p99 latency (ms) of the requests of ``kind`` sent in each ``window_s`` of the run:
    whether a tail is steady or a burst (jobs starting together, say)."""
    windows: dict[int, list[float]] = defaultdict(list)
    for at, latency in zip(stats.sent_at[kind], stats.latency[kind], strict=True):
        windows[int((at - started) // window_s)].append(latency)
    return [quantiles(windows[w]).get("p99_ms", 0.0) for w in sorted(windows)]


def inside_and_outside(stats: Stats, kind: str) -> dict[str, Any]:
    """Where the requests of ``kind`` spent their latency: the app's own time (its
    ``Server-Timing``) and the rest outside it (the generator, the kernel, uvicorn, the event
    loop's queue before the app saw the request), over all of them and over the slowest 1%
    (the tail the p99 is read in): whether a slow tail is the server's work or a queue
    before it."""
    pairs = [
        (latency, app)
        for latency, app in zip(stats.latency[kind], stats.app_s[kind], strict=True)
        if app is not None
    ]
    if not pairs:
        return {}
    pairs.sort()
    tail = pairs[min(len(pairs) - 1, int(len(pairs) * 0.99)) :]
    return {
        "app": quantiles([app for _, app in pairs]),
        "outside_app": quantiles([max(0.0, latency - app) for latency, app in pairs]),
        "slowest_1pct": {
            "n": len(tail),
            "latency_p50_ms": round(1000 * statistics.median(lat for lat, _ in tail), 1),
            "app_p50_ms": round(1000 * statistics.median(app for _, app in tail), 1),
            "app_max_ms": round(1000 * max(app for _, app in tail), 1),
        },
    }


def write_requests(stats: Stats, started: float, path: Path) -> None:
    """Every request of ``stats`` as a JSON line: kind, when it was sent (seconds after
    ``started``), its latency and the app's own time (seconds; None where none came), and
    how long opening its connection took (None where it went on one already open)."""
    with path.open("w") as out:
        for kind, latencies in stats.latency.items():
            rows = zip(
                stats.sent_at[kind],
                latencies,
                stats.app_s[kind],
                stats.connect_s[kind],
                strict=True,
            )
            for at, latency, app, connect in rows:
                line = {"kind": kind, "at": round(at - started, 4), "s": latency, "app": app}
                out.write(json.dumps({**line, "connect": connect}) + "\n")


def quantiles_ms(values: list[float]) -> dict[str, float]:
    """p50/p99 of values already in milliseconds."""
    out = quantiles([v / 1000 for v in values])
    out.pop("n", None)
    return out


def lag_between(before: dict[float, float], after: dict[float, float]) -> dict[str, Any]:
    """The API's event-loop lag in the window between two ``Fleet.loop_lag`` reads: the bound
    of the bucket holding its median and its 99th percentile, and its share over 1 s."""
    delta = sorted((le, after[le] - before.get(le, 0.0)) for le in after)
    total = delta[-1][1] if delta else 0.0
    if not total:
        return {}

    def at_most(q: float) -> float:
        return next(le for le, n in delta if n >= q * total)

    over_1s = total - next(n for le, n in delta if le >= 1.0)
    return {
        "p50_s_at_most": at_most(0.5),
        "p99_s_at_most": at_most(0.99),
        "over_1s": round(over_1s / total, 3),
    }


def slow_between(
    before: dict[tuple[str, float], float], after: dict[tuple[str, float], float]
) -> dict[str, dict[str, float]]:
    """Per route, the window's requests, the bucket bounds its median and 99th percentile are
    within, the bound all of them are within, and how many the API process took more than
    2.5, 10 and 30 s over (``evenflow_http_request_seconds``: the server's own time, from the
    app's first look at the request, its headers parsed, to its response's end; a plan
    long-poll's includes its wait).
    A request slow at the client that the server did not take long over waited outside the
    app: in the kernel, uvicorn, the event loop or the generator (its own loop lags too)."""
    out: dict[str, dict[str, float]] = {}
    for route in sorted({r for r, _ in after}):
        at_most = {
            le: n - before.get((route, le), 0.0) for (r, le), n in after.items() if r == route
        }
        total = at_most.get(float("inf"), 0.0)
        if total:
            out[route] = {"n": total}
            for q in (0.5, 0.99):
                bound = min(le for le, n in at_most.items() if n >= q * total)
                out[route][f"p{q * 100:g}_s_at_most"] = bound
            out[route]["max_s_at_most"] = min(le for le, n in at_most.items() if n >= total)
            for bound in (2.5, 10.0, 30.0):
                if bound in at_most:
                    out[route][f"over_{bound:g}s"] = total - at_most[bound]
    return out


def share_from_memory(before: dict[str, float], after: dict[str, float]) -> float | None:
    """The share of the window's heartbeats answered from memory (``server.scale.host_answers``)."""
    delta = {k: after.get(k, 0.0) - before.get(k, 0.0) for k in after if ":" not in k}
    total = sum(delta.values())
    return round(delta.get("memory", 0.0) / total, 3) if total else None


def to_database(
    before: dict[str, float], after: dict[str, float], seconds: float
) -> dict[str, float]:
    """Heartbeats a second worked out in the database during the window, by why memory had no
    answer (``HostAnswers.why_missed``): what sends them there."""
    out = {}
    for k, n in after.items():
        if k.startswith("database:"):
            out[k.partition(":")[2]] = round((n - before.get(k, 0.0)) / seconds, 1)
    return out


def group_sizes(
    before: dict[tuple[str, float], float],
    after: dict[tuple[str, float], float],
    answers0: dict[str, float],
    answers1: dict[str, float],
) -> dict[str, float]:
    """The window's groups of heartbeats worked out in the database together
    (``server.scale.heartbeat_groups``): how many, their mean size, the share of them that had one
    heartbeat alone, and the bucket bound 99% of them were within."""
    at_most = {le: n - before.get(("", le), 0.0) for (_, le), n in after.items()}
    groups = at_most.get(float("inf"), 0.0)
    if not groups:
        return {"groups": 0}
    heartbeats = answers1.get("database", 0.0) - answers0.get("database", 0.0)
    return {
        "groups": groups,
        "mean_heartbeats": round(heartbeats / groups, 2),
        "alone_share": round(at_most.get(1.0, 0.0) / groups, 3),
        "p99_at_most": min(le for le, n in at_most.items() if n >= 0.99 * groups),
    }


SPIN_S = 3.0
SPIN_STEP = 100_000


def machine_speed(seconds: float = SPIN_S) -> float:
    """Millions of steps of a bare Python loop one process ran in ``seconds``: how much of a
    core this shared machine gives Python right now. Its other tenants change it through a
    day by a factor of two and more, and every figure of a fleet run with it, so a run is
    compared only with runs beside it at a like speed (``machine_speed_m_steps``, taken
    before the server starts and after it stops)."""
    end, turns = time.monotonic() + seconds, 0
    while time.monotonic() < end:
        for _ in range(SPIN_STEP):
            pass
        turns += 1
    return round(turns * SPIN_STEP / 1e6, 1)


@contextlib.contextmanager
def neighbours(count: int) -> Iterator[None]:
    """``count`` processes that spin a bare Python loop until the block ends."""
    procs = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(count)]
    try:
        yield
    finally:
        for proc in procs:
            proc.kill()
            proc.wait()


def controller_cores() -> float:
    """The server's ``EVENFLOW_CONTROLLER_CORES`` (it inherits this process's environment), or
    the setting's default: how much of a core the controller's rounds may take, 0 unpaced."""
    from server.config import Settings

    given = os.environ.get("EVENFLOW_CONTROLLER_CORES")
    return float(given) if given else float(Settings.model_fields["controller_cores"].default)


def progress(line: str) -> None:
    """Where the run is, on stderr (the result is printed on stdout at the end)."""
    print(f"{datetime.now(UTC):%H:%M:%S} {line}", file=sys.stderr, flush=True)


def after_onset(iteration: int | None) -> int | None:
    """Iterations from the scripted slowdown's onset to ``iteration``."""
    return None if iteration is None else iteration - STRAGGLER_ONSET


async def run(srv: Server, db_url: str, args: argparse.Namespace) -> dict[str, Any]:
    fleet = Fleet(srv.base, args, db_url)
    limit = args.connections or 2 * args.hosts + 2 * args.jobs + 64
    fleet.http = LeanClient(srv.base, limit, timeout_s=60.0, on_queued=fleet.queued)
    gc_pauses = GcPauses(fleet.on_gc)
    gc_pauses.start()
    try:
        t0 = time.monotonic()
        await fleet.register()
        out: dict[str, Any] = {"setup_s": round(time.monotonic() - t0, 1)}
        progress(f"{args.hosts} hosts registered in {out['setup_s']} s")
        # One connection per host held open, as each agent holds its own: the fleet's bursts
        # (a job's hosts at its start and end, heartbeats held in the database) go on them.
        await fleet.http.open(args.hosts)
        out["connections_opened_ahead"] = args.hosts
        # The straggler job alone (only heartbeats besides it) gives the baseline delay.
        alone = await fleet.submit(size=8, straggler=True)
        if alone is None:
            await fleet.shut_down()
            raise RuntimeError(f"could not submit a job: {fleet.last_error.get('submit')}")
        while alone.detected_at_iteration is None and not alone.finished:
            await asyncio.sleep(0.5)
        out["detection_alone_iterations"] = after_onset(alone.detected_at_iteration)
        out["detector_alone_iterations"] = after_onset(alone.detector_iteration)
        out["run_until_seen_alone_iterations"] = alone.run_until_seen
        # Placement on the whole inventory with room for it, before the load starts.
        out["placement_s_64_workers_idle"] = await fleet.placement_time(64)
        # The fleet's start: --jobs submitted at once and started, reported on its own (a cold
        # start, or a control plane back after an outage, not the running fleet's load).
        fleet.stats = Stats()
        fleet.loop_task(fleet.sample_loop_lag())
        ramp_from = time.monotonic()
        fleet.loop_task(fleet.keep_jobs())
        out["ramp"] = await fleet.ramp(args.ramp_max_s)
        progress(f"fleet started in {out['ramp']['seconds']} s; measuring {args.seconds} s")
        out["ramp"]["heartbeat_p99_ms_by_10s"] = by_window(fleet.stats, "heartbeat", ramp_from, 10)
        # The running fleet: jobs finish and new ones start throughout.
        fleet.stats = Stats()
        # The generator's own stalls count in every latency it measures: what it has built so
        # far (hosts, jobs, connections) is left out of its garbage collections (gen-2 passes
        # held its loop up to 0.7 s), and it reads the database in threads, never on its loop
        # (a read there waited seconds on the saturated PostgreSQL, and every answer due
        # meanwhile with it).
        gc.freeze()
        size0 = await asyncio.to_thread(db_size, db_url)
        cpu = await asyncio.to_thread(CpuMeter, srv.pid, make_url(db_url).database or "", db_url)
        out["controller_nice"] = cpu.controller_nice()
        out["controller_cores"] = controller_cores()
        fleet.loop_task(cpu.sample_every(CPU_SAMPLE_S, fleet.stop))
        answers0 = await fleet.heartbeat_sources()
        lag0 = await fleet.loop_lag()
        served0 = await fleet.histogram("evenflow_http_request_seconds", "route")
        phases0 = await fleet.histogram("evenflow_heartbeat_database_seconds", "phase")
        groups0 = await fleet.histogram("evenflow_heartbeat_group_heartbeats")
        flushes0 = await fleet.histogram("evenflow_liveness_flush_seconds")
        gc0 = await fleet.histogram("evenflow_gc_pause_seconds", "generation")
        alive0 = await fleet.liveness_hosts()
        started = time.monotonic()
        out["measured_from_unix"] = round(time.time(), 1)
        measured_from = datetime.now(UTC)
        fleet.loop_task(fleet.sample_lag())
        fleet.loop_task(fleet.sample_sources(started))
        await asyncio.sleep(args.seconds * 0.3)
        submitted = [fleet.submit(size=8, straggler=True, priority=50) for _ in range(10)]
        stragglers = [j for j in await asyncio.gather(*submitted) if j]
        out["placement_s_64_workers_at_load"] = await fleet.placement_time(64)
        await asyncio.sleep(max(0.0, args.seconds - (time.monotonic() - started)))
        elapsed = time.monotonic() - started
        out["cores_used"] = await asyncio.to_thread(cpu.cores_used)
        out["peak_resident_mb"] = {k: round(v) for k, v in sorted(cpu.peak_mb.items())}
        answers1 = await fleet.heartbeat_sources()
        lag1 = await fleet.loop_lag()
        served1 = await fleet.histogram("evenflow_http_request_seconds", "route")
        phases1 = await fleet.histogram("evenflow_heartbeat_database_seconds", "phase")
        groups1 = await fleet.histogram("evenflow_heartbeat_group_heartbeats")
        flushes1 = await fleet.histogram("evenflow_liveness_flush_seconds")
        gc1 = await fleet.histogram("evenflow_gc_pause_seconds", "generation")
        alive1 = await fleet.liveness_hosts()
        lost = await asyncio.to_thread(hosts_lost, db_url, measured_from)
        size1 = await asyncio.to_thread(db_size, db_url)
        live = [j for j in fleet.jobs.values() if j.started and not j.finished]
        # the window's requests still in flight come in (up to DRAIN_S after it ended)
        await asyncio.sleep(max(0.0, started + elapsed + DRAIN_S - time.monotonic()))
        window, fleet.stats = fleet.stats.sent_between(started, started + elapsed), Stats()
        if args.requests_to is not None:
            write_requests(window, started, args.requests_to)
        grace = time.monotonic()
        while time.monotonic() - grace < args.straggler_grace_s and any(
            j.detected_at_iteration is None and not j.finished for j in stragglers
        ):
            await asyncio.sleep(0.5)  # the fleet runs on; what it does now is not reported
        out["straggler_grace_s"] = round(time.monotonic() - grace, 1)
        await fleet.shut_down()
        cpu.close()
        stored = stored_after_onset(db_url, [alone, *stragglers])
    finally:
        gc_pauses.stop()
        await fleet.http.close()
    s = window
    delays = [after_onset(j.detected_at_iteration) for j in stragglers if j.detected_at_iteration]
    detector = [after_onset(j.detector_iteration) for j in stragglers if j.detector_iteration]
    workers = sum(j.size for j in live)
    out.update(
        {
            "seconds": round(elapsed, 1),
            "hosts": args.hosts,
            "devices": args.hosts * args.gpus,
            "telemetry_per": args.telemetry_per,
            "job_seconds": list(args.job_seconds),
            "heartbeat": quantiles(s.latency["heartbeat"]),
            "heartbeat_p99_ms_by_10s": by_window(s, "heartbeat", started, WINDOW_S),
            "churn_by_10s": churn_by_window(fleet, started, elapsed),
            "heartbeat_inside_and_outside_app": inside_and_outside(s, "heartbeat"),
            "heartbeats_answered_from_memory": share_from_memory(answers0, answers1),
            "heartbeats_per_s_to_database_by_reason": to_database(answers0, answers1, elapsed),
            "generator_loop_lag_ms": {
                **quantiles_ms(s.loop_lag_ms),
                "max_ms": round(max(s.loop_lag_ms, default=0.0), 1),
            },
            "generator_gc_pauses": {
                str(gen): {"n": len(ms), "max_ms": round(max(ms), 1), "total_ms": round(sum(ms))}
                for gen, ms in sorted(s.gc_pauses_ms.items())
            },
            "generator_connection_waits": {
                kind: {**quantiles(waits), "share": round(len(waits) / len(s.latency[kind]), 3)}
                for kind, waits in s.queued_s.items()
                if s.latency.get(kind)
            },
            "api_loop_lag": lag_between(lag0, lag1),
            "server_slow_requests": slow_between(served0, served1),
            # where a heartbeat worked out in the database spent its time (same bucket bounds)
            "heartbeat_database_phases": slow_between(phases0, phases1),
            "heartbeat_groups": group_sizes(groups0, groups1, answers0, answers1),
            # the API process's garbage collections by generation: each holds all of it
            "api_gc_pauses": slow_between(gc0, gc1),
            # the API's writes of hosts' heartbeat times (one a second): how many, how long,
            # and the hosts written or left for the next (rows other transactions held)
            "liveness_flushes": {
                **slow_between(flushes0, flushes1).get("", {}),
                **{k: v - alive0.get(k, 0.0) for k, v in alive1.items()},
            },
            "telemetry": quantiles(s.latency["telemetry"]),
            "plan_poll": quantiles(s.latency["plan-poll"]),
            "errors": dict(s.errors),
            "records_per_s": round(s.records / elapsed),
            "telemetry_posts_per_s": round(len(s.latency["telemetry"]) / elapsed),
            "ingest_lag_s": {
                "p50": round(statistics.median(s.lag_s), 2) if s.lag_s else None,
                "max": round(max(s.lag_s), 2) if s.lag_s else None,
                "worst": s.worst_lag,
            },
            "hosts_lost": lost,
            "jobs_submitted": s.jobs_submitted,
            "jobs_finished": s.jobs_finished,
            "workers_running_at_end": workers,
            "detection_at_load_iterations": delays,
            "detector_at_load_iterations": detector,
            "run_until_seen_at_load_iterations": [
                j.run_until_seen for j in stragglers if j.run_until_seen is not None
            ],
            "stragglers_undetected": sum(1 for j in stragglers if j.detected_at_iteration is None),
            "stored_alone_iterations": stored.get(alone.id),
            "stored_at_load_iterations": [stored[j.id] for j in stragglers if j.id in stored],
            "stragglers_not_stored": sum(1 for j in stragglers if j.id not in stored),
            "detection_breakdown": detection_breakdown(stragglers),
            "db_growth_mb_per_hour": round((size1 - size0) / 2**20 * 3600 / elapsed, 1),
            "db_mb_per_worker_day": round(
                (size1 - size0) / 2**20 * 86_400 / elapsed / max(1, workers), 2
            ),
            "storage": storage(
                db_url, s.records / elapsed / max(1, workers), workers / max(1, len(live))
            ),
        }
    )
    return out


def _span(text: str) -> tuple[float, float]:
    lo, _, hi = text.partition("-")
    try:
        span = (float(lo), float(hi or lo))
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not LO-HI seconds") from None
    if not 0 < span[0] <= span[1]:
        raise argparse.ArgumentTypeError(f"{text!r}: need 0 < LO <= HI")
    return span


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--hosts", type=int, default=1250)
    ap.add_argument("--gpus", type=int, default=8)
    ap.add_argument(
        "--jobs",
        type=int,
        default=None,
        help="jobs kept live (default: 200 per 1,250 hosts, the issue's fleet, in proportion)",
    )
    ap.add_argument("--seconds", type=float, default=120.0, help="the running fleet's")
    ap.add_argument(
        "--ramp-max-s",
        type=float,
        default=300.0,
        help="the fleet's start (every job submitted at once) is measured apart: until all of "
        "them have started or this many seconds, then as long again (4 to 60 s)",
    )
    ap.add_argument(
        "--job-seconds",
        type=_span,
        default=(30.0, 150.0),
        metavar="LO-HI",
        help="how long each job trains, drawn uniformly (default 30-150): jobs end and new "
        "ones start throughout, and each start and end changes its hosts' heartbeat answers; "
        "a real cluster's jobs live hours",
    )
    ap.add_argument("--telemetry-per", choices=["host", "rank"], default="host")
    ap.add_argument("--workers", type=int, default=1, help="API processes of the server")
    ap.add_argument(
        "--connections",
        type=int,
        default=None,
        help="client connections at most (default: two per host and two per job: an agent "
        "heartbeats and its telemetry relay posts on connections of their own, and a job's "
        "leader long-polls on its own; fewer makes requests queue in the generator)",
    )
    ap.add_argument(
        "--straggler-grace-s",
        type=float,
        default=90.0,
        help="after the measured window the fleet runs on, unmeasured, until every straggler "
        "job's event has shown or this many seconds (at full fleet their start takes a while)",
    )
    ap.add_argument(
        "--neighbours",
        type=int,
        default=0,
        metavar="N",
        help="N busy loops (Python, at nice 0) beside the whole run, each taking a core: the "
        "other tenants of a shared machine, played on purpose",
    )
    ap.add_argument(
        "--requests-to",
        type=Path,
        default=None,
        metavar="PATH",
        help="also write every measured request as a JSON line (kind, sent at in seconds into "
        "the window, latency, the app's own time and its connect where it opened one, in "
        "seconds), to look into a tail",
    )
    args = ap.parse_args()
    if args.jobs is None:
        args.jobs = max(1, round(args.hosts * 200 / 1250))
    with database("postgresql") as db_url, tempfile.TemporaryDirectory() as tmp:
        log = Path(tmp) / "server.log"
        speed = machine_speed()
        progress(f"machine speed {speed} M steps in {SPIN_S:.0f} s")
        with neighbours(args.neighbours), server(db_url, args.workers, log) as srv:
            out = asyncio.run(run(srv, db_url, args))
        out["machine_speed_m_steps"] = [speed, machine_speed()]
        out["neighbours"] = args.neighbours
        out["controller_rounds"] = controller_rounds(log)
        stamp = datetime.now(UTC).strftime("%Y%m%dT%H%M%S")
        kept = Path(__file__).resolve().parent / "results" / f"fleet-{args.hosts}h-{stamp}.log"
        kept.parent.mkdir(exist_ok=True)
        kept.write_text(log.read_text(errors="replace"))
        out["server_log"] = str(kept)  # every run's, not only the last
    print(json.dumps(out, indent=2))


if __name__ == "__main__":
    main()
