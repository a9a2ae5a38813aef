"""`TrainConfig.adapters`: LoRA adapters and a quantized frozen base (QLoRA)."""

from __future__ import annotations

from raypipe.config.sections.base import Section, section
from raypipe.config.settings import LoraSettings
from raypipe.nn import lora


@section("adapters")
class AdaptersConfig(Section):
    """What trains when only adapters do: LoRA's settings and the frozen base's storage.

    Attributes:
        lora: low-rank adapters through peft: a `peft.LoraConfig` or its fields (`r`, `lora_alpha`
            or `alpha`, `target_modules` as names, a regex or "all-linear", `use_rslora`, `bias`, ...),
            each meaning what peft means (`raypipe.nn.lora`); what peft trains trains, the rest is frozen.
        quantize: QLoRA: "nf4" or "int8" stores the frozen base's linears through bitsandbytes
            (cpu, cuda, rocm stages), or one entry per stage (null keeps a stage's dtype).
    """

    lora: LoraSettings | None = None
    quantize: str | list[str | None] | None = None

    def __post_init__(self) -> None:  # quantize against the stages and tp against LoRA: `validation.check_across`
        self.normalise("lora", lora.check(self.lora))
