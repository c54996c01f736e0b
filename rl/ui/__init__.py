"""`rl ui`: a local, read-only web dashboard of runs (issue #45): rl/ui/server.py serves it, rl/ui/data.py reads
the runs, rl/ui/static holds the page, its script and the vendored chart library (no CDN)."""
