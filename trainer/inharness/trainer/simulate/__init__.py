"""`inharness simulate`: plan a TrainingRun's timeline under each scheduling mode before paying for GPUs.

A discrete-event simulation of rollouts (calls and tool time), GPUs that decode and train, and the
three schedulers (sync, async on split GPUs, collocated async): steps per hour, GPU busy fractions,
staleness and dropped groups per mode. `params` holds what is simulated (presets, override files),
`fit` reads a recorded run, `engine` runs it, `report` prints and draws, `cli` is the command.
This package's `__init__` imports nothing: the command line adds its flags on every start.
"""
