"""Tiny transformers models for the HF tests, saved to a directory as transformers saves them,
and the one-process reference training the raypipe runs are checked against."""

from __future__ import annotations

import warnings

import torch

VOCAB = 48


FAMILY_SHAPE = dict(
    hidden_size=16,
    intermediate_size=32,
    num_hidden_layers=3,
    num_attention_heads=4,
    num_key_value_heads=2,
    vocab_size=VOCAB,
    max_position_embeddings=32,
    bos_token_id=0,
    eos_token_id=None,
    pad_token_id=None,
)


def tiny_config(kind: str, **overrides):
    """A GPT-2 (tied head), Llama (grouped-query attention, untied) or Mistral config of a few kB of weights,
    dropout off so training is deterministic, no end-of-sequence token so generation never stops."""
    from transformers import GPT2Config, LlamaConfig

    if kind == "gpt2":
        return GPT2Config(
            **{
                **dict(
                    n_embd=16,
                    n_layer=4,
                    n_head=2,
                    vocab_size=VOCAB,
                    n_positions=32,
                    embd_pdrop=0.0,
                    attn_pdrop=0.0,
                    resid_pdrop=0.0,
                    bos_token_id=0,
                    eos_token_id=None,
                ),
                **overrides,
            }
        )
    if kind == "mistral":  # a Llama's shapes with a sliding window (give `sliding_window`)
        from transformers import MistralConfig

        return MistralConfig(**{**FAMILY_SHAPE, "num_hidden_layers": 4, **overrides})
    return LlamaConfig(**{**FAMILY_SHAPE, "num_hidden_layers": 4, **overrides})


def save_tiny(kind: str, directory: str, seed: int = 0, **overrides) -> str:
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        AutoModelForCausalLM.from_config(tiny_config(kind, **overrides)).save_pretrained(directory)
    return directory


def load(directory: str):
    """The model transformers loads from `directory`, with the attention it picks (sdpa where the
    family has it), as raypipe picks by default."""
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(directory)


def lm_batch(k: int, size: int = 8, length: int = 10):
    """Token ids with left padding on some rows (attention mask 0, label -100) and a few more
    ignored labels, so microbatches count different numbers of tokens."""
    g = torch.Generator().manual_seed(500 + k)
    ids = torch.randint(1, VOCAB, (size, length), generator=g)
    mask = torch.ones(size, length, dtype=torch.long)
    for row, pad in zip(range(0, size, 3), (3, 1, 4)):
        mask[row, :pad] = 0
    labels = ids.masked_fill(mask == 0, -100)
    labels[1, 4:7] = -100
    return {"input_ids": ids, "attention_mask": mask}, labels


def hf_reference(
    directory: str,
    steps: int = 3,
    lr: float = 0.05,
    momentum: float = 0.9,
    data=lm_batch,
    bf16: bool = False,
    prepare=None,
):
    """The transformers model trained in one process on whole batches: every step's loss, the first
    step's gradients and the final state dict, keyed by transformers' names (`.default.` of peft's
    adapters dropped). With `bf16` the model is stored in bfloat16 and (fused) SGD steps fp32
    master copies of its weights; `prepare(model)` returns the model to train (peft's, say),
    whose weights that need no gradient stay as they are."""
    model = load(directory).to(torch.bfloat16 if bf16 else torch.float32)
    model = prepare(model) if prepare is not None else model
    model.train()
    params = [p for p in model.parameters() if p.requires_grad]
    masters = [p.detach().float().clone() for p in params] if bf16 else params
    opt = torch.optim.SGD(masters, lr=lr, momentum=momentum, **({"fused": True} if bf16 else {}))
    losses, grads = [], None
    for k in range(steps):
        x, labels = data(k)
        model.zero_grad()
        loss = model(**x, labels=labels).loss
        loss.backward()
        losses.append(loss.item())
        if grads is None:
            grads = {
                n.replace(".default.", "."): p.grad.clone() for n, p in model.named_parameters() if p.requires_grad
            }
        for p, master in zip(params, masters) if bf16 else ():
            master.grad = p.grad.float()
        opt.step()
        with torch.no_grad():
            for p, master in zip(params, masters) if bf16 else ():
                p.copy_(master)
    return losses, grads, {k.replace(".default.", "."): v for k, v in model.state_dict().items()}


