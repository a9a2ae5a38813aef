"""`TrainConfig.numerics`: the dtypes a step computes and sends in, and what it keeps or compiles."""

from __future__ import annotations

from raypipe.config.checks import check_choice, fail
from raypipe.config.choices import BOUNDARY_DTYPES, PRECISIONS, BoundaryDtype, Precision
from raypipe.config.sections.base import Section, section
from raypipe.transport.compress import CODECS, Codec


@section("numerics")
class NumericsConfig(Section):
    """The dtypes a step computes and sends in, and what it keeps, recomputes or compiles.

    Attributes:
        precision: "fp32", "bf16" (autocast) or "fp16" (autocast with dynamic loss scaling).
        boundary_dtype: the dtype activations and their gradients travel in between
            stages: "fp32" (as computed: exact on any link), or "bf16" / "fp16" to halve the
            bytes sent; the receiving stage computes in its weights' dtype again. "auto" (the
            default): as computed, unless a step shows a measured link between nodes bounding
            it (its wire time half the step or more, float32 most of what crosses it): from
            the next step on, bf16, said in the log with the link and its figures; once chosen
            it is the run's `boundary_dtype` (`raypipe.driver.links.advice`).
        compress_activations: send the activations between stages in 8 bits per element with a
            float32 scale, a quarter of fp32's bytes, for slow links (`raypipe.transport.compress`):
            "fp8" (e4m3, a scale per tensor), "fp8-row" (a scale per row), "int8" (a scale per
            row), or "none". Not exact: the loss it costs on the main job and a Llama is in
            docs/BENCHMARKS.md ("Narrow and compressed stage boundaries"). Vectors and scalars
            (losses, counts) stay exact.
        compress_gradients: the same for the gradients going back, separately.
        activation_checkpointing: recompute each stage's forward during backward instead of
            keeping its intermediate activations.
        compile: torch.compile each layer on its actor (per block, as torchtitan does; inductor
            on CPU needs a C++ compiler; not engine="compiled", Ray's Compiled Graphs): the first
            steps compile (the inductor cache on disk serves the other actors), then each layer
            runs its compiled graph. Microbatches of varying length cost one recompile (dynamic
            shapes after the first change); each step's stage report counts compiled graphs and
            graph breaks (`compiled`). Under a split backward (zb-h1, zb-v, dualpipe-v) a
            compiled stage makes its weight gradients with its input gradients, at I: exact,
            without the zero-bubble gain. Reconfigurable.
        measure_activations: count the bytes autograd saves for backward per stashed
            microbatch (saved-tensor hooks; about 7 % slower forward on CPU), reported
            as `peak_stashed_bytes`. The count of stashed microbatches is always reported.
    """

    precision: Precision = "fp32"
    boundary_dtype: BoundaryDtype = "auto"
    compress_activations: Codec = "none"
    compress_gradients: Codec = "none"
    activation_checkpointing: bool = False
    compile: bool = False
    measure_activations: bool = False

    def __post_init__(self) -> None:
        check_choice("precision", self.precision, PRECISIONS)
        check_choice("boundary_dtype", self.boundary_dtype, BOUNDARY_DTYPES)
        check_choice("compress_activations", self.compress_activations, CODECS)
        check_choice("compress_gradients", self.compress_gradients, CODECS)
        for name in ("activation_checkpointing", "compile", "measure_activations"):
            if not isinstance(getattr(self, name), bool):
                raise fail(name, getattr(self, name), "give true or false.")
