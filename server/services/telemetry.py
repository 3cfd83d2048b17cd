"""Per-iteration timing telemetry: idempotent batched ingest and windowed reads."""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass
from functools import cached_property
from itertools import repeat
from typing import Any

import numpy as np
from sqlalchemy import Connection, bindparam, func, select
from sqlalchemy.orm import Session

from contract.agent import TELEMETRY_FIELDS, TelemetryBatch
from contract.enums import JobStatus, Role
from server.errors import Conflict, EvenflowError, Invalid, NotFound
from server.locks import TELEMETRY_ORDER_LOCK_KEY
from server.models import Host, IterationTelemetry, Job, Worker
from server.scale.pg_arrays import Kind, packed
from server.services.paging import Paging, page
from server.services.rank_reports import check_may_write_ranks
from server.services.tokens import Principal


@dataclass(frozen=True)
class Post:
    """One telemetry post: a batch of a job's timings and who sent it."""

    job_id: int
    batch: TelemetryBatch
    principal: Principal

    @cached_property
    def arrays(self) -> tuple[list[Any], ...]:
        """The batch's values, one list per field in ``COLUMNS`` order (built once: the writer
        counts a post's rows and the ingest judges and inserts them)."""
        return self.batch.arrays()

    @property
    def rows(self) -> int:
        return len(self.arrays[0])


Outcome = tuple[int, int] | EvenflowError
"""What became of a post: (accepted, duplicates), or why it was refused."""


def ingest_many(conn: Connection, posts: Sequence[Post]) -> list[Outcome]:
    """Store the posts that may be stored, in one transaction (the caller's), and say for each
    what became of it. Rows already stored for (job, rank, iteration), or earlier in the group,
    are skipped, so a retried batch never duplicates; each post is judged exactly as it would be
    alone (``server.scale.telemetry_writer.TelemetryWriter`` groups the posts that arrive together).

    The hot write path, so it works on a Core connection, not an ORM session, and its
    statements do not grow with the posts: one read of the jobs' states and sizes, one of the
    agents' ranks on their hosts, one bulk insert straight from the batches' per-field arrays
    (``TelemetryBatch.arrays``; a columnar batch hands over the lists it was parsed into)."""
    jobs = {
        job_id: (status, world)
        for job_id, status, world in conn.execute(
            _JOB_STATES, {"ids": sorted({p.job_id for p in posts})}
        )
    }
    placed = _placed_ranks(conn, [p for p in posts if p.principal.role is Role.AGENT])
    outcomes: list[Outcome] = []
    arrays: list[tuple[list[Any], ...] | None] = []
    for post in posts:
        try:
            arrays.append(_admitted(conn, post, jobs, placed))
            outcomes.append((0, 0))
        except EvenflowError as refused:
            arrays.append(None)
            outcomes.append(refused)
    rows = _Rows.of(posts, arrays)
    accepted: dict[int, int] = {}
    if rows.job_ids:
        insert = _insert_postgresql if conn.dialect.name == "postgresql" else _insert_sqlite
        accepted = insert(conn, rows)
    for i, post_arrays in enumerate(arrays):
        if post_arrays is not None:
            stored = accepted.get(i, 0)
            outcomes[i] = (stored, len(post_arrays[0]) - stored)
    return outcomes


@dataclass
class _Rows:
    """A group's rows to insert, column by column: the first of each (job, rank, iteration)
    in the group. Each post's rows are one span of them."""

    job_ids: list[int]
    columns: list[list[Any]]
    spans: dict[int, tuple[int, int]]
    """Post index -> (first, end) of its rows."""

    @classmethod
    def of(cls, posts: Sequence[Post], arrays: list[tuple[list[Any], ...] | None]) -> _Rows:
        admitted = [(i, a) for i, a in enumerate(arrays) if a is not None]
        rows = cls([], [[] for _ in COLUMNS], {})
        for i, a in admitted:  # whole arrays: no key twice, as a fleet's posts are
            rows._add(i, posts[i].job_id, a)
        if not _repeats(rows.job_ids, rows.columns[0], rows.columns[1]):
            return rows
        rows = cls([], [[] for _ in COLUMNS], {})
        keys: set[tuple[int, int, int]] = set()
        for i, a in admitted:  # the first of a repeated key only (rare: a retry beside its post)
            job_id = posts[i].job_id
            first = []
            for row in zip(*a, strict=True):
                key = (job_id, row[0], row[1])
                if key not in keys:
                    keys.add(key)
                    first.append(row)
            if first:
                rows._add(i, job_id, tuple(list(c) for c in zip(*first, strict=True)))
        return rows

    def _add(self, i: int, job_id: int, arrays: tuple[list[Any], ...]) -> None:
        start = len(self.job_ids)
        self.job_ids.extend(repeat(job_id, len(arrays[0])))
        for column, values in zip(self.columns, arrays, strict=True):
            column.extend(values)
        self.spans[i] = (start, len(self.job_ids))


