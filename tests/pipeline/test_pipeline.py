"""Layers pipelined over mx.distributed (justfit/pipeline/layers.py): two local ranks on the
ring backend, launched by mlx.launch as a user would, against one process."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

CHILD = str(Path(__file__).parents[1] / "helpers" / "pipeline_child.py")
LAUNCH = str(Path(sys.executable).with_name("mlx.launch"))


def _run(model: str, ranks: int, *extra: str, timeout: float = 120) -> dict:
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[2])}
    cmd = [sys.executable, CHILD, model, *extra]
    if ranks > 1:
        cmd = [LAUNCH, "-n", str(ranks), "--backend", "ring", "--", *cmd]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env).stdout
    return json.loads(next(line for line in out.splitlines() if line.startswith("{")))


@pytest.mark.parametrize("fixture", ["tiny_llama_dir", "tiny_gemma3_dir"])
def test_two_ranks_give_the_greedy_tokens_of_one_process(fixture, request):
    model = str(request.getfixturevalue(fixture))
    alone, split = _run(model, 1), _run(model, 2)
    assert split["tokens"] == alone["tokens"] and len(alone["tokens"]) == 8
    assert 0 < split["held_layers"] < (2 if "llama" in fixture else 6)  # rank 0 holds only its share


def test_smollm2_over_two_ranks_matches_one_process(smollm2_gguf):
    assert _run("smollm2", 2, "--tokens", "6")["tokens"] == _run("smollm2", 1, "--tokens", "6")["tokens"]


def test_a_rank_that_leaves_is_an_error_on_rank_0_not_a_hang(tiny_llama_dir):
    got = _run(str(tiny_llama_dir), 2, "--die-after", "3", timeout=60)
    assert "error" in got and "tokens" not in got


def test_layers_split_in_proportion_to_budgets():
    from justfit.pipeline.layers import split_layers

    assert split_layers(30, [1, 1]).starts == (0, 15, 30)
    assert split_layers(30, [100, 300], fixed=0).starts == (0, 8, 30)
    uneven = split_layers(30, [600, 400], fixed=200)  # rank 0 also holds embedding and head
    assert uneven.starts == (0, 15, 30) and uneven.layers(1) == range(15, 30)
    assert split_layers(2, [1, 1000]).starts == (0, 1, 2)  # never an empty rank
    with pytest.raises(ValueError, match="at least one"):
        split_layers(2, [1, 1, 1])


ENGINE_CHILD = str(Path(__file__).parents[1] / "helpers" / "pipeline_engine_child.py")


def _engine(model: str, ranks: int, budget: str | None = None) -> dict:
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[2])}
    cmd = [sys.executable, ENGINE_CHILD, model, *([budget] if budget else [])]
    if ranks > 1:
        cmd = [LAUNCH, "-n", str(ranks), "--backend", "ring", "--", *cmd]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=300, env=env).stdout
    return json.loads(next(line for line in out.splitlines() if line.startswith("{")))


@pytest.mark.parametrize("model", ["smollm2", "tiny_gemma3_dir"])
def test_engines_on_two_ranks_reply_as_one_and_each_holds_half(model, request):
    """Each rank an Engine over its layers (KVExec pages, PhaseSwap, its own planner):
    three requests' greedy tokens equal one process's, a next turn extending the state
    every rank kept; each rank's planner counts the KV
    of its own layers only, and each holds only its layers' weights."""
    if model == "smollm2":
        request.getfixturevalue("smollm2_gguf")
    else:
        model = str(request.getfixturevalue(model))
    alone, split = _engine(model, 1), _engine(model, 2)
    assert split["tokens"] == alone["tokens"] and split["again"] == alone["again"]
    # the next turn extends the state every rank kept (the prompt and 7 of 8 replies)
    assert split["next_turn"] == alone["next_turn"] and split["cached"] == alone["cached"] > 8
    assert split["again_cached"] == 0  # not an extension: every rank started afresh
    whole, (first, second) = alone["ranks"][0], split["ranks"]
    assert first["layers"] + second["layers"] == whole["layers"] and min(first["layers"], second["layers"]) > 0
    assert first["kv_4096"] + second["kv_4096"] <= whole["kv_4096"] * 1.01
    assert second["weights"] < whole["weights"] * 0.75 and first["weights"] < whole["weights"]


