"""Where the components run (Ray actors, or in-process for tests):

    groups         `Runtime`, `PolicyGroup`, `RewardGroup`: start the actors, call them with typed methods
    worker         `PolicyWorker`: the engine and the trainer of one device, time-shared (seed §5.2.1)
    tool_turns     multi-turn tool calls in the worker (seed §5.1.3)
    reward_worker  CPU actors that verify finished samples
    code_runner    the execution handle verifiers get, backed by a sandbox server
    sandbox_nodes  the sandbox servers a job starts on its nodes
    placement      placement groups: one bundle per worker
    memory         what one worker holds in device memory (`rl validate`)
"""
