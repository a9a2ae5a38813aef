"""Architecture diagrams: stages, their layers and actors, and what flows between them.

`Architecture.from_config` draws a run before it starts (no cluster needed: boundary
shapes come from running the layers on the meta device); `Architecture.from_trainer`
draws a running one, with the node and device each actor really has. Each stage
shows its layer range, layer kinds and parameter count; inside it, its actors, one
row per dp replica and one box per tp rank (a tp group is a dashed box); the arrows
between stages carry the boundary tensor's shape. Graphviz renders PNG, SVG and PDF;
`.mmd` writes Mermaid text (GitHub renders it in Markdown).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from raypipe.config import TrainConfig
from raypipe.core.layers import LayerSpec, as_spec, parameter_counts
from raypipe.planning.partition import make_plan
from raypipe.schedules import build_schedule, owners


@dataclass
class ActorView:
    name: str
    dp: int
    tp: int
    device: str = "cpu"
    node: str = ""  # short node id; empty when drawn from the config alone


@dataclass
class StageView:
    index: int
    layers: tuple[int, int]
    kinds: str  # e.g. "Embedding, Block x2"
    parameters: int
    actors: list[ActorView] = field(default_factory=list)
    output: str = ""  # the boundary tensor this stage sends on, e.g. "(4, 64, 128) float32"
    on_stage: int | None = None  # with model chunks: the stage (actor) this virtual stage runs on
    experts: int = 0  # experts per MoE layer among its layers (0: none)
    link: str = ""  # the transport its output goes on to the next stage ("shm", "gloo"); running trainers only

    @property
    def heading(self) -> str:
        return (
            f"stage {self.index}" if self.on_stage is None else f"virtual stage {self.index} on stage {self.on_stage}"
        )


@dataclass
class Architecture:
    title: str
    input: str
    stages: list[StageView]
    dp: int = 1
    tp: int = 1
    ep: int = 1

    # ----- building -------------------------------------------------------------------

    @classmethod
    def from_config(
        cls, layers: Sequence[object], config: TrainConfig, sample: torch.Tensor | None = None, title: str = ""
    ) -> Architecture:
        """The architecture a Trainer would build; `sample` is one microbatch (any device, meta works)."""
        specs = [as_spec(layer, i) for i, layer in enumerate(layers)]
        counts = parameter_counts(specs)
        chunked = config.num_chunks() > 1  # then one box per virtual stage, in the order data flows
        plan = make_plan(len(specs), config.pp * config.num_chunks(), config.partition, config.shard_plan, counts)
        # which actor holds each virtual stage (sequence chunks change the order, not the owners)
        on = owners(build_schedule(config.schedule, config.pp, config.microbatches, config.chunks, config.extra_warmup))
        shapes = _boundary_shapes(specs, plan, sample)
        stages = []
        for v, (start, end) in enumerate(plan):
            s = on[v]
            actors = [ActorView(f"stage{s}-dp{d}-tp{t}", d, t) for d in range(config.dp) for t in range(config.tp)]
            stages.append(
                StageView(
                    v,
                    (start, end),
                    _kinds(specs[start:end]),
                    sum(counts[start:end]),
                    actors,
                    shapes[v + 1],
                    s if chunked else None,
                    _experts(specs[start:end]),
                )
            )
        return cls(title or _title(config), shapes[0], stages, config.dp, config.tp, config.ep)

    @classmethod
    def from_trainer(cls, trainer: Any, sample: torch.Tensor | None = None, title: str = "") -> Architecture:
        """A running trainer's architecture, with each actor's real node and device, and the
        transport of each link between stages (and its rate, where it was measured)."""
        arch = cls.from_config(trainer.specs, trainer.config, sample, title)
        by_name = {i["name"]: i for i in trainer.stage_info()}
        for stage in arch.stages:
            for actor in stage.actors:
                info = by_name[actor.name]
                actor.device, actor.node = info["device"], info["node_id"][:8]
        for stage, after in zip(arch.stages, arch.stages[1:]):
            hows = {
                by_name[a.name]["links"].get(b.name)
                for a in stage.actors
                for b in after.actors
                if (a.dp, a.tp) == (b.dp, b.tp)
            }
            stage.link = " + ".join(sorted(h for h in hows if h))
            rates = [  # measured where the link crosses nodes (`stage_info()["link_rates"]`)
                rate["mbit_per_s"]
                for a in stage.actors
                for b in after.actors
                if (a.dp, a.tp) == (b.dp, b.tp) and (rate := by_name[a.name]["link_rates"].get(b.name))
            ]
            if rates:
                stage.link += f" at {min(rates):,.0f} Mbit/s"
        return arch

    # ----- drawing --------------------------------------------------------------------

    def to_dot(self) -> str:
        """Graphviz source: a table per stage (a row per dp replica, a cell per tp rank), shapes on the arrows."""
        out = [
            "digraph raypipe {",
            "  rankdir=LR;",
            f'  label="{_q(self.title)}"; labelloc=t; fontname="Helvetica"; fontsize=16;',
            '  node [fontname="Helvetica", fontsize=11];',
            '  edge [fontname="Helvetica", fontsize=10];',
            f'  input [label="batch\\n{_q(self.input)}", shape=oval, style=filled, fillcolor="#eeeeee"];',
            '  loss [label="loss", shape=oval, style=filled, fillcolor="#eeeeee"];',
        ]
        for stage in self.stages:
            rows = [
                f'<tr><td colspan="{self.tp + 1}" bgcolor="#4c8bd6"><font color="white"><b>{stage.heading}</b>'
                f": layers [{stage.layers[0]}, {stage.layers[1]})</font></td></tr>",
                f'<tr><td colspan="{self.tp + 1}">{_html(stage.kinds)}<br/>{stage.parameters:,} parameters'
                f"{self._moe_line(stage)}</td></tr>",
            ]
            for d in range(self.dp):
                cells = "".join(
                    f'<td bgcolor="#e8f0fb">{a.name}<br/><font point-size="9">{_html(a.device)}'
                    f"{' @ node ' + _html(a.node) if a.node else ''}{self._held(stage, d)}</font></td>"
                    for a in stage.actors
                    if a.dp == d
                )
                group = f"dp {d}" + (f"<br/>tp group of {self.tp}" if self.tp > 1 else "")
                if stage.experts and self.ep > 1:
                    group += f"<br/>ep group {d // self.ep}, rank {d % self.ep}"
                rows.append(f'<tr><td><font point-size="9">{group}</font></td>{cells}</tr>')
            table = f'<table border="0" cellborder="1" cellspacing="0" cellpadding="6">{"".join(rows)}</table>'
            out.append(f"  stage{stage.index} [shape=plain, label=<{table}>];")
        out.append("  input -> stage0;")
        for s in range(len(self.stages) - 1):
            out.append(f'  stage{s} -> stage{s + 1} [label="{_q(self.stages[s].output + _over(self.stages[s]))}"];')
        out.append(f'  stage{len(self.stages) - 1} -> loss [label="{_q(self.stages[-1].output)}"];')
        out.append("}")
        return "\n".join(out)

    def _moe_line(self, stage: StageView) -> str:
        if not stage.experts:
            return ""
        split = f", split over ep={self.ep} replicas (all-to-all within each ep group)" if self.ep > 1 else ""
        return f"<br/>MoE: {stage.experts} experts per layer{split}"

    def _held(self, stage: StageView, d: int) -> str:
        """The experts replica d's actors hold (under expert parallelism)."""
        if not stage.experts or self.ep == 1:
            return ""
        per = stage.experts // self.ep
        first = (d % self.ep) * per
        return f"<br/>experts {first}-{first + per - 1}"

    def to_mermaid(self) -> str:
        """Mermaid flowchart text of the same picture."""
        out = ["flowchart LR", f'  input(["batch {self.input}"])']
        for stage in self.stages:
            out.append(
                f'  subgraph S{stage.index}["{stage.heading}: layers [{stage.layers[0]}, {stage.layers[1]}) '
                f'- {stage.kinds} - {stage.parameters:,} parameters"]'
            )
            for a in stage.actors:
                where = a.device + (f" @ node {a.node}" if a.node else "")
                box = a.name.replace("-", "_") + ("" if stage.on_stage is None else f"_{stage.index}")  # one per chunk
                out.append(f'    {box}["{a.name}<br/>{where}"]')
            out.append("  end")
        out.append("  input --> S0")
        for s in range(len(self.stages) - 1):
            out.append(f'  S{s} -- "{self.stages[s].output}{_over(self.stages[s])}" --> S{s + 1}')
        out.append(f'  S{len(self.stages) - 1} -- "{self.stages[-1].output}" --> loss(["loss"])')
        return "\n".join(out) + "\n"

    def save(self, path: str | Path) -> Path:
        """Writes by extension: .png, .svg, .pdf (Graphviz), .dot (its source) or .mmd (Mermaid)."""
        path = Path(path)
        suffix = path.suffix.lower()
        path.parent.mkdir(parents=True, exist_ok=True)
        if suffix == ".mmd":
            path.write_text(self.to_mermaid())
        elif suffix == ".dot":
            path.write_text(self.to_dot())
        elif suffix in (".png", ".svg", ".pdf"):
            import graphviz

            path.write_bytes(graphviz.Source(self.to_dot()).pipe(format=suffix[1:]))
        else:
            raise ValueError(f"cannot draw a diagram as {path.name!r}: use .png, .svg, .pdf, .dot or .mmd")
        return path

    def _repr_svg_(self) -> str:  # Jupyter shows it inline (needs dot)
        import graphviz

        return graphviz.Source(self.to_dot()).pipe(format="svg").decode()


