"""asyncrl's driver side: recipes, the stage loops, the runtime, checkpoints and the trajectory store.

Modules here name the concepts every sub-package shares:
    config        the `Recipe` root and the configs of rl's components (pure pydantic)
    recipe_io     YAML recipes and `--set` overrides in and out, every failure one line
    types         the records that flow: `Prompt`, `Sample`, `Turn`
    dispatch      dispatch policies and the train-batch condition (seed §5.2.1-§5.2.2)
    reconfigure   live patches to a running stage (seed §5.2.4)
    metrics       metric sinks (JSONL, wandb) and the rollout clock
    faults        fail points for crash tests

Sub-packages, each importing only those below it (tests/unit/test_architecture.py):
    cli/          the `rl` command and its sub-commands
    algo/         the job, the stage loops (SFT, asynchronous GRPO/OPD), evaluation, resume
    runtime/      Ray actors: policy workers (engine + trainer), reward workers, sandboxes, placement
    train/        one optimizer step: the trainer, objectives, losses, data parallelism
    checkpoint/   the checkpoint format, run specs, run-directory ownership, preemption
    store/        the trajectory store (SQLAlchemy), its schema, migrations and run identity
"""