def run_schedules(trainer, start: dict, steps: int = 3, data=lm_batch, schedules=None):
    """Per schedule (1F1B, GPipe, and ZB-H1's split backward through the model's own layers and
    adapters, unless `schedules` are given), from the weights `start` with fresh optimizer state:
    the losses of `steps` steps, the first step's gradients and the final state dict. A schedule
    may be a dict of `reconfigure` settings instead, its run keyed by their values."""
    out = {}
    for schedule in schedules or ("1f1b", "gpipe", "zb-h1"):
        # a schedule's name, or the settings of a run (`reconfigure`'s), keyed by their values
        settings = schedule if isinstance(schedule, dict) else {"schedule": schedule}
        schedule = schedule if isinstance(schedule, str) else tuple(settings.values())
        trainer.reconfigure(**settings)
        trainer.reset_optimizer()
        trainer.load_state_dict(start)
        losses, grads = [], None
        for k in range(steps):
            losses.append(trainer.step(*data(k))["loss"])
            grads = grads if grads is not None else trainer.gradients()
        out[schedule] = losses, grads, trainer.state_dict()
    return out


def by_hf_name(values: dict, names: dict) -> dict:
    """raypipe-keyed tensors under transformers' names (keys a tied head repeats are dropped)."""
    return {names[k]: v for k, v in values.items() if names.get(k)}


def tiny_mixtral(**overrides):
    """A Mixtral of 4 experts per layer (top 2), routing loss on with a coefficient large enough to
    matter, grouped-query attention."""
    from transformers import MixtralConfig

    return MixtralConfig(
        **{
            **dict(
                hidden_size=16,
                intermediate_size=32,
                num_hidden_layers=4,
                num_attention_heads=4,
                num_key_value_heads=2,
                vocab_size=VOCAB,
                max_position_embeddings=32,
                num_local_experts=4,
                num_experts_per_tok=2,
                output_router_logits=True,
                router_aux_loss_coef=0.05,
                bos_token_id=0,
                eos_token_id=None,
                pad_token_id=None,
            ),
            **overrides,
        }
    )


def hf_microbatch_reference(
    directory: str, parts: int, steps: int = 3, lr: float = 0.05, momentum: float = 0.9, data=lm_batch
):
    """The transformers model trained in one process with gradient accumulation over `parts` equal
    microbatches, each loss (transformers' own, with a MoE's routing loss for that forward call)
    weighted by its share of the batch's counted tokens, as raypipe weighs microbatches. Returns
    (losses, first-step gradients, final state dict) under transformers' names."""
    model = load(directory)
    model.train()
    opt = torch.optim.SGD(model.parameters(), lr=lr, momentum=momentum)
    losses, grads = [], None
    for k in range(steps):
        x, labels = data(k)
        inputs = [{key: v.chunk(parts)[i] for key, v in x.items()} for i in range(parts)]
        targets = labels.chunk(parts)
        counts = [int((t[..., 1:] != -100).sum()) for t in targets]
        model.zero_grad()
        total = 0.0
        for xi, ti, count in zip(inputs, targets, counts):
            loss = model(**xi, labels=ti).loss * (count / sum(counts))
            loss.backward()
            total += loss.item()
        losses.append(total)
        if grads is None:
            grads = {n: p.grad.clone() for n, p in model.named_parameters()}
        opt.step()
    return losses, grads, model.state_dict()