def _boundary_shapes(
    specs: Sequence[LayerSpec], plan: Sequence[tuple[int, int]], sample: torch.Tensor | None
) -> list[str]:
    """The input's shape, then each stage's output shape, from a forward on the meta device."""
    if sample is None:
        return ["?"] * (len(plan) + 1)
    shapes = [_describe(sample)]
    x = sample.to("meta")
    try:
        with torch.device("meta"), torch.no_grad():
            for start, end in plan:
                for spec in specs[start:end]:
                    x = spec.build()(x)
                shapes.append(_describe(x))
    except Exception:  # a layer the meta device cannot run: leave the shapes unknown
        shapes += ["?"] * (len(plan) + 1 - len(shapes))
    return shapes


def _over(stage: StageView) -> str:
    """The edge label's transport part, e.g. " over shm"; empty when drawn from the config alone."""
    return f" over {stage.link}" if stage.link else ""


def _describe(x: object) -> str:
    if torch.is_tensor(x):
        return f"({', '.join(map(str, x.shape))}) {str(x.dtype).removeprefix('torch.')}"
    return type(x).__name__


def _kinds(specs: Sequence[LayerSpec]) -> str:
    """Layer class names with repeats folded: "Embedding, Block x2, Head"."""
    names = [getattr(s.factory, "__name__", "layer") for s in specs]
    out: list[list[Any]] = []
    for name in names:
        if out and out[-1][0] == name:
            out[-1][1] += 1
        else:
            out.append([name, 1])
    return ", ".join(n if c == 1 else f"{n} x{c}" for n, c in out)


def _experts(specs: Sequence[LayerSpec]) -> int:
    """The most experts of any MoE layer among `specs` (built on the meta device), 0 if none."""
    from raypipe.nn.moe import moe_layers

    most = 0
    for spec in specs:
        try:
            with torch.device("meta"):
                most = max([most] + [m.num_experts for _, m in moe_layers(spec.build())])
        except Exception:  # a layer that cannot be built on the meta device holds no experts we can show
            continue
    return most


def _title(config: TrainConfig) -> str:
    ep = f" (ep={config.ep})" if config.ep > 1 else ""
    return (
        f"pp={config.pp} x dp={config.dp}{ep} x tp={config.tp}, {config.schedule}, {config.microbatches} microbatches"
    )


def _q(text: str) -> str:
    return text.replace('"', '\\"')


def _html(text: str) -> str:
    from xml.sax.saxutils import escape

    return escape(text)