def test_justfit_generate_under_mlx_launch_prints_what_one_process_prints(smollm2_gguf):
    """A user's command line: `mlx.launch -n 2 --backend ring -- justfit generate ...`, or
    `justfit generate --ranks 2 ...` that runs it; rank 0 prints the continuation, rank 1
    computes its layers and leaves."""
    exe = str(Path(sys.executable).with_name("justfit"))
    args = [exe, "generate", "--model", "smollm2", "--prompt", "The capital of France is", "-t", "0",
            "--max-tokens", "8"]
    alone = subprocess.run(args, capture_output=True, text=True, timeout=300).stdout
    launched = subprocess.run([LAUNCH, "-n", "2", "--backend", "ring", "--", *args], capture_output=True, text=True,
                              timeout=300)
    assert alone.strip() and launched.stdout.strip() == alone.strip()
    assert "rank 1: layers" in launched.stderr
    local = subprocess.run([*args, "--ranks", "2"], capture_output=True, text=True, timeout=300)  # the convenience
    assert local.stdout.strip() == alone.strip() and "rank 1: layers" in local.stderr


def test_fit_plans_a_pipeline_per_rank_before_launching(smollm2_gguf):
    """`justfit fit --ranks 2 --budget B`: each rank's layers, weights and positions from
    its own share; the pipeline holds what its smallest rank holds."""
    from click.testing import CliRunner

    from cli.fit import fit

    out = CliRunner().invoke(fit, ["--budget", "600MiB", "--ranks", "2", "--json"])
    assert out.exit_code == 0, out.output
    report = json.loads(out.output)
    first, second = report["ranks"]
    # SmolLM2's 30 layers, cut where the positions balance: [0, 14] | [15, 29] with the
    # native kernels' 5-bit forms, [0, 13] | [14, 29] with MLX's 8-bit ones (the
    # embedding weighs more beside smaller layers)
    assert first["layers"][0] == 0 and second["layers"] == [first["layers"][1] + 1, 29]
    assert first["layers"][1] in (13, 14)
    assert second["weights"] < first["weights"]  # rank 0 also holds the embedding (the tied head)
    assert report["max_positions"] == min(first["max_positions"], second["max_positions"])
    # two ranks hold 1.5x the positions from the split of the 3 growing layers alone, more
    # as each sheds half the weights: 1.80x with the layers held as q8t, 1.795x stored at 5 bits
    assert report["max_positions"] >= 1.75 * report["one_process_max_positions"]
    bad = CliRunner().invoke(fit, ["--budget", "600MiB", "--ranks", "31"])
    assert bad.exit_code != 0 and "at least one" in bad.output
    mixed = json.loads(CliRunner().invoke(fit, ["--budget", "600MiB,900MiB", "--ranks", "2", "--json"]).output)
    assert [r["budget"] for r in mixed["ranks"]] == [600 * 2**20, 900 * 2**20]
    whole = CliRunner().invoke(fit, ["--budget", "600MiB,900MiB", "--ranks", "2", "--whole-process", "--json"])
    shares = json.loads(whole.output)  # each rank's budget less what its process holds besides the engine
    assert [r["budget"] + shares["outside"] for r in shares["ranks"]] == [600 * 2**20, 900 * 2**20]
    assert mixed["ranks"][1]["layers"][1] - mixed["ranks"][1]["layers"][0] > second["layers"][1] - second["layers"][0]
    wrong = CliRunner().invoke(fit, ["--budget", "600MiB,900MiB", "--ranks", "3"])
    assert wrong.exit_code != 0 and "one per rank" in wrong.output


def test_an_engine_whose_rank_is_lost_refuses_with_a_clear_error_and_does_not_hang(tiny_llama_dir):
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[2]), "PIPELINE_DIE_AFTER": "2"}
    cmd = [LAUNCH, "-n", "2", "--backend", "ring", "--", sys.executable, ENGINE_CHILD, str(tiny_llama_dir)]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=120, env=env).stdout
    got = json.loads(next(line for line in out.splitlines() if line.startswith("{")))
    assert len(got["errors"]) == 2 and all("restart all ranks" in e for e in got["errors"]) and got["lost"]


