"""The verl engine: verl 0.9.1's FSDP workers on a Ray cluster behind the loop's `Policy` interface.

Modules: `cpu_platform` (verl has no CPU platform; this one lets its workers run on CPU cores),
`losses` (the spec's algorithms registered into verl's registries), `data` (samples -> verl's
batch), `engine` (the driver: a Ray worker group of `ActorRolloutRefWorker`), `plugin` (what every
process that imports verl loads, through the ``verl.plugins`` entry point).
"""
