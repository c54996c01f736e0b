"""One optimizer step on a worker:

    trainer     the micro-batch loop every objective plugs into; owns the optimizer
    objectives  SFT, GRPO and OPD objectives (seed §5.2.2, §5.2.4)
    losses      the loss formulas as pure functions (GRPO, staleness mask, SFT, KL)
    parallel    data parallelism of the trainer: single, DDP, FSDP2
"""
