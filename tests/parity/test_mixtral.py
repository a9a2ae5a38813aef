"""A transformers Mixtral (4 experts per layer, top 2, its routing loss on) split across stages,
replicas and expert-parallel ranks, against the same transformers model trained in one process
with the same microbatches (transformers computes the routing loss per forward call): every
step's loss, the first step's gradients and the weights after 3 SGD-momentum steps, read back
through `save_pretrained` by transformers itself."""

import pytest
import torch

from raypipe import TrainConfig, Trainer
from raypipe.models import hf

from helpers import assert_close_dicts
from hf_helpers import by_hf_name, hf_microbatch_reference, lm_batch, load, tiny_mixtral

pytest.importorskip("transformers")

SGD = {"name": "sgd", "lr": 0.05, "momentum": 0.9}
M = 2


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    import warnings

    from transformers import AutoModelForCausalLM

    directory = str(tmp_path_factory.mktemp("mixtral"))
    torch.manual_seed(0)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        AutoModelForCausalLM.from_config(tiny_mixtral()).save_pretrained(directory)
    return directory, hf_microbatch_reference(directory, parts=2 * M)


def fused(grads: dict) -> dict:
    """raypipe's per-expert gradients (checkpoint names) in transformers 5's fused layout."""
    out, experts = {}, {}
    for key, value in grads.items():
        if ".block_sparse_moe.experts." in key:
            layer, rest = key.split(".block_sparse_moe.experts.")
            e, w = rest.split(".")[:2]
            experts.setdefault(layer, {}).setdefault(int(e), {})[w] = value
        else:
            out[key.replace(".block_sparse_moe.gate.", ".mlp.gate.")] = value
    for layer, by_expert in experts.items():
        ordered = [by_expert[e] for e in sorted(by_expert)]
        out[f"{layer}.mlp.experts.gate_up_proj"] = torch.stack([torch.cat([w["w1"], w["w3"]]) for w in ordered])
        out[f"{layer}.mlp.experts.down_proj"] = torch.stack([w["w2"] for w in ordered])
    return out


@pytest.mark.slow
@pytest.mark.parametrize("tp", [1, 2])
def test_mixtral_at_dp2_ep2_pp2_matches_transformers(ray_session, saved, tmp_path, tp):
    directory, (ref_losses, ref_grads, ref_final) = saved
    model = hf.from_pretrained(directory)
    config = TrainConfig(
        pp=2, dp=2, ep=2, tp=tp, microbatches=M, optimizer=SGD, cpus_per_actor=0.1, threads_per_actor=1
    )
    names = model.exporter.names(model.layers)
    with Trainer(model, config=config) as t:
        start = t.state_dict()
        for schedule in ("1f1b", "gpipe") if tp == 1 else ("1f1b",):
            t.reconfigure(schedule=schedule)
            t.reset_optimizer()
            t.load_state_dict(start)
            losses = []
            for k in range(3):
                losses.append(t.step(*lm_batch(k))["loss"])
                if k == 0:
                    assert_close_dicts(fused(by_hf_name(t.gradients(), names)), ref_grads)
            torch.testing.assert_close(torch.tensor(losses), torch.tensor(ref_losses), rtol=1e-5, atol=4e-5)
            exported = load(str(t.save_pretrained(str(tmp_path / schedule))))  # every ep rank's experts
            assert_close_dicts(exported.state_dict(), ref_final)
        info = t.stage_info()
        assert {
            i["dp_rank"]: list(i["experts"].values())[0] for i in info if i["stage"] == 0 and i["tp_rank"] == 0
        } == {0: [0, 1], 1: [2, 3]}
        if tp == 1:  # generation: eval mode, no routing loss, replica 0 with its ep group
            prompt = lm_batch(7)[0]["input_ids"][:2, :4]
            expected = exported.generate(prompt, max_new_tokens=5, do_sample=False, pad_token_id=0)
            assert torch.equal(t.generate(prompt, max_new_tokens=5), expected)


def test_router_jitter_is_refused():
    from raypipe import ConfigError
    from raypipe.models.hf.sparse_moe import SparseMoeBlock

    with pytest.raises(ConfigError, match="router_jitter_noise=0.1"):
        SparseMoeBlock(tiny_mixtral(router_jitter_noise=0.1))
