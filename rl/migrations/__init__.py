"""Alembic migrations of the trajectory store (run by rl/store_db.py `upgrade_store`; see env.py)."""
