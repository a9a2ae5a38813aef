"""The small model most tests train (`MLP7`), its batches, and the same layers trained in one
process (`reference_run`), the reference every parity check compares against; shared with the
scripts that drive a namespace cluster (`node_loss_script`). Not installed: a trainer ships what
it needs of it to the actors by value, which using it tests too."""

from __future__ import annotations

import torch
from torch import nn

from raypipe import LayerSpec, build_layers

MLP7 = [
    LayerSpec(nn.Linear, 6, 16),
    LayerSpec(nn.Tanh),
    LayerSpec(nn.Linear, 16, 16),
    LayerSpec(nn.GELU),
    LayerSpec(nn.Linear, 16, 12),
    LayerSpec(nn.Tanh),
    LayerSpec(nn.Linear, 12, 3),
]


def batch(k: int, size: int = 16, features: int = 6, outputs: int = 3):
    g = torch.Generator().manual_seed(1000 + k)
    return torch.randn(size, features, generator=g), torch.randn(size, outputs, generator=g)


AUTOCAST = {"bf16": torch.bfloat16, "fp16": torch.float16}


def reference_run(
    specs,
    seed,
    optimizer,
    steps,
    microbatches=1,
    reverse=False,
    grad_clip=None,
    loss_fn=nn.functional.mse_loss,
    data=batch,
    prepare=None,
    precision="fp32",
):
    """Trains nn.Sequential of the same layers in one process.

    The batch gradient is accumulated over `microbatches` equal chunks (in reverse
    order when `reverse`, as GPipe's backwards run), each loss scaled by 1/m.
    `prepare(model)` may add hooks first. `precision` "bf16" or "fp16" runs each forward
    and loss under CPU `torch.autocast`, and fp16 scales the loss with torch's own
    `GradScaler` (unscaled before clipping; an overflowing step is skipped).
    Returns (losses, first-step gradients, final state_dict).
    """
    model = nn.Sequential(*build_layers(specs, seed))
    if prepare is not None:
        prepare(model)
    opt = optimizer(model.parameters())
    scaler = torch.amp.GradScaler("cpu") if precision == "fp16" else None
    losses, first_grads = [], None
    for k in range(steps):
        x, y = data(k)
        opt.zero_grad()
        chunks = list(zip(x.chunk(microbatches), y.chunk(microbatches)))
        total = 0.0
        for xc, yc in reversed(chunks) if reverse else chunks:
            with torch.autocast("cpu", dtype=AUTOCAST.get(precision), enabled=precision in AUTOCAST):
                loss = loss_fn(model(xc), yc)
            scaled = loss.float() / microbatches
            (scaler.scale(scaled) if scaler is not None else scaled).backward()
            total += loss.item()
        losses.append(total / microbatches)
        if scaler is not None:
            scaler.unscale_(opt)
        if grad_clip is not None:
            nn.utils.clip_grad_norm_(model.parameters(), grad_clip)
        if k == 0:
            first_grads = {n: p.grad.clone() for n, p in model.named_parameters()}
        if scaler is not None:
            scaler.step(opt)
            scaler.update()
        else:
            opt.step()
    return losses, first_grads, model.state_dict()
