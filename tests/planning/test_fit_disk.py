"""`justfit fit --kv-disk`: contexts planned with every growing layer's KV pages on disk,
from a config.json and from the loaded SmolLM2, and the options' refusals."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
from click.testing import CliRunner

from justfit.planning.disk_bandwidth import measure_bandwidth, parse_bandwidth
from justfit.planning.disk_plan import bits_per_value
from justfit.planning.fit_config import CALIBRATED_MIX, calibrated_standin

# Qwen3.5-27B's shapes: 64 layers, every 4th full attention (4 KV heads of 256), the rest gated delta-net.
QWEN35_27B = json.loads((Path(__file__).parents[2] / "bench" / "configs" / "qwen3_5_27b.json").read_text())


def fit(*args):
    from cli.main import main

    return CliRunner().invoke(main, ["fit", *args])


def test_bandwidths_parse_and_bad_ones_are_refused():
    assert parse_bandwidth("6GB/s") == 6e9 and parse_bandwidth("500 MB/s") == 5e8
    assert parse_bandwidth("2GiB/s") == 2 * 2**30 and parse_bandwidth("1.8e9") == 1.8e9
    for bad in ("fast", "6 parsecs/s", "0GB/s", "-1GB/s", ""):
        with pytest.raises(ValueError):
            parse_bandwidth(bad)


def test_the_calibrated_standin_has_the_offline_mix_bits():
    kv = calibrated_standin(30)  # SmolLM2's 30 layers: the mix as measured
    assert [kv.layer_formats.count(n) for n, _ in CALIBRATED_MIX] == [n for _, n in CALIBRATED_MIX]
    assert bits_per_value(kv, 3, 64) == pytest.approx(5.558, abs=1e-3)  # docs/BENCHMARKS.md, The default pages
    assert len(calibrated_standin(16).layer_formats) == 16


def test_qwen35_27b_holds_a_million_positions_on_disk(tmp_path):
    cfg = tmp_path / "config.json"
    cfg.write_text(json.dumps(QWEN35_27B))
    common = ["--config", str(cfg), "--budget", "21GiB", "--context", "1000000",
              "--kv-disk", str(tmp_path / "pages"), "--disk-bandwidth", "6GB/s"]
    out = fit(*common)
    assert out.exit_code == 0, out.output
    assert "plan for 1,000,000 positions: does NOT fit" in out.output  # resident, as before
    assert "plan for 1,000,000 positions with pages on disk: fits" in out.output
    assert "predicted decode at most" in out.output and "6.00 GB/s (given)" in out.output
    r = json.loads(fit(*common, "--json").output)["kv_disk_plan"]
    assert r["max_positions"] >= 1_000_000 and 5.4 < r["bits_per_value"] < 5.7
    plan = r["plan"]
    assert plan["fits"] and plan["disk_layers"] == 16
    # every full layer's pages, once a token: 16 layers x 2 x 4 x 256 values at the page width
    per_position = 16 * 2 * 4 * 256 * r["bits_per_value"] / 8
    assert plan["read_per_token"] == pytest.approx(1_000_000 * per_position, rel=0.01)
    assert plan["predicted_tok_s"] == pytest.approx(6e9 / plan["read_per_token"])
    assert 0.2 < plan["predicted_tok_s"] < 0.4
    # what stays resident: the weights, the recurrent states, the reader's slots, within the budget
    assert plan["weights"] + plan["states"] + plan["read_slots"] < plan["resident_total"] <= 21 * 2**30
    assert plan["states"] > 0 and plan["read_slots"] > 0
    lower = {o["format"]: o for o in r["others"]}
    assert lower["q3c"]["max_positions"] > lower["q4c"]["max_positions"] > lower["q8c"]["max_positions"]
    assert lower["q3c"]["predicted_tok_s"] > lower["q8c"]["predicted_tok_s"]
    # a named fixed format instead of the calibrated mix
    q4 = json.loads(fit(*common, "--json", "--kv-format", "q4c").output)["kv_disk_plan"]
    assert q4["format"] == "q4c" and q4["bits_per_value"] == 5.0


def test_bad_bandwidth_and_folders_are_refused(tmp_path):
    cfg = tmp_path / "config.json"
    cfg.write_text(json.dumps(QWEN35_27B))
    out = fit("--config", str(cfg), "--kv-disk", str(tmp_path / "p"), "--disk-bandwidth", "fast")
    assert out.exit_code == 2 and "not a bandwidth" in out.output and "--disk-bandwidth" in out.output
    out = fit("--config", str(cfg), "--disk-bandwidth", "6GB/s")
    assert out.exit_code == 1 and "goes with --kv-disk" in out.output
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    out = fit("--config", str(cfg), "--kv-disk", str(blocker / "pages"), "--disk-bandwidth", "6GB/s")
    assert out.exit_code == 1 and "cannot write KV pages to" in out.output
    if os.geteuid() != 0:  # root writes anywhere
        locked = tmp_path / "locked"
        locked.mkdir(mode=0o500)
        out = fit("--config", str(cfg), "--kv-disk", str(locked), "--disk-bandwidth", "6GB/s")
        assert out.exit_code == 1 and "cannot write KV pages to" in out.output


def test_bandwidth_is_measured_on_the_folder(tmp_path):
    bw = measure_bandwidth(str(tmp_path), 8 << 20)
    assert bw.bytes_per_s > 0 and bw.method
    assert not os.listdir(tmp_path)  # the probe's file is gone


def test_smollm2_with_pages_on_disk(tmp_path):
    out = fit("--budget", "400MiB", "--context", "100000", "--kv-disk", str(tmp_path / "pages"),
              "--disk-bandwidth", "1.8GB/s", "--json")
    assert out.exit_code == 0, out.output
    r = json.loads(out.output[out.output.index("{"):])["kv_disk_plan"]
    assert r["folder"] == str(tmp_path / "pages") and r["max_positions"] > 100_000
    every = r["plan"]["every_layer"]  # all 30 layers on disk at 100,000 positions
    assert every["disk_layers"] == 30
    # docs/BENCHMARKS.md measured 753 MiB read a token there with the default pages
    assert every["read_per_token"] == pytest.approx(753 * 2**20, rel=0.05)
    assert every["predicted_tok_s"] == pytest.approx(1.8e9 / every["read_per_token"])
    assert r["at_max"]["resident_total"] <= 400 * 2**20
