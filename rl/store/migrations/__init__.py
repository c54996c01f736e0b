"""Alembic migrations of the trajectory store (run by rl/store/db.py `upgrade_store`; see env.py)."""
