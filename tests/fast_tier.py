"""The fast tier, `make test-fast` (`pytest -m fast`): the Ray-free units, the cheap tooling
checks and every parity axis once, in at most 5 minutes on 2 cores, to run on every change.
The whole suite (`make test`) runs each axis across its grid before an issue is resolved.

An entry is a folder (`unit/`), a file, a test (every parametrisation of it) or one case by
its id, relative to tests/. conftest marks what they name and refuses an entry that names
nothing, so a renamed case cannot drop out of the tier unnoticed. Entries under SKIPPED leave
the named tests out again (a slow one inside a listed folder).
"""

from __future__ import annotations

from collections.abc import Iterable

FAST: dict[str, str] = {
    "unit/": "schedules, configs, data, optimizers, shard plans, the wire and the p2p protocol, no Ray",
    "tooling/": "layout, ruff, this tier's list, docs' examples, packaging, the Makefile, benchmark machinery",
    "parity/test_parity.py::test_sgd_momentum_parity[pp4-p2p-shm-8-1f1b]": "pp 4, 1F1B, the p2p engine over shm",
    "parity/test_parity.py::test_sgd_momentum_parity[pp3-refs-shm-4-gpipe]": "GPipe, the refs engine",
    "parity/test_parity.py::test_sgd_momentum_parity[pp2-compiled-gloo-2-1f1b]": "the compiled engine over gloo",
    "parity/test_parity.py::test_activation_checkpointing_recomputes_and_changes_nothing_numerically"
    "[pp2-compiled-gloo]": "activation checkpointing",
    "parity/test_data_parallel.py::test_adamw_with_clipping_parity_while_zero_switches_on_and_off[pp2-dp2]": (
        "dp with ZeRO-1, AdamW, global clipping"
    ),
    "parity/test_tensor_parallel.py::test_sgd_parity_and_identical_replicas[pp2-dp2-tp2-1f1b]": "tp inside pp x dp",
    "parity/test_zero_bubble.py::test_parity_with_one_process[pp2-zb-v-dp1-tp1-4]": "ZB-V: chunks, split backwards",
    "parity/test_pytree_boundaries.py::test_a_dict_boundary_trains_exactly_as_one_process"
    "[p2p-2-interleaved-1f1b-shm]": "interleaved 1F1B, a pytree boundary",
    "parity/test_moe.py::test_dualpipe_v_pairs_forwards_with_backwards_across_the_all_to_all": (
        "DualPipeV, MoE with ep through the all-to-all"
    ),
    "parity/test_zero3.py::test_parity_with_one_process[1f1b]": "ZeRO-3",
    "parity/test_precision.py::test_autocast_matches_one_process_autocast_and_not_fp32": "bf16 and fp16 autocast",
    "parity/test_hf.py::test_training_matches_transformers_in_one_process[llama-pp2-dp1-tp1]": "a transformers model",
    "parity/test_hf_families.py::test_a_family_from_its_pipeline_plan_trains_like_transformers[qwen3-pp2-tp1]": (
        "a family from transformers' pipeline plan"
    ),
    "parity/test_hf_io.py::test_a_cpu_stages_frozen_lora_base_is_a_view_of_its_file_and_its_embedding_reads_rows": (
        "a frozen base mapped from its file, its embedding and tied head computed from it (no Ray)"
    ),
    "parity/test_lora.py::test_lora_matches_peft_in_one_process_and_leaves_the_base_untouched[llama-pp2-dp1]": (
        "LoRA against peft"
    ),
    "parity/test_device_links.py::test_interleaved_chunks_on_ordered_streams_train_like_one_process[4]": (
        "device links: NCCL's protocol, run over gloo"
    ),
    "parity/test_module_split.py::test_a_module_split_at_named_points_trains_exactly_as_in_one_process": (
        "a user's own nn.Module"
    ),
    "parity/test_sequence_chunks.py::test_a_transformers_model_trains_on_chunks_exactly_as_unchunked"
    "[llama-pp2]": "sequence chunks (Seq1F1B) through transformers' cache path",
    "parity/test_fit_overlap.py::test_queued_steps_train_exactly_like_single_steps": "fit's queued step",
    "parity/test_fit_overlap.py::test_actor_driven_runs_train_exactly_like_single_steps": "runs the actors drive",
    "recovery/test_checkpoint.py::test_resume_continues_exactly_on_any_topology[pp2]": "a checkpoint resumed",
    "parity/test_dpo.py::test_dpo_through_the_pipeline_equals_trls_dpo_trainer[sigmoid-new-adapter-dp1]": (
        "DPO against TRL's DPOTrainer, resumed"
    ),
    "parity/test_dpo.py::test_preference_records_are_tokenized_into_trls_columns": "preference data",
    "parity/test_grpo.py::test_grpo_steps_through_the_pipeline_equal_trls_grpo_trainer[grpo-new-adapter-dp1-refs]": (
        "GRPO against TRL's GRPOTrainer"
    ),
    "parity/test_grpo.py::test_grpo_settings_are_checked_with_what_to_give": "GRPO's settings",
    "parity/test_kto.py::test_kto_through_the_pipeline_equals_trls_kto_trainer_and_resumes_and_recovers": (
        "KTO against TRL's KTOTrainer, resumed, a stage lost in a pass"
    ),
    "parity/test_kto.py::test_kto_settings_and_records_are_checked_with_what_to_give": "KTO's settings and records",
}

SKIPPED: dict[str, str] = {
    "tooling/test_gpu_check.py::test_the_gpu_check_runs_every_part_tiny_on_the_cpu_and_writes_its_report": (
        "two minutes: the whole suite runs it"
    ),
    "unit/test_partition.py::test_raypipe_plan_profiles_the_jobs_model_and_writes_json": "profiles a real model",
    "unit/test_partition.py::test_profile_partition_balances_measured_layer_times": "profiles on real actors",
}


def _names(entry: str, nodeid: str) -> bool:
    path = "tests/" + entry
    if path.endswith("/") or path.endswith(".py"):
        return nodeid.startswith(path)
    return nodeid == path or nodeid.startswith(path + "[")


def mark(items: Iterable, marker) -> list[str]:
    """Adds `marker` to the items FAST names and SKIPPED does not; returns the entries that
    named no collected item (only meaningful when the whole suite was collected)."""
    items = list(items)
    used = set()
    for item in items:
        hits = [e for e in FAST if _names(e, item.nodeid)]
        used.update(hits)
        skipped = [e for e in SKIPPED if _names(e, item.nodeid)]
        used.update(skipped)
        if hits and not skipped:
            item.add_marker(marker)
    return sorted(set(FAST) - used) + sorted(set(SKIPPED) - used)
