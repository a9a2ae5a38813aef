"""A line chart of per-step values (loss, tokens/s) as SVG, with no plotting library.

`LossCurve(history)` shows itself inline in a notebook and saves to .svg; raypipe's
dependencies stay the ones its README lists.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from xml.sax.saxutils import escape

W, H, LEFT, BOTTOM, TOP, RIGHT = 640, 300, 60, 40, 30, 20


@dataclass(init=False)
class LossCurve:
    """Values per step; built from `Trainer.fit`'s history or any list of numbers."""

    steps: list[int]
    values: list[float]
    label: str = "loss"

    def __init__(self, history: Sequence[Any], key: str = "loss") -> None:
        rows = [h for h in history if isinstance(h, dict)]
        if rows:
            self.steps, self.values = [int(h["step"]) for h in rows], [float(h[key]) for h in rows]
        else:
            self.steps, self.values = list(range(1, len(history) + 1)), [float(v) for v in history]
        self.label = key

    def to_svg(self) -> str:
        finite = [(s, v) for s, v in zip(self.steps, self.values) if math.isfinite(v)]
        out = [
            f'<svg xmlns="http://www.w3.org/2000/svg" width="{W}" height="{H}" font-family="sans-serif" '
            f'font-size="11"><rect width="100%" height="100%" fill="white"/>',
            f'<text x="{LEFT}" y="18" font-size="13">{escape(self.label)} per step</text>',
        ]
        if finite:
            s0, s1 = finite[0][0], max(finite[-1][0], finite[0][0] + 1)
            lo, hi = min(v for _, v in finite), max(v for _, v in finite)
            hi = hi if hi > lo else lo + 1.0

            def x(step: float) -> float:
                return LEFT + (step - s0) / (s1 - s0) * (W - LEFT - RIGHT)

            def y(value: float) -> float:
                return TOP + (hi - value) / (hi - lo) * (H - TOP - BOTTOM)

            for i in range(5):
                value = lo + (hi - lo) * i / 4
                out.append(
                    f'<line x1="{LEFT}" x2="{W - RIGHT}" y1="{y(value):.1f}" y2="{y(value):.1f}" stroke="#e5e5e5"/>'
                    f'<text x="{LEFT - 6}" y="{y(value) + 4:.1f}" text-anchor="end">{value:.3g}</text>'
                )
            for i in range(5):
                step = s0 + (s1 - s0) * i / 4
                out.append(f'<text x="{x(step):.1f}" y="{H - BOTTOM + 16}" text-anchor="middle">{step:.0f}</text>')
            points = " ".join(f"{x(s):.1f},{y(v):.1f}" for s, v in finite)
            out.append(f'<polyline points="{points}" fill="none" stroke="#4c8bd6" stroke-width="1.5"/>')
        out.append(f'<text x="{W / 2}" y="{H - 6}" text-anchor="middle">step</text></svg>')
        return "\n".join(out)

    def save(self, path: str | Path) -> Path:
        path = Path(path)
        path.write_text(self.to_svg())
        return path

    def _repr_svg_(self) -> str:
        return self.to_svg()
