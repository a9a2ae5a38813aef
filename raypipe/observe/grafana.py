"""raypipe's Grafana dashboard, beside Ray's own.

Ray writes a Grafana provisioning folder into each head's session directory
(`<session>/metrics/grafana/`, with `dashboards/` holding Ray's dashboards and `grafana.ini`
pointing Grafana at them) but runs neither Prometheus nor Grafana. `install()` puts raypipe's
dashboard into that `dashboards/` folder, so a Grafana started with Ray's `grafana.ini` shows it in
Ray's folder beside Ray's own; a job does it as it starts on the head. Its panels read the series
`raypipe.observe.metrics.RayMetrics` exports (`SERIES`), per run: steps per second, loss, tokens/s, step
time quantiles and each stage's busy fraction. docs/watching.md has the steps.
"""

from __future__ import annotations

import json
from pathlib import Path

FILE = "raypipe_grafana_dashboard.json"
UID = "raypipeDashboard"
# the series as Prometheus names them (Ray's `ray_` prefix; a counter's `_total`, a histogram's `_bucket`)
SERIES = (
    "ray_raypipe_steps_total",
    "ray_raypipe_loss",
    "ray_raypipe_tokens_per_second",
    "ray_raypipe_samples_per_second",
    "ray_raypipe_step_seconds_bucket",
    "ray_raypipe_stage_busy_fraction",
)
RUN = '{run=~"$run"}'


def _panel(index: int, title: str, unit: str, *exprs: tuple[str, str]) -> dict[str, object]:
    return {
        "id": index + 1,
        "title": title,
        "type": "timeseries",
        "datasource": {"type": "prometheus", "uid": "${datasource}"},
        "gridPos": {"h": 8, "w": 12, "x": 12 * (index % 2), "y": 8 * (index // 2)},
        "fieldConfig": {"defaults": {"unit": unit}, "overrides": []},
        "targets": [
            {"refId": chr(65 + i), "expr": expr, "legendFormat": legend} for i, (expr, legend) in enumerate(exprs)
        ],
    }


def dashboard() -> dict[str, object]:
    """The dashboard as Grafana's JSON model."""
    panels = [
        _panel(0, "Steps per second", "none", (f"rate(ray_raypipe_steps_total{RUN}[1m])", "{{run}}")),
        _panel(1, "Loss", "none", (f"ray_raypipe_loss{RUN}", "{{run}}")),
        _panel(2, "Tokens per second", "none", (f"ray_raypipe_tokens_per_second{RUN}", "{{run}}")),
        _panel(
            3,
            "Step time",
            "s",
            *[
                (
                    f"histogram_quantile({q}, sum by (le, run) (rate(ray_raypipe_step_seconds_bucket{RUN}[1m])))",
                    f"p{int(q * 100)} {{{{run}}}}",
                )
                for q in (0.5, 0.9)
            ],
        ),
        _panel(
            4,
            "Stage busy fraction",
            "percentunit",
            (f"ray_raypipe_stage_busy_fraction{RUN}", "{{run}} stage {{stage}}"),
        ),
        _panel(5, "Samples per second", "none", (f"ray_raypipe_samples_per_second{RUN}", "{{run}}")),
    ]
    return {
        "title": "raypipe",
        "uid": UID,
        "version": 1,
        "schemaVersion": 27,
        "editable": True,
        "refresh": "10s",
        "time": {"from": "now-30m", "to": "now"},
        "tags": ["raypipe"],
        "panels": panels,
        "templating": {
            "list": [
                {"name": "datasource", "type": "datasource", "query": "prometheus", "current": {}},
                {
                    "name": "run",
                    "type": "query",
                    "datasource": {"type": "prometheus", "uid": "${datasource}"},
                    "query": "label_values(ray_raypipe_steps_total, run)",
                    "includeAll": True,
                    "multi": True,
                    "current": {"text": "All", "value": "$__all"},
                    "refresh": 2,
                },
            ]
        },
    }


def install(session_dir: str | Path | None = None) -> Path | None:
    """Writes the dashboard into the Grafana provisioning of this node's Ray session (or
    `session_dir`'s), beside Ray's own dashboards; returns where, or None where this process has
    no local Ray session (a driver away from the head)."""
    if session_dir is None:
        try:
            import ray

            session_dir = ray._private.worker._global_node.get_session_dir_path()
        except Exception:  # noqa: BLE001 - connected without a local node: no session folder here
            return None
    folder = Path(session_dir) / "metrics" / "grafana" / "dashboards"
    if not folder.is_dir():
        return None
    path = folder / FILE
    path.write_text(json.dumps(dashboard(), indent=1))
    return path
