"""The word after the first timed step across nodes (`raypipe.driver.links.advice`): said where a
measured link's wire time is half the step or more, naming the link, its bytes and the settings
that would shorten it (those not set already); silent otherwise."""

from raypipe import TrainConfig
from raypipe.driver.links.advice import advice, direction_bytes
from raypipe.planning.links import Link

MBIT_200 = 200e6 / 8  # bytes per second
LINKS = [Link(0, 1, "gloo", MBIT_200, 1e-3), Link(1, 0, "gloo", MBIT_200, 1e-3)]
# benchmarks/slow_link.py's step: 8 microbatches of 2 MiB activations on, as many gradient bytes back
SENT = [8 * 2**21, 8 * 2**21]


def step(seconds: float, sent=SENT) -> dict:
    return {"step": 2, "step_time": seconds, "stages": [{"sent_bytes": b} for b in sent]}


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