def test_the_split_balances_positions_not_weights(gemma3_gguf):
    """Gemma 3 keeps growing KV in 3 of its 18 layers (5, 11, 17): the planned split
    gives the rank with the embedding's 170 MB the fewer of those, and holds what its
    smallest rank holds."""
    from click.testing import CliRunner

    from cli.fit import fit

    out = CliRunner().invoke(fit, ["--model", "gemma3", "--budget", "1600MiB", "--ranks", "2", "--json"])
    assert out.exit_code == 0, out.output
    report = json.loads(out.output)
    first, second = report["ranks"]
    assert first["layers"][0] == 0 and second["layers"][1] == 17 and first["layers"][1] + 1 == second["layers"][0]
    # two ranks hold 1.5x the positions from the split of the 3 growing layers alone, more
    # as each sheds half the weights: 1.80x with the layers held as q8t, 1.795x stored at 5 bits
    assert report["max_positions"] >= 1.75 * report["one_process_max_positions"]
    from justfit import Engine
    from justfit.planning.fit_ranks import ranks_report
    from justfit.pipeline.layers import split_layers

    even = ranks_report(Engine("gemma3"), [1600 * 2**20] * 2, split_layers(18, [1, 1]))
    assert even["ranks"][0]["layers"] == [0, 8] and even["max_positions"] < report["max_positions"]


def test_the_capacity_bench_runs_a_pipeline_with_every_rank_held_to_the_budget(tmp_path, monkeypatch):
    """`--systems justfit-lossless@2`: two local ranks (justfit.pipeline.launch), each held to the
    budget by its own sampler; a step's peak is the largest rank's."""
    import bench.common
    from bench.capacity import main
    from tests.helpers.tiny_models import write_mlx_folder

    monkeypatch.setattr(bench.common, "RESULTS", tmp_path)
    model = str(write_mlx_folder(tmp_path / "llama", "llama", layers=4))
    result = main(["--model", model, "--budget", "1GiB", "--systems", "justfit-lossless@2", "--step", "64", "--out",
                   "4", "--max-positions", "300", "--max-seconds", "60", "--repeats", "1", "--no-refine",
                   "--fidelity-tokens", "0", "--json"])
    row = result["systems"][0]
    assert row["system"] == "justfit-lossless@2" and row["positions"] == 272 and row["ended_by"] == "position limit"
    assert all(s["peak_rss"] >= s["rank0_peak_rss"] > 0 for s in row["steps"])


def test_a_pipelines_conversation_saves_and_restores_on_every_rank_or_none(tiny_gemma3_dir, tmp_path):
    """One part per rank under rank 0's manifest: restored after an unrelated request,
    the next turn is the one process's, prefilling only what is new; a damaged part is
    refused and every rank keeps the state it had."""
    child = str(Path(__file__).parents[1] / "helpers" / "pipeline_state_child.py")
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[2])}
    got = {}
    for ranks in (1, 2):
        cmd = [sys.executable, child, str(tiny_gemma3_dir), str(tmp_path / str(ranks))]
        if ranks > 1:
            cmd = [LAUNCH, "-n", "2", "--backend", "ring", "--", *cmd]
        run = subprocess.run(cmd, capture_output=True, text=True, timeout=180, env=env)
        got[ranks] = json.loads(next(line for line in run.stdout.splitlines() if line.startswith("{")))
    alone, split = got[1], got[2]
    assert split["parts"] == ["rank0", "rank1"]  # the second save's generation only
    assert len(split["parts_files"]) == 4 and split["parts_files"].count("manifest.json") == 2
    for key in ("first", "second", "cached", "saved_tokens", "loaded_tokens", "third", "third_cached"):
        assert split[key] == alone[key], key
    assert split["cached"] == split["loaded_tokens"] > 0  # the restored state, extended
    assert "rank(s) [1]" in split["damaged"] and "corrupted" in alone["damaged"]
    assert split["third_cached"] > split["cached"]  # the state every rank kept, not a reset


