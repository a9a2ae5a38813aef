"""Architecture diagrams from a config and from a running trainer, rendered by the real `dot`."""

import struct
import xml.etree.ElementTree as ET

import pytest
import torch
from torch import nn

from raypipe import TrainConfig, Trainer
from raypipe.cli import main as cli
from raypipe.models import gpt
from raypipe.observe.diagram import Architecture

from helpers import MLP7

MODEL = gpt.GPTConfig(n_layer=4, n_head=4, n_embd=32, block_size=16)


@pytest.fixture(scope="module")
def arch():
    config = TrainConfig(pp=2, dp=2, tp=2, microbatches=2)
    sample = torch.zeros(4, MODEL.block_size, dtype=torch.long)
    return Architecture.from_config(gpt.layers(MODEL), config, sample)


def test_stages_layers_parameters_and_boundary_shapes(arch):
    assert [s.layers for s in arch.stages] == [(0, 3), (3, 6)]
    assert [s.kinds for s in arch.stages] == ["Embedding, Block x2", "Block x2, Head"]
    assert sum(s.parameters for s in arch.stages) == MODEL.parameters
    assert arch.input == "(4, 16) int64"
    assert [s.output for s in arch.stages] == ["(4, 16, 32) float32", "(4, 16, 256) float32"]
    assert [a.name for a in arch.stages[1].actors] == [
        "stage1-dp0-tp0",
        "stage1-dp0-tp1",
        "stage1-dp1-tp0",
        "stage1-dp1-tp1",
    ]


def test_mermaid_text(arch, tmp_path):
    text = arch.save(tmp_path / "a.mmd").read_text()
    assert text.startswith("flowchart LR\n")
    assert text.count("subgraph S") == 2 and text.count("  end") == 2
    assert 'S0 -- "(4, 16, 32) float32" --> S1' in text
    assert "stage0_dp1_tp1[" in text


def test_dot_renders_png_svg_and_pdf(arch, tmp_path, dot):
    png = arch.save(tmp_path / "a.png").read_bytes()
    assert png[:8] == b"\x89PNG\r\n\x1a\n"
    width, height = struct.unpack(">II", png[16:24])
    assert width > 400 and height > 100
    svg = ET.parse(arch.save(tmp_path / "a.svg")).getroot()
    texts = {t.text for t in svg.iter("{http://www.w3.org/2000/svg}text")}
    assert {"stage1-dp1-tp1", "(4, 16, 32) float32", "Embedding, Block x2"} <= texts
    pdf = arch.save(tmp_path / "a.pdf").read_bytes()
    assert pdf.startswith(b"%PDF-") and b"%%EOF" in pdf[-64:]


def test_from_a_running_trainer_shows_real_nodes(ray_session, tmp_path):
    import ray

    config = TrainConfig(pp=2, cpus_per_actor=0.5)
    with Trainer(MLP7, nn.functional.mse_loss, config) as t:
        arch = Architecture.from_trainer(t, torch.zeros(2, 6))
    node = ray.get_runtime_context().get_node_id()[:8]
    assert all(a.node == node and a.device == "cpu" for s in arch.stages for a in s.actors)
    assert [s.output for s in arch.stages] == ["(2, 16) float32", "(2, 3) float32"]  # after layers [0,3) and [3,7)
    assert f"cpu @ node {node}" in arch.to_mermaid()
    assert [s.link for s in arch.stages] == ["shm", ""]  # neighbours on one node: shared memory
    assert '-- "(2, 16) float32 over shm" -->' in arch.to_mermaid() and 'float32 over shm"' in arch.to_dot()


def test_cli_draws_diagrams_and_timelines(tmp_path, capsys):
    assert cli(["diagram", "examples/configs/tiny.yaml", "-o", str(tmp_path / "a.mmd")]) == 0
    text = (tmp_path / "a.mmd").read_text()
    assert "stage 1: layers [2, 4)" in text and '"(4, 32, 32) float32"' in text  # batch 8 / 2 microbatches
    assert cli(["diagram", "examples/configs/tiny.yaml", "-o", str(tmp_path / "a.gif")]) == 2
    assert "use .png, .svg, .pdf, .dot or .mmd" in capsys.readouterr().err
    assert cli(["schedule", "gpipe", "--pp", "2", "-m", "3", "-o", str(tmp_path / "t.json")]) == 0
    assert (tmp_path / "t.json").read_text().count('"ph": "X"') == 12
