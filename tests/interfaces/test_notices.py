"""A run prints raypipe's own lines and the warnings that ask the user to act: the third-party
notices that ask nothing (`raypipe.core.notices`) are gone from any process that imports raypipe,
while the same loggers' other messages still show."""

import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("peft")

# what a LoRA stage does first: import raypipe, then peft wraps a transformers model (peft asks
# `is_gradient_checkpointing`); bitsandbytes' notice is logged as its CPU backend logs it where the
# CPU has AVX-512 bf16 (this machine may not), beside a message of the same logger that must stay
SCRIPT = """
import logging, sys
if sys.argv[1] == "raypipe":
    import raypipe
from peft import LoraConfig, get_peft_model
from transformers import LlamaConfig, LlamaForCausalLM
logging.basicConfig()
config = LlamaConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
                     num_key_value_heads=2, vocab_size=64)
get_peft_model(LlamaForCausalLM(config), LoraConfig(r=2, target_modules=["q_proj"]))
bnb = logging.getLogger("bitsandbytes.backends.cpu.ops")
bnb.warning("Failed to load CPU gemm_4bit_forward from kernels-community: %s. Please make sure ...", "no kernels")
bnb.warning("another bitsandbytes warning")
"""
NOISE = ("Failed to load CPU gemm_4bit_forward", "is_gradient_checkpointing` is deprecated")


def test_importing_raypipe_hides_the_notices_that_ask_nothing_and_keeps_the_rest():
    def stderr(first: str) -> str:
        done = subprocess.run([sys.executable, "-c", SCRIPT, first], capture_output=True, text=True, timeout=120)
        assert done.returncode == 0, done.stderr[-3000:]
        return done.stderr

    plain, quiet = stderr("plain"), stderr("raypipe")
    assert all(n in plain for n in NOISE), plain  # the libraries print them...
    assert not any(n in quiet for n in NOISE), quiet  # ...and not in a raypipe process
    assert "another bitsandbytes warning" in quiet
    # bitsandbytes still logs those words, on that logger: the filter matches what it prints
    import bitsandbytes

    ops = Path(bitsandbytes.__file__).parent / "backends" / "cpu" / "ops.py"
    assert '"Failed to load CPU gemm_4bit_forward from kernels-community' in ops.read_text()