def test_the_speed_bench_runs_a_pipeline_over_local_ranks(tiny_llama_dir, tmp_path, monkeypatch, capsys):
    """`justfit-default@2`: both ranks launched as a user would, rank 0 timing the request;
    no one process's memory floor is claimed for it."""
    import bench.common
    from bench.speed import _policy_ranks, main as speed

    assert _policy_ranks("justfit@cpu") == ("cpu", 1) and _policy_ranks("justfit-default@2") == ("auto", 2)
    monkeypatch.setattr(bench.common, "RESULTS", tmp_path)
    speed(["--model", str(tiny_llama_dir), "--contexts", "64", "--decode", "4", "--systems",
           "justfit-default,justfit-default@2", "--json"])
    rows = {r["system"]: r for r in json.loads(capsys.readouterr().out.strip().splitlines()[-1])["systems"]}
    alone, split = rows["justfit-default"], rows["justfit-default@2"]
    assert split["runs"] == 1 and split["prefill_tps"] > 0 and split["decode_tps"] > 0
    assert split["read_bytes"] is None and "floor_tps" not in split and alone["floor_tps"] > 0


def test_a_rank_that_stops_answering_fails_the_request_within_the_stall_limit(tiny_llama_dir, tmp_path):
    """Alive but silent (SIGSTOP): MLX's transfer cannot time out, so the server's
    watchdog bounds it: the request gets PipelineLost within the limit and the group is
    marked lost (later requests are refused at once)."""
    child = str(Path(__file__).parents[1] / "helpers" / "pipeline_stall_child.py")
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[2])}
    run = subprocess.run([LAUNCH, "-n", "2", "--backend", "ring", "--", sys.executable, child, str(tiny_llama_dir),
                          str(tmp_path / "rank1.pid")], capture_output=True, text=True, timeout=120, env=env)
    got = json.loads(next(line for line in run.stdout.splitlines() if line.startswith("{")))
    assert got["error"] == "PipelineLost" and got["events"][-1] == "done"
    assert got["seconds"] < 30 and "no answer from the layer pipeline for 2 s" in got["lost"]


class _SilentPipeline:
    """An engine on a pipeline whose other rank never answers: rank 0's first transfer blocks."""

    def __init__(self, engine):
        import threading
        from types import SimpleNamespace

        from justfit.engine.pipeline_runner import PipelineRunner
        from justfit.pipeline.layers import Pipeline, Split

        group = SimpleNamespace(size=lambda: 2, rank=lambda: 0)  # rank 0 of two; nothing is sent
        self.never = threading.Event()
        link = SimpleNamespace(group=group, send=lambda x, peer: self.never.wait(60))
        self._engine, self.runner = engine, PipelineRunner(Pipeline(Split((0, 1, 2)), link))

    def __getattr__(self, name):
        return getattr(self._engine, name)


def test_the_server_answers_503_and_reports_degraded_when_the_pipeline_stalls(tiny_gemma3_dir):
    from justfit import Engine
    from tests.helpers.server_harness import CHAT, LiveServer, request

    engine = _SilentPipeline(Engine(str(tiny_gemma3_dir)))
    live = LiveServer(engine, rank_timeout_s=1.0)
    try:
        named = request(live, "POST", "/v1/chat/completions", {**CHAT, "session": "s1"})  # one process's
        assert named[0] == 400 and json.loads(named[2])["error"]["code"] == "session_unsupported"
        status, _, text = request(live, "POST", "/v1/chat/completions", CHAT)
        assert status == 503 and json.loads(text)["error"]["code"] == "pipeline_degraded"
        health = json.loads(request(live, "GET", "/health")[2])
        assert health["status"] == "degraded" and "no answer" in health["pipeline"]["lost"]
        again = request(live, "POST", "/v1/chat/completions", CHAT)  # refused at once, not queued
        assert again[0] == 503 and "restart all ranks" in json.loads(again[2])["error"]["message"]
    finally:
        engine.never.set()
        live.close()


def test_a_request_some_rank_cannot_hold_is_refused_before_any_work_with_the_per_rank_numbers():
    from types import SimpleNamespace

    from justfit.planning.plan import Costs, Planner
    from justfit.errors import ContextTooLong

    costs = Costs(None, {}, SimpleNamespace(kv=None), 2, None)  # nothing sized: the ranks' limits refuse first
    planner = Planner(costs, None, None, False, False, 1 << 20, 0, rank_limits=(90_000, 4_000))
    with pytest.raises(ContextTooLong, match=r"rank 1 of the layer pipeline .*\[90000, 4000\]") as e:
        planner.check_fits(3_900, 200)
    assert e.value.limit == 4_000  # the server shrinks an unset max_tokens to it, as for one process
