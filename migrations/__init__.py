"""Alembic migrations, applied on server start."""