_ITERATIONS = 10**12 + 1
"""More than a record's iteration can be (``TelemetryRecord``), so rank * this + iteration is a
(rank, iteration) key."""


def _repeats(job_ids: list[int], ranks: list[int], iterations: list[int]) -> bool:
    """Whether a (job, rank, iteration) comes twice: sorted by numpy, not a set of tuples in
    Python, which costs the writer far more CPU on a large group."""
    if len(job_ids) < 2:
        return False
    jobs = np.asarray(job_ids, dtype=np.int64)
    keys = np.asarray(ranks, dtype=np.int64) * _ITERATIONS + np.asarray(
        iterations, dtype=np.int64
    )  # a record's rank < 10,000 and iteration <= 10**12: under 2**63
    order = np.lexsort((keys, jobs))
    jobs, keys = jobs[order], keys[order]
    return bool(((jobs[1:] == jobs[:-1]) & (keys[1:] == keys[:-1])).any())


def _admitted(
    conn: Connection,
    post: Post,
    jobs: dict[int, tuple[str, int]],
    placed: dict[tuple[int, str], set[int]],
) -> tuple[list[Any], ...]:
    """The post's rows, one list per field, if it may be stored; else why not."""
    job_id, batch, principal = post.job_id, post.batch, post.principal
    found = jobs.get(job_id)
    if found is None:
        raise NotFound(f"job {job_id} not found")
    status, world = found
    arrays = post.arrays
    ranks = arrays[0]
    check_may_write_ranks(
        conn, principal, job_id, ranks, placed=placed.get((job_id, principal.host or ""), set())
    )
    if status == JobStatus.PENDING.value:
        raise Conflict(
            f"job {job_id} is pending; it has no workers to report timings", field="status"
        )
    if JobStatus(status).terminal:
        raise Conflict(
            f"job {job_id} has ended ({status}); it takes no more telemetry", field="status"
        )
    if max(ranks) >= world:
        i = next(i for i, rank in enumerate(ranks) if rank >= world)
        where, shown = (
            (f"records.{i}.rank", f"records[{i}].rank")
            if batch.records is not None
            else (f"columns.rank.{i}", f"columns.rank[{i}]")
        )
        raise Invalid(f"{shown} is {ranks[i]}; job {job_id} has {world} workers", field=where)
    return arrays


def _placed_ranks(conn: Connection, posts: Sequence[Post]) -> dict[tuple[int, str], set[int]]:
    """The ranks of the posts' jobs placed on their agents' hosts, by (job, host name)."""
    placed: dict[tuple[int, str], set[int]] = {}
    if posts:
        params = {
            "ids": sorted({p.job_id for p in posts}),
            "hosts": sorted({p.principal.host or "" for p in posts}),
        }
        for job_id, host, rank in conn.execute(_RANKS_ON_HOSTS, params):
            placed.setdefault((job_id, host), set()).add(rank)
    return placed


_JOB_STATES = select(
    Job.id,
    Job.status,
    select(func.count(Worker.id)).where(Worker.job_id == Job.id).scalar_subquery(),
).where(Job.id.in_(bindparam("ids", expanding=True)))

_RANKS_ON_HOSTS = (
    select(Worker.job_id, Host.name, Worker.rank)
    .join(Host, Worker.host_id == Host.id)
    .where(
        Worker.job_id.in_(bindparam("ids", expanding=True)),
        Host.name.in_(bindparam("hosts", expanding=True)),
    )
)

