"""HuggingFace transformers causal LMs as raypipe models.

    model = hf.from_pretrained("path/to/model_dir", dtype="fp32")   # or hf.from_config(config)
    trainer = Trainer(model, config=TrainConfig(pp=2, microbatches=4))
    trainer.step(input_ids, labels)         # or x = {"input_ids": ..., "attention_mask": ...}
    trainer.save_pretrained("out/")         # transformers.AutoModelForCausalLM loads it
    trainer.generate(input_ids, max_new_tokens=20)

The model becomes layers: the embeddings, each decoder layer, the final norm with the
head (`layers`). The driver reads only `config.json`; every stage actor builds its own
layers and reads only their tensors from the directory's safetensors files. Tested
architectures: GPT-2, the Llama family (Llama, Mistral, Qwen2) and Mixtral, whose experts split
across expert-parallel ranks (`moe.py`); another `model_type`
gets an error naming it (`families`). Nothing of transformers is imported until a model
from it is made.
"""

from __future__ import annotations

import copy
import os
from typing import TYPE_CHECKING, Any

import torch

from raypipe.core.errors import ConfigError
from raypipe.core.layers import LayerSpec
from raypipe.models.hf.causal_lm_layers import ConfigRef, build
from raypipe.models.hf.loss import CausalLMLoss
from raypipe.models.hf.tensor_files import DTYPES
from raypipe.models.model import Model

if TYPE_CHECKING:
    from transformers import PretrainedConfig

__all__ = ["CausalLMLoss", "HFModel", "from_config", "from_model", "from_pretrained"]


class HFModel(Model):
    """A transformers causal LM as layer specs, loss and tied weights, with its config (`config`),
    the directory it was read from (`source`, None from a config) and its weights' dtype."""

    config: PretrainedConfig
    source: str | None
    dtype: str

    def skeleton(self) -> object:
        """transformers' whole model of this config, its weights on the meta device (`skeleton.py`)."""
        from raypipe.models.hf.skeleton import skeleton

        return skeleton(self.config)

    def identity(self) -> dict[str, object]:
        """The base model a LoRA run's adapters belong to: its directory, and a hash of its
        config.json and of every safetensors file's size and header (tensor names, dtypes,
        shapes, offsets). Reading the header only keeps this cheap for a model of many GB;
        two directories whose weights differ but whose files have the same layout would hash
        alike, so the path is kept too."""
        if self.source is None:
            return {**super().identity(), "dtype": self.dtype}
        import glob
        import hashlib
        import struct

        digest = hashlib.sha256()
        with open(os.path.join(self.source, "config.json"), "rb") as f:
            digest.update(f.read())
        for path in sorted(glob.glob(os.path.join(self.source, "*.safetensors"))):
            with open(path, "rb") as f:
                (length,) = struct.unpack("<Q", f.read(8))
                digest.update(f"{os.path.basename(path)}:{os.path.getsize(path)}".encode() + f.read(length))
        return {"path": self.source, "hash": digest.hexdigest()[:16], "dtype": self.dtype}


def from_pretrained(
    path: str, dtype: str = "fp32", attn_implementation: str | None = None, verify: bool = True
) -> HFModel:
    """A model from a local transformers model directory (config.json and safetensors weights).

    Args:
        dtype: "fp32" or "bf16", the dtype the weights are kept and trained in.
        attn_implementation: transformers' attention kernel, "sdpa" or "eager"; by default the one
            transformers picks for the model (sdpa where the family supports it).
        verify: check the model type's split against transformers' own forward first, on a small
            model of the same flags (`raypipe.models.hf.verify`, cached per machine); False skips it.

    Raises:
        ConfigError: no such directory, an unsupported model type, or a bad dtype.
    """
    from transformers import AutoConfig

    if not os.path.isdir(path):
        raise ConfigError(
            f"hf.from_pretrained({path!r}): no such directory. raypipe reads local model "
            f"directories only (nothing is downloaded); save one with save_pretrained first."
        )
    try:
        config = AutoConfig.from_pretrained(path)
    except Exception as error:  # noqa: BLE001 - transformers' wording for a broken config.json varies
        raise ConfigError(
            f"{os.path.join(path, 'config.json')} cannot be read as a transformers config "
            f"({type(error).__name__}: {error}): save the model again."
        ) from None
    from raypipe.models.hf.tensor_files import check_files

    check_files(path)  # a truncated or malformed weights file: named now, not in an actor
    return _model(config, os.path.abspath(path), dtype, attn_implementation, verify)


