"""benchmarks/generation_floor.py: the bytes a decode step reads, its floors (hand-derived), and a run with its profile."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
import generation_floor as gf  # noqa: E402


def llama(tied: bool) -> LlamaForCausalLM:
    # vocab 10, hidden 4, 1 layer, 2 heads of 2, 1 kv head, MLP 6
    config = LlamaConfig(vocab_size=10, hidden_size=4, intermediate_size=6, num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1,
                         head_dim=2, tie_word_embeddings=tied)
    return LlamaForCausalLM(config).to(torch.bfloat16)


@pytest.mark.parametrize("tied", [True, False])
def test_weight_bytes_count_each_weight_a_step_reads_once(tied):
    # q 4x4, k 2x4, v 2x4, o 4x4 = 48; MLP 3 x 6x4 = 72; two layer norms and the final one 3 x 4 = 12;
    # the head 10x4 = 40 (tied: the embedding itself; untied: the embedding is left out) -> 172 weights, 2 bytes each
    assert gf.weight_bytes(llama(tied)) == 2 * 172


def test_cache_bytes_per_position_are_keys_and_values_of_every_layer():
    config = LlamaConfig(hidden_size=2048, num_hidden_layers=16, num_attention_heads=32, num_key_value_heads=8, head_dim=64)
    assert gf.cache_bytes_per_position(config, 2) == 2 * 16 * 8 * 64 * 2  # 32 KiB: Llama-3.2-1B in bfloat16
    config = LlamaConfig(hidden_size=12, num_hidden_layers=2, num_attention_heads=3, num_key_value_heads=3, head_dim=None)
    assert gf.cache_bytes_per_position(config, 4) == 2 * 2 * 3 * 4 * 4  # head_dim from hidden / heads


def test_floors_by_hand():
    # W 100 bytes, 2 bytes a position, 3 rows, prompts of 4, 2 steps, 10 bytes/s:
    # weights only 2 x 100 / 10 = 20 s; with caches (100 + 3 x 2 x 4) + (100 + 3 x 2 x 5) = 124 + 130 -> 25.4 s
    assert gf.floor_seconds(100, 2, 3, 4, 2, 10.0) == pytest.approx((20.0, 25.4))
    assert gf.floor_seconds(100, 2, 3, 4, 1, 10.0) == pytest.approx((10.0, 12.4))


def test_a_run_prints_and_writes_a_row_per_batch_size(tmp_path, capsys):
    out = tmp_path / "floor.json"
    argv = ["--shape", "smollm2", "--rows", "2", "4", "--group-size", "2", "--prompt-len", "5", "--new-tokens", "3", "--warmup", "0", "--repeats", "1",
            "--bandwidth-gbs", "10", "--threads", "1", "--out", str(out), "--profile"]
    assert gf.main(argv) == 0
    printed = capsys.readouterr().out
    rows = [line for line in printed.splitlines() if line.startswith("| ") and line[2].isdigit()]
    assert "one call of 2 rows under the profiler" in printed and "aten::" in printed
    assert [line.split("|")[1].strip() for line in rows] == ["2", "4"]
    result = json.loads(out.read_text())
    assert result["setup"]["bandwidth_gbs"] == 10 and not result["setup"]["bandwidth_measured"]
    weights = result["setup"]["weight_bytes"]
    for row in result["table"]:
        assert row["floor_weights_s"] == pytest.approx(3 * weights / 10e9)
        assert row["tokens_per_s"] == pytest.approx(row["rows"] * 3 / row["whole_s"])
        assert row["decode_s"] == pytest.approx(row["whole_s"] - row["one_token_s"])


def test_width_keeps_the_shapes_layers_and_vocabulary_at_a_narrow_width():
    # SmolLM2's 30 layers and 49152 tokens at width 8 (2 heads of 4, 1 KV head, MLP 16), by hand: q 8 x 8, k 8 x 4,
    # v 8 x 4, o 8 x 8, MLP 3 x 8 x 16, two norms of 8 = 64 + 32 + 32 + 64 + 384 + 16 = 592 a layer;
    # the tied embedding 49152 x 8 once, the final norm 8: 30 x 592 + 393216 + 8 = 410984 parameters
    full, narrow = gf.build_model("smollm2", "cpu"), gf.build_model("smollm2", "cpu", width=8)
    assert narrow.config.num_hidden_layers == full.config.num_hidden_layers == 30 and narrow.config.vocab_size == full.config.vocab_size == 49152
    assert sum(p.numel() for p in {id(p): p for p in narrow.parameters()}.values()) == 410984
    assert gf.cache_bytes_per_position(narrow.config, 2) == 2 * 30 * 1 * 4 * 2
    with pytest.raises(SystemExit):
        gf.main(["--shape", "smollm2", "--width", "3", "--rows", "2", "--group-size", "2"])
