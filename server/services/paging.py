"""One page of a listing: every list endpoint reads ``limit`` rows from ``offset`` of an ordered
statement and counts all the rows it matches (``Page[T]`` in ``contract.api``)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, TypeVar

from sqlalchemy import Select, func, select
from sqlalchemy.orm import Session

from contract.base import MAX_ID, MAX_PAGE

T = TypeVar("T")

DEFAULT_LIMIT = 100
MAX_LIMIT = MAX_PAGE
MAX_OFFSET = MAX_ID


@dataclass(frozen=True)
class Paging:
    limit: int = DEFAULT_LIMIT
    offset: int = 0

    def slice(self, items: list[T]) -> tuple[list[T], int]:
        """The page of a list built in memory (a job's ranks), and the list's length."""
        return items[self.offset : self.offset + self.limit], len(items)


def page(session: Session, query: Select[T], paging: Paging) -> tuple[list[T], int]:
    """The page of ``query`` (already ordered) and how many rows it matches in all."""
    rows = list(session.scalars(query.limit(paging.limit).offset(paging.offset)))
    if paging.offset == 0 and len(rows) < paging.limit:
        return rows, len(rows)  # all of it: no second query
    counted: Select[Any] = query.order_by(None)
    total = session.scalar(select(func.count()).select_from(counted.subquery()))
    return rows, int(total or 0)
