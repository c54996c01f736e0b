"""The trajectory store: every prompt, sample and train step of a run in SQL (SQLite or any SQLAlchemy URL).

    trajectories  `TrajectoryStore`: records in and out, rollback to a checkpoint's watermark, audits
    schema        the tables at the newest revision
    db            URLs, engines, schema versions and upgrades (Alembic revisions in migrations/)
    identity      a run's identity (run.json), its checkpoints' lineage tokens, and where a run directory's store lives
"""
