"""benchmarks/gpu_evidence.py: the CPU path end to end at a toy budget (every run under --recipe official with its
variant's lr groups; paired RESULT lines from real runs), the GPU plan (matched FLOPs, inside its 8 minutes at
the stated throughput; benchmarks/gpu_evidence.sh prints the same) and the one-line refusals."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch

from stemlm.train.recipes import OfficialRecipe
from tests.benchmarks.harness import load_benchmark, run_benchmark
from tests.small_corpus import write_small_corpus

bench = load_benchmark("gpu_evidence.py")
PLAN = re.compile(r"plan: (\w+) +(\d+) steps, ([\d,]+) tokens, ([\d.e+]+) FLOPs")


@pytest.fixture(scope="module")
def corpus(tmp_path_factory) -> dict[str, Path]:
    return write_small_corpus(tmp_path_factory.mktemp("corpus"))


def plan_lines(out: str) -> dict[str, dict[str, float]]:
    return {
        m[1]: {"steps": int(m[2]), "tokens": int(m[3].replace(",", "")), "flops": float(m[4])}
        for m in PLAN.finditer(out)
    }


def matched(plan: dict[str, dict[str, float]]) -> None:
    """Equal FLOPs up to one step of the cheaper kind; STEM, cheaper per token, gets at least dense's tokens."""
    assert set(plan) == {"dense", "dense_embed", "stem"}
    assert plan["dense"] == plan["dense_embed"] and plan["stem"]["tokens"] >= plan["dense"]["tokens"]
    step = plan["stem"]["flops"] / plan["stem"]["steps"]
    assert abs(plan["stem"]["flops"] - plan["dense"]["flops"]) <= step


def test_cpu_smoke_trains_every_variant_and_prints_paired_results(corpus, monkeypatch, capsys):
    monkeypatch.setenv("STEMLM_CACHE", str(corpus["cache"]))
    built, build = [], OfficialRecipe.build_optimizers

    def spy(self, model, cfg):  # every run's optimizers come from --recipe official
        optimizers = build(self, model, cfg)
        built.append((model.config.ffn, {g["name"]: g["peak_lr"] / cfg.lr for o in optimizers for g in o.param_groups}))
        return optimizers

    monkeypatch.setattr(OfficialRecipe, "build_optimizers", spy)
    bench.main(["--cpu-smoke", str(corpus["data"]), "--tokenizer", str(corpus["tokenizer"]), "--budget-s", "90"])
    out = capsys.readouterr().out
    matched(plan_lines(out))
    runs = [("dense", {"backbone": 1.0}), ("dense", {"backbone": 1.0, "embed": 10.0})]
    assert built == 2 * [*runs, ("stem", {"backbone": 1.0, "tables": 10.0})]
    results = [
        dict(kv.split("=") for kv in line.split()[1:]) for line in out.splitlines() if line.startswith("RESULT ")
    ]
    per_seed, mean = results[:-1], {k: float(v) for k, v in results[-1].items()}
    assert [r["seed"] for r in per_seed] == ["0", "1"] and mean["seeds"] == 2
    for row in per_seed:
        loss = {k: float(v) for k, v in row.items()}
        assert loss["dense_embed"] != loss["dense"]  # the embedding really trained at the tables' lr
        for base in ("dense", "dense_embed"):
            assert loss[f"stem_minus_{base}"] == pytest.approx(loss["stem"] - loss[base], abs=2e-4)
    for key in ("dense", "dense_embed", "stem", "stem_minus_dense", "stem_minus_dense_embed"):
        assert mean[key] == pytest.approx(sum(float(r[key]) for r in per_seed) / 2, abs=2e-4)
    assert mean["measured_tflops"] > 0


def test_the_shell_entry_prints_the_same_plan(capsys):
    bench.main(["--plan"])
    assert run_benchmark("gpu_evidence.sh", "--plan") == capsys.readouterr().out


def test_gpu_plan_is_flop_matched_and_fits_its_budget(capsys):
    bench.main(["--plan"])
    out = capsys.readouterr().out
    plan = plan_lines(out)
    matched(plan)
    planned, budget = map(float, re.search(r"planned (\d+) s of (\d+) s", out).groups())
    assert budget == 480 and planned <= budget and plan["dense"]["steps"] >= bench.GPU.min_steps
    assert "d 960, 32 layers" in out and "16 x 1024 tokens per step on cuda (bf16)" in out


@pytest.mark.parametrize(
    "argv", [["--budget-s", "200", "--plan"], ["--cpu-smoke", "--budget-s", "30"], ["--assume-tflops", "1", "--plan"]]
)
def test_a_budget_that_cannot_fit_is_refused_in_one_line(corpus, argv, capsys):
    data = ["--tokenizer", str(corpus["tokenizer"])]  # no corpus is read before the refusal
    with pytest.raises(SystemExit) as info:
        bench.main([*argv, *data])
    err = capsys.readouterr().err.strip().splitlines()
    assert info.value.code == 2 and len(err) == 1 and "s budget cannot fit 6 runs of" in err[0]


@pytest.mark.skipif(torch.cuda.is_available(), reason="the refusal of a machine without CUDA")
def test_the_gpu_run_refuses_without_cuda(capsys):
    with pytest.raises(SystemExit) as info:
        bench.main([])
    err = capsys.readouterr().err.strip().splitlines()
    assert info.value.code == 2 and err == [err[0]] and "no CUDA device" in err[0]


@pytest.mark.parametrize("argv", [["--seeds", "0,x"], ["--seeds", "1,1"], ["--budget-s", "0"], ["--lr", "-1"]])
def test_bad_arguments_exit_2(argv, capsys):
    with pytest.raises(SystemExit) as info:
        bench.parse_args(argv)
    assert info.value.code == 2 and "error:" in capsys.readouterr().err.strip().splitlines()[-1]


def test_a_vocabulary_beyond_the_per_run_allowance_is_refused(capsys):
    with pytest.raises(SystemExit) as info:
        bench.make_plan(bench.GPU, 128256, [0, 1])
    err = capsys.readouterr().err.strip().splitlines()
    assert info.value.code == 2 and len(err) == 1 and "has 128256 tokens" in err[0]
    assert bench.make_plan(bench.GPU, 32768, [0, 1])["planned_s"] <= bench.GPU.budget_s
