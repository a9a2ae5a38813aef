"""The bugs `benchmarks/mutation_check.py` plants, one exact piece of source each, with the tests
that must catch it; the tooling tests check every anchor is still in the source."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Mutation:
    name: str
    path: str
    old: str
    new: str
    tests: tuple[str, ...]
    what: str


MUTATIONS = [
    Mutation(
        "1f1b-order",
        "raypipe/schedules/one_f_one_b.py",
        "return min(num_stages - stage - 1 + extra, num_microbatches)",
        "return min(num_stages - stage + extra, num_microbatches)",
        (
            "tests/unit/test_schedules.py",
            "tests/interfaces/test_metrics.py::test_stashed_activations_gpipe_holds_all_1f1b_at_most_p_minus_s",
        ),
        "1F1B runs one warm-up forward too many (holds p - s + 1 microbatches)",
    ),
    Mutation(
        "dp-averaging",
        "raypipe/transport/collective.py",
        "    flat.div_(size)\n",
        "",
        ("tests/parity/test_data_parallel.py",),
        "the dp all-reduce sums instead of averaging",
    ),
    Mutation(
        "dp-last-bucket",
        "raypipe/transport/collective.py",
        "    for bucket in bucket_plan(tensors, bucket_bytes):",
        "    for bucket in bucket_plan(tensors, bucket_bytes)[:-1]:",
        ("tests/parity/test_dp_buckets.py",),
        "the last gradient bucket is never reduced",
    ),
    Mutation(
        "zero1-broadcast",
        "raypipe/actors/optim/optimizer.py",
        "        if not skipped and self.zero_active():\n            self.broadcast_owned()\n",
        "",
        ("tests/parity/test_data_parallel.py",),
        "ZeRO-1 replicas never receive the shares the others stepped",
    ),
    Mutation(
        "checkpoint-checksum",
        "raypipe/checkpoint/layout.py",
        "if contents and sha256_file(file) != sha:",
        "if False:",
        ("tests/recovery/test_checkpoint.py",),
        "a checkpoint's checksums are not verified on load (by the actors, or anywhere)",
    ),
    Mutation(
        "fp16-unscale",
        "raypipe/actors/optim/optimizer.py",
        "            torch._foreach_div_(grads, self.scaler.scale)\n",
        "            pass\n",
        ("tests/parity/test_precision.py",),
        "fp16 gradients are never unscaled",
    ),
    Mutation(
        "bf16-autocast",
        "raypipe/actors/step/executor.py",
        "dtype = AUTOCAST_DTYPES.get(self.settings.precision)\n        if dtype is None:",
        "dtype = AUTOCAST_DTYPES.get(self.settings.precision)\n        if dtype is None or dtype == torch.bfloat16:",
        ("tests/parity/test_precision.py",),
        "bf16 autocast silently off",
    ),
    Mutation(
        "lr-warmup",
        "raypipe/actors/optim/build.py",
        "        return base_lr * (step + 1) / warmup\n",
        "        return base_lr\n",
        ("tests/interfaces/test_metrics.py::test_learning_rate_of_every_step_reaches_the_optimizer_and_tensorboard",),
        "learning-rate warm-up ignored",
    ),
    Mutation(
        "activation-recompute",
        "raypipe/actors/step/executor.py",
        "recompute = self.settings.activation_checkpointing and torch.is_grad_enabled()",
        "recompute = False",
        ("tests/parity/test_parity.py::test_activation_checkpointing_recomputes_and_changes_nothing_numerically",),
        "activation_checkpointing=True does nothing",
    ),
    Mutation(
        "tied-grad-sum",
        "raypipe/actors/optim/optimizer.py",
        "            dist.all_reduce(param.grad, group=group)\n",
        "            pass\n",
        ("tests/parity/test_hf.py::test_training_matches_transformers_in_one_process",),
        "a weight tied across stages (GPT-2's head) never gets the other holder's gradient",
    ),
    Mutation(
        "token-weights",
        "raypipe/data/batches.py",
        '    count = getattr(loss_fn, "count", None)\n',
        "    count = None\n",
        ("tests/parity/test_hf.py::test_training_matches_transformers_in_one_process",),
        "microbatches weigh the same whatever tokens their labels ignore",
    ),
    Mutation(
        "bf16-masters",
        "raypipe/actors/optim/optimizer.py",
        "                master.grad = None if p.grad is None else p.grad.float()\n",
        "                master.grad = None if p.grad is None else p.grad.float()\n                master.copy_(p)\n",
        ("tests/parity/test_hf.py::test_bf16_weights_train_through_fp32_master_copies",),
        "bf16 weights' masters are reset to the rounded weights every step (no fp32 accumulation)",
    ),
    Mutation(
        "pytree-grad-pairs",
        "raypipe/actors/step/executor.py",
        "if torch.is_tensor(o) and o.requires_grad and g is not None\n        ]\n",
        "if torch.is_tensor(o) and o.requires_grad and g is not None\n        ][:1]\n",
        ("tests/parity/test_pytree_boundaries.py",),
        "only the first tensor of a pytree boundary gets its gradient back",
    ),
    Mutation(
        "zb-weight-grads",
        "raypipe/actors/step/split_backward.py",
        "        torch_backward().stage_backward_weight(iter(weights), deferred.groups)\n",
        "        pass\n",
        ("tests/parity/test_zero_bubble.py::test_parity_with_one_process",),
        "a split backward's W computes no weight gradients (only the first stage's whole backward runs)",
    ),
    Mutation(
        "interleaved-chunk-order",
        "raypipe/schedules/interleaved.py",
        "            chunk = v - 1 - chunk\n",
        "            pass\n",
        ("tests/unit/test_schedules.py",),
        "interleaved 1F1B walks the chunks forward in its backwards too",
    ),
    Mutation(
        "v-hand-over",
        "raypipe/actors/step/step_list.py",
        '                handed[("F", v + 1, m)] = out\n',
        '                handed[("F", v + 1, m)] = x\n',
        ("tests/parity/test_zero_bubble.py::test_parity_with_one_process",),
        "at the turn of a V the next chunk gets the chunk's input instead of its output",
    ),
    Mutation(
        "moe-capacity-priority",
        "raypipe/nn/moe.py",
        "        expert = chosen.t().reshape(-1)\n        token = torch.arange(n, device=x.device).repeat(self.top_k)\n"
        "        gate = gates.t().reshape(-1)\n",
        "        expert = chosen.reshape(-1)\n        token = torch.arange(n, device=x.device).repeat_interleave(self.top_k)\n"  # noqa: E501
        "        gate = gates.reshape(-1)\n",
        ("tests/parity/test_moe.py::test_capacity_keeps_first_choices_first_and_counts_drops",),
        "capacity keeps a token's second choice before later tokens' first choices",
    ),
    Mutation(
        "moe-expert-grad-mean",
        "raypipe/actors/optim/optimizer.py",
        "                torch._foreach_div_(grads, self.dp_size)\n",
        "                pass\n",
        ("tests/parity/test_moe.py::test_parity_with_the_one_process_model",),
        "expert gradients (summed over the ep group's tokens) are not divided by dp when ep = dp",
    ),
    Mutation(
        "moe-expert-holders",
        "raypipe/actors/optim/optimizer.py",
        "all_reduce_mean(grads, self.expert_group, self.dp_size, self.settings.dp_bucket_bytes)",
        "all_reduce_mean(grads, self.expert_group, len(self.expert_ranks), self.settings.dp_bucket_bytes)",
        ("tests/parity/test_moe.py::test_parity_with_the_one_process_model",),
        "expert gradients averaged over their holders instead of divided by dp (too large by ep)",
    ),
    Mutation(
        "moe-norm-share",
        "raypipe/actors/optim/optimizer.py",
        "(experts if self.dp_rank < self.ep_size else [])",
        "(experts if self.dp_rank == 0 else [])",
        ("tests/parity/test_moe.py::test_parity_with_the_one_process_model",),
        "the global gradient norm counts only replica 0's experts",
    ),
    Mutation(
        "moe-a2a-backward",
        "raypipe/nn/moe.py",
        "        return _exchange(grad, ctx.recv, ctx.send, ctx.group), None, None, None",
        "        return _exchange(grad, ctx.recv, ctx.send, ctx.group) * 0, None, None, None",
        ("tests/parity/test_moe.py::test_parity_with_the_one_process_model",),
        "tokens' gradients never come back from their experts (all-to-all backward drops them)",
    ),
    Mutation(
        "gang-placement",
        "raypipe/driver/cluster/placement.py",
        "            gang.reserve(\n",
        "            None and gang.reserve(\n",
        ("tests/cluster/test_gang.py::test_a_waiting_trainer_holds_nothing_and_strict_spread_needs_a_node_per_actor",),
        "actors are started one by one outside their reserved group (a trainer can hold half a cluster)",
    ),
    Mutation(
        "safetensors-pickle",
        "raypipe/checkpoint/files.py",
        "    if path.suffix == LEGACY:\n        return torch.load",
        "    if True:\n        return torch.load",
        ("tests/recovery/test_checkpoint.py::test_loading_unpickles_nothing_and_pickle_checkpoints_still_load",),
        "checkpoint tensors are read through torch.load (unpickling)",
    ),
    Mutation(
        "reader-seek",
        "raypipe/actors/io/reader.py",
        "        if self.rows is None or step < self.position:\n",
        "        if self.rows is None:\n",
        ("tests/interfaces/test_ray_data.py::test_a_stage_death_replays_the_same_batches",),
        "the dataset reader does not go back for the steps a recovery replays",
    ),
    Mutation(
        "iterable-replay",
        "raypipe/driver/run/controller.py",
        "self.feed.kept_from(self.restored if self.group.config.max_restarts else self.run.step_count)",
        "self.feed.kept_from(self.run.step_count)",
        ("tests/interfaces/test_ray_data.py::test_a_stage_death_replays_the_same_batches",),
        "an iterable's batches since the last checkpoint are dropped, so a recovery cannot replay them",
    ),
    Mutation(
        "storage-prune",
        "raypipe/checkpoint/tidy.py",
        "if manifest is None and step_of(p) < step_of(newest)]",
        "if step_of(p) < step_of(newest)]",
        ("tests/recovery/test_object_storage.py",),
        "pruning an object store also deletes complete checkpoints older than the newest",
    ),
    Mutation(
        "logger-step",
        "raypipe/driver/run/step.py",
        "    run.loggers.log(run.step_count, scalars(metrics))\n    return Outcome(",
        "    run.loggers.log(run.step_count - 1, scalars(metrics))\n    return Outcome(",
        ("tests/interfaces/test_loggers.py",),
        "the loggers record each step's scalars one step early",
    ),
    Mutation(
        "stream-poison",
        "raypipe/transport/stream.py",
        "        message[:FLAG_BYTES].view(torch.int64).fill_(POISON)\n        self._post(message, tag)\n",
        "        message[:FLAG_BYTES].view(torch.int64).fill_(POISON)\n",
        ("tests/parity/test_device_links.py::test_a_failed_step_leaves_every_stream_in_step",),
        "a failed stage's stream (NCCL's or gloo's) skips its poison, so the receiver takes the next "
        "message in its place",
    ),
    Mutation(
        "nccl-shared-gpu",
        "raypipe/driver/links/ways.py",
        'return "nccl" if all(cuda) and not shares_gpu(infos, [a, b]) else None',
        'return "nccl" if all(cuda) else None',
        ("tests/parity/test_device_links.py",),
        "two stages sharing a GPU are linked over NCCL, which refuses two ranks on one device",
    ),
    Mutation(
        "sequence-kv-gradients",
        "raypipe/actors/step/executor.py",
        "pairs += self.sequence.roots(microbatch, v)",
        "pairs += self.sequence.roots(microbatch, v)[:0]",
        ("tests/parity/test_sequence_chunks.py::test_the_gpt_trains_on_chunks_exactly_as_unchunked_at_pp2_and_pp3",),
        "a sequence chunk's backward drops the gradients later chunks gave its keys and values",
    ),
    Mutation(
        "chunk-attention-hidden-rows",
        "raypipe/nn/chunk_attention.py",
        'lse = lse.masked_fill(torch.isneginf(mask).all(-1).expand_as(lse), float("-inf"))',
        "lse = lse + 0.0",
        ("tests/unit/test_chunk_attention.py",),
        "a block whose mask hides a query row entirely weighs in the merge as if it held one key",
    ),
    Mutation(
        "chunk-causal-plan-window",
        "raypipe/models/hf/chunk_cache.py",
        "and (window is None or position.end < window):",
        "and True:",
        (
            "tests/unit/test_sequence_units.py::test_transformers_layers_on_chunks_give_the_whole_sequences_logits_and_gradients",
        ),
        "a sliding layer takes the plain causal plan though its window hides earlier keys",
    ),
    Mutation(
        "chunk-split-leaves",
        "raypipe/nn/sequence_chunks.py",
        "        return outputs, grads, [*inputs, *(t for kv in layers for pair in kv.earlier(c) for t in pair)]",
        "        return outputs, grads, inputs",
        ("tests/parity/test_sequence_chunks.py::test_the_gpt_trains_on_chunks_exactly_as_unchunked_at_pp2_and_pp3",),
        "a split chunk backward leaves the earlier chunks' keys without the gradients it gives them",
    ),
    Mutation(
        "chunk-recompute-keeps-keys",
        "raypipe/nn/sequence_chunks.py",
        "        if not self.replay:",
        "        if True:",
        ("tests/unit/test_sequence_units.py",),
        "a chunk's recomputation (activation checkpointing) keeps its keys and values again after its backward",
    ),
    Mutation(
        "chunk-packed-documents",
        "raypipe/models/hf/chunk_cache.py",
        'elif inputs["position_ids"] is not None:  # packed rows: each document sees only itself',
        "elif False:",
        (
            "tests/parity/test_sequence_chunks.py::"
            "test_a_transformers_model_trains_on_chunks_exactly_as_unchunked[mistral-packed-pp2]",
        ),
        "a chunk of a packed row attends across its documents (transformers separates them only without a cache)",
    ),
]
