"""The algorithms a job runs (seed §5.1-§5.2), driven from the controller:

    job           a running job: workers, store, metrics, checkpointer (`open_job`)
    driver        the recipe's stages in order; the SFT loop
    async_grpo    the asynchronous GRPO/OPD loop: rollout, dispatch, interrupt, train, weight update
    sft           SFT demonstration batches
    rendering     problems to prompt tokens, generations to rewarded samples (effort prefix, seed §5.1.4)
    repercussion  sandbox failures as sample outcomes (seed §5.1.3)
    streams       resumable dataset streams
    evaluation    held-out evaluation
    resume        when checkpoints are written and how a restarted job takes its state back
    records       the controller's checkpoint records (JSON, no class names)
    train_teachers  a zoo of heterogeneous teachers for OPD (`python -m rl.algo.train_teachers`)
"""
