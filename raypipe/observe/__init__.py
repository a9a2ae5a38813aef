"""What a run shows while it trains and after: per-stage metrics and Ray's metric series
(`metrics`), experiment loggers (`loggers`), planned and measured timelines and where a step's
time went (`timeline`, `step_breakdown`, `plot`), the progress bar (`progress`), architecture
diagrams (`diagram`) and the Grafana dashboard placed beside Ray's (`grafana`). The driver
uses it; nothing in the actors does."""
