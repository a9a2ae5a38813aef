"""The word after the first timed step across nodes (`raypipe.driver.links.advice`): said where a
measured link's wire time is half the step or more, naming the link, its bytes and the settings
that would shorten it (those not set already); silent otherwise. With `boundary_dtype="auto"` such a
step narrows the boundaries to bf16 where float32 is most of what crossed (the real run:
tests/cluster/test_netns_cluster.py)."""

from raypipe import TrainConfig
from raypipe.driver.links.advice import BOUND_SHARE, Bound, _said, advice, bound, direction_bytes, narrows
from raypipe.planning.links import Link

MBIT_200 = 200e6 / 8  # bytes per second
LINKS = [Link(0, 1, "gloo", MBIT_200, 1e-3), Link(1, 0, "gloo", MBIT_200, 1e-3)]
# benchmarks/slow_link.py's step: 8 microbatches of 2 MiB activations on, as many gradient bytes back
SENT = [8 * 2**21, 8 * 2**21]


def step(seconds: float, sent=SENT, fp32=None) -> dict:
    """A step's metrics as `Trainer.step` gives them; `fp32`: each stage's float32 bytes (all, unless given)."""
    fp32 = sent if fp32 is None else fp32
    stages = [{"sent_bytes": b, "fp32_sent_bytes": f} for b, f in zip(sent, fp32)]
    return {"step": 2, "step_time": seconds, "stages": stages, "warmup": False}


def test_a_link_that_bounds_the_step_is_named_with_its_bytes_and_what_would_shorten_it():
    config = TrainConfig(pp=2, microbatches=8)
    said = advice(LINKS, config, step(1.01))
    wire = 1e-3 + SENT[0] / MBIT_200  # 0.672 s: the busier direction, the activations
    assert said is not None and said.startswith(f"raypipe: step 2 took 1.010 s, {wire:.3f} s of it the wire time")
    assert "stage 0 -> stage 1 over gloo: 200 Mbit/s" in said and "(16.8 MB)" in said, said
    for remedy in ("boundary_dtype='bf16'", "compress_activations='fp8-row'", "(now 8)", "schedule='auto'"):
        assert remedy in said, remedy
    # what is set already is not offered again
    chosen = TrainConfig(pp=2, microbatches=8, boundary_dtype="bf16", schedule="auto")
    said = advice(LINKS, chosen, step(0.6, [b // 2 for b in SENT]))  # 0.336 s of 0.6
    assert said is not None and "boundary_dtype" not in said and "schedule='auto'" not in said, said


def test_silent_where_the_link_is_not_half_the_step_or_not_measured():
    config = TrainConfig(pp=2, microbatches=8)
    assert advice(LINKS, config, step(1.5)) is None  # 0.672 s of 1.5
    unmeasured = [Link(0, 1, "memory"), Link(1, 0, "memory")]
    assert advice(unmeasured, config, step(1.01)) is None
    assert advice([], config, step(1.01)) is None


def test_each_direction_is_read_from_the_stages_sums_by_the_bytes_each_way_takes():
    """Stage s sends its activations on and its input gradients back: at pp 3 with 8-bit activations
    and fp32 gradients, a gradient is four times its activation's bytes."""
    config = TrainConfig(pp=3, compress_activations="fp8-row")
    first, second = 1000, 300  # the activations stage 0 and stage 1 send on
    sent = [first, second + 4 * first, 4 * second]
    assert direction_bytes(sent, config) == {(0, 1): 1000, (1, 0): 4000, (1, 2): 300, (2, 1): 1200}


def test_auto_narrows_a_bound_step_that_was_mostly_float32_and_nothing_else():
    """`boundary_dtype="auto"` (the default) narrows where a link bounds the step and float32 is at
    least half of what crossed; not where the user chose a dtype, where the model sends 16 bits
    already, or where the link keeps up. The log line says what was done and how to keep fp32."""
    auto, fp32 = TrainConfig(pp=2, microbatches=8), TrainConfig(pp=2, microbatches=8, boundary_dtype="fp32")
    assert auto.boundary_dtype == "auto"
    bounded = step(1.01)
    assert narrows(auto, bounded) and not narrows(fp32, bounded)
    assert not narrows(auto, step(1.01, fp32=[0, 0]))  # a bf16 model: nothing float32 to halve
    half = [b // 2 for b in SENT]
    assert narrows(auto, step(1.01, fp32=half)) and not narrows(auto, step(1.01, fp32=[half[0] - 1, half[1]]))
    found = bound(LINKS, auto, bounded)
    assert found == Bound(2, 1.01, LINKS[0], SENT[0], 1e-3 + SENT[0] / MBIT_200)
    assert bound(LINKS, auto, step(found.wire_s / BOUND_SHARE + 0.01)) is None  # the link keeps up
    said = _said(found, auto.replace(boundary_dtype="bf16"), narrowed=True, wide=False, first=3)
    assert "the link bounds the step, so from step 3 on the boundaries cross in bf16" in said, said
    assert "boundary_dtype='fp32' keeps them exact" in said and "What shortens it further: compress_activations" in said
    # a model sending bf16 already is not told that bf16 would halve its bytes
    said = advice(LINKS, auto, step(1.01, fp32=[0, 0]))
    assert said is not None and "boundary_dtype='bf16'" not in said and "compress_activations" in said, said