# Bulk inserts, each database's fastest: on PostgreSQL one INSERT ... SELECT FROM unnest() of
# per-column arrays (faster than a multi-row VALUES insert), on SQLite a plain executemany. Both
# skip existing keys.
COLUMNS = TELEMETRY_FIELDS  # a row's values, after its job id
_PG_TYPES: tuple[Kind, ...] = (  # of COLUMNS, in order
    "integer",
    "bigint",
    "integer",
    "integer",
    "float8",
    "float8",
    "float8",
    "float8",
    "boolean",
    "float8",
    "integer",
    "integer",
)
_PG_ARRAYS = ", ".join(f"CAST(%({c})b AS {t}[])" for c, t in zip(COLUMNS, _PG_TYPES, strict=True))
_PG_INSERT = (
    "WITH stored AS ("
    f"INSERT INTO iteration_telemetry (job_id, {', '.join(COLUMNS)}) "
    f"SELECT * FROM unnest(CAST(%(job_id)b AS integer[]), {_PG_ARRAYS}) "
    "ON CONFLICT (job_id, rank, iteration) DO NOTHING "
    "RETURNING job_id, rank, iteration) "
    "SELECT count(*), CASE WHEN count(*) < %(rows)s "
    "THEN array_agg(ARRAY[job_id, rank, iteration]) END FROM stored"
)
"""The group's rows in one statement, from one array per column sent in binary, built by numpy
(``packed``): psycopg encodes a list element by element in Python, text or binary alike, a
cost the API process would pay on every row. It answers one row: how many rows were stored
and, only when some were not (already stored), the keys of those that were."""
_SQLITE_INSERT = (
    f"INSERT INTO iteration_telemetry (job_id, {', '.join(COLUMNS)}) "
    f"VALUES ({', '.join('?' * (len(COLUMNS) + 1))}) "
    "ON CONFLICT (job_id, rank, iteration) DO NOTHING"
)


_PG_ID_ORDER = f"SELECT pg_advisory_xact_lock({TELEMETRY_ORDER_LOCK_KEY})"
"""Taken by every telemetry insert and held to its commit, so that rows commit in the order of
their ids whichever process or server writes them. PostgreSQL hands out ids as a statement
inserts, before its commit: two API processes (``--workers``) or two servers, each with its
writer, commit groups of up to ``server.scale.telemetry_writer.MAX_GROUP_ROWS`` rows in either order, and a reader by id
(the controller's ``NewRows``) that saw the later group first moved its mark past the earlier
one's ids, by more than its re-read margin (``REREAD_IDS``): those rows were never read. Held
from the insert to the commit only (the group's reads come before it), so the database takes
one insert at a time, at one writer's pace, which is well above a fleet's telemetry rate."""


def _insert_postgresql(conn: Connection, rows: _Rows) -> dict[int, int]:
    """One statement for the group, after the lock that orders ids (``_PG_ID_ORDER``). Every
    row inserted (the usual case) credits each post with its span; else the keys it returns
    say which post each stored row was."""
    conn.exec_driver_sql(_PG_ID_ORDER)
    params: dict[str, Any] = {
        c: packed(values, kind)
        for c, values, kind in zip(COLUMNS, rows.columns, _PG_TYPES, strict=True)
    }
    params["job_id"] = packed(rows.job_ids, "integer")
    params["rows"] = len(rows.job_ids)
    count, stored = conn.exec_driver_sql(_PG_INSERT, params).one()
    spans = rows.spans.items()
    if count == len(rows.job_ids):
        return {i: end - start for i, (start, end) in spans}
    post_of = {
        (rows.job_ids[r], rows.columns[0][r], rows.columns[1][r]): i
        for i, (start, end) in spans
        for r in range(start, end)
    }
    return Counter(post_of[(j, r, it)] for j, r, it in stored or ())


def _insert_sqlite(conn: Connection, rows: _Rows) -> dict[int, int]:
    """A statement per post (SQLite's executemany counts the rows it inserted, not which)."""
    return {
        i: int(
            conn.exec_driver_sql(
                _SQLITE_INSERT,
                list(
                    zip(rows.job_ids[start:end], *(c[start:end] for c in rows.columns), strict=True)
                ),
            ).rowcount
        )
        for i, (start, end) in rows.spans.items()
    }


def window(
    session: Session,
    job_id: int,
    *,
    since_iteration: int = 0,
    rank: int | None = None,
    paging: Paging = Paging(),
) -> tuple[list[IterationTelemetry], int]:
    """A page of the job's timings from ``since_iteration`` on, by iteration and rank."""
    q = (
        select(IterationTelemetry)
        .where(IterationTelemetry.job_id == job_id, IterationTelemetry.iteration >= since_iteration)
        .order_by(IterationTelemetry.iteration, IterationTelemetry.rank)
    )
    if rank is not None:
        q = q.where(IterationTelemetry.rank == rank)
    return page(session, q, paging)