def from_config(
    config: PretrainedConfig, dtype: str = "fp32", attn_implementation: str | None = None, verify: bool = True
) -> HFModel:
    """A model with fresh weights from a transformers config (e.g. `LlamaConfig(...)`), each layer
    initialised on its actor as transformers initialises the whole model, under the run seed."""
    return _model(config, None, dtype, attn_implementation, verify)


def from_model(model: Any, directory: str | None = None, dtype: str | None = None, verify: bool = True) -> HFModel:
    """A transformers causal LM this process holds (made, or loaded with `from_pretrained`), as a
    raypipe model: written once to `directory` as transformers saves it (a temporary directory,
    removed at exit, by default; on a cluster give one every node sees), then read per stage from
    there as `from_pretrained` reads: the driver keeps no second copy of the weights in memory, and
    each stage reads only its own. `Trainer(model)` does this for you.

    Args:
        dtype: "fp32" or "bf16"; by default the model's own.
    """
    import atexit
    import shutil
    import tempfile

    if directory is None:
        directory = tempfile.mkdtemp(prefix="raypipe-model-")
        atexit.register(shutil.rmtree, directory, True)
    if dtype is None:
        dtype = "bf16" if next(model.parameters()).dtype == torch.bfloat16 else "fp32"
    model.save_pretrained(directory)
    return from_pretrained(directory, dtype=dtype, verify=verify)


def is_transformers_model(value: object) -> bool:
    """Whether `value` is a transformers `PreTrainedModel` (without importing transformers)."""
    return any(c.__name__ == "PreTrainedModel" and c.__module__.startswith("transformers") for c in type(value).__mro__)


def _model(
    config: PretrainedConfig, source: str | None, dtype: str, attn_implementation: str | None, verify: bool
) -> HFModel:
    if dtype not in DTYPES:
        raise ConfigError(f"dtype={dtype!r} is invalid: use one of {sorted(DTYPES)}.")
    from raypipe.models.hf.skeleton import plan_of

    config = copy.deepcopy(config)
    if attn_implementation is not None:
        config._attn_implementation = attn_implementation
    plan = plan_of(config)  # a model without a pipeline plan is refused here, naming the way out
    from raypipe.models.hf import verify as check

    aux = check.verdict(config)["aux_loss"] if verify else bool(getattr(config, "router_aux_loss_coef", 0.0))
    n, ref = config.num_hidden_layers, ConfigRef(config)
    specs = (
        [LayerSpec(build, "embedding", ref, None, source, dtype)]
        + [LayerSpec(build, "decoder", ref, i, source, dtype) for i in range(n)]
        + [LayerSpec(build, "head", ref, None, source, dtype)]
    )
    tied = (
        [(f"0.{emb.removeprefix(plan.base + '.')}", f"{n + 1}.{head}") for head, emb in plan.tied.items()]
        if getattr(config, "tie_word_embeddings", False)
        else []
    )
    experts = next((getattr(config, k) for k in EXPERT_COUNTS if getattr(config, k, None)), 0)
    loss = CausalLMLoss(config.vocab_size, experts if aux else 0, getattr(config, "router_aux_loss_coef", 0.0) or 0.0)
    positions = getattr(config, "max_position_embeddings", None) or getattr(config, "n_positions", None)
    model = HFModel(specs, loss, tied, kv_cache=True, vocab_size=config.vocab_size, max_positions=positions)
    model.config, model.source, model.dtype = config, source, dtype
    from raypipe.models.hf.export import HFExporter

    model.exporter = HFExporter(config, plan)
    return model


EXPERT_COUNTS = ("num_local_experts", "num_experts", "n_routed_experts")  # a MoE config's experts, by family