def family_config(kind: str):
    """A tiny config of one of the families transformers declares a pipeline plan for, its
    distinguishing settings on: Gemma 3's sliding and full layers, Granite's multipliers, a mixture
    of experts with its routing loss on, DeepSeek-V3's latent attention and shared experts."""
    import transformers as T

    shape = FAMILY_SHAPE
    configs = {
        "qwen3": lambda: T.Qwen3Config(**shape, head_dim=8),
        "qwen3_moe": lambda: T.Qwen3MoeConfig(
            **shape,
            head_dim=8,
            num_experts=4,
            num_experts_per_tok=2,
            moe_intermediate_size=16,
            output_router_logits=True,
            router_aux_loss_coef=0.1,
        ),
        "gemma3": lambda: T.Gemma3TextConfig(
            **shape,
            head_dim=8,
            sliding_window=4,
            layer_types=["sliding_attention", "full_attention", "sliding_attention"],
        ),
        "gemma2": lambda: T.Gemma2Config(**shape, head_dim=8, sliding_window=4),
        "phi3": lambda: T.Phi3Config(**{**shape, "pad_token_id": 1}),
        "olmo2": lambda: T.Olmo2Config(**shape),
        "gpt_neox": lambda: T.GPTNeoXConfig(
            **{k: v for k, v in shape.items() if k != "num_key_value_heads"}, use_parallel_residual=True
        ),
        "granite": lambda: T.GraniteConfig(
            **shape, embedding_multiplier=3.0, logits_scaling=2.0, residual_multiplier=0.5, attention_multiplier=0.3
        ),
        "deepseek_v3": lambda: T.DeepseekV3Config(
            **{**shape, "num_key_value_heads": 4},
            kv_lora_rank=8,
            q_lora_rank=8,
            qk_rope_head_dim=4,
            qk_nope_head_dim=4,
            v_head_dim=4,
            n_routed_experts=4,
            num_experts_per_tok=2,
            moe_intermediate_size=16,
            first_k_dense_replace=1,
            n_group=1,
            topk_group=1,
        ),
    }
    return configs[kind]()


def save_family(kind: str, directory: str, seed: int = 0) -> str:
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        AutoModelForCausalLM.from_config(family_config(kind)).save_pretrained(directory)
    return directory


def small_job(base: str, *extra: str) -> list[str]:
    """Overrides that make an example job of examples/configs/ train `base` (a tiny model directory)
    for 4 steps of 4 samples in a test: no progress bar, no logs, small actors."""
    return [
        f"model.hf={base}",
        "model.block_size=32",
        "job.steps=4",
        "job.batch_size=4",
        "data.max_bytes=300000",
        "log_dir=null",
        "job.progress=false",
        "cpus_per_actor=0.25",
        "threads_per_actor=1",
        *extra,
    ]


def assert_equal_to_trl(steps: list[dict], losses: list[float], metrics: list[dict], names) -> None:
    """Each step's loss and its metrics `names` equal a TRL trainer's on the same batches (rtol
    1e-5): the preference objectives' parity bar."""
    torch.testing.assert_close(torch.tensor([s["loss"] for s in steps]), torch.tensor(losses), rtol=1e-5, atol=1e-6)
    for got, want in zip(steps, metrics):
        torch.testing.assert_close(
            torch.tensor([got[m] for m in names]), torch.tensor([want[m] for m in names]), rtol=1e-5, atol=1e-6
        )


def trl_sgd_steps(trainer, trained, batches, names, sgd: dict) -> tuple[list[float], list[dict]]:
    """A TRL `trainer`'s loss on each of `batches` (records its collator takes), stepped by SGD with
    momentum over the `trained` parameters here: each step's loss and its metrics `names`."""
    opt = torch.optim.SGD(trained, lr=sgd["lr"], momentum=sgd["momentum"])
    trainer.model.train()
    losses, metrics = [], []
    for batch in batches:
        loss = trainer.compute_loss(trainer.model, trainer.data_collator(batch))
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
        metrics.append({m: trainer._metrics["train"][m][-1] for m in names})
    return losses, metrics
