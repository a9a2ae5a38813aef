"""How a model is split and scheduled before any step runs: shard plans (`partition`), the
per-layer timings on each device kind and the cost model built on them (`profiling`, whose
actor side is `raypipe.actors.profiler`), and `schedule="auto"` (`autoschedule`)."""
