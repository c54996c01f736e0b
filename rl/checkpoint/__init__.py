"""A run directory on disk (seed §5.1.2 preemptible pools, §5.2.3 in-flight state):

    format     checkpoint format 2: directories, manifest and digests, tensor trees, the one finder
    export     a checkpoint as a Hugging Face directory (`rl export`, the end of a stage)
    run_specs  `RUN_DIR[:STEP]` as a model source (teachers, merge)
    run_dir    one job per run directory (a lock), and no run started over by accident
    preempt    SIGTERM/SIGINT: stop at a token boundary, checkpoint, exit 3

When a job writes checkpoints and how it resumes from one: rl/algo/resume.py.
"""
