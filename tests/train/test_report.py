"""The final report's text (stemlm.train.report.render_report): one line per part present, figures as printed."""

from __future__ import annotations

from stemlm.train.report import render_report

BASE = {
    "run_dir": "runs/x",
    "steps": 10,
    "tokens_seen": 20480,
    "tokens_per_s": 3200.0,
    "autocast_dtype": "float32",
    "device": "cpu",
    "wall_s": 6.4,
    "train_loss": 6.12345,
    "heldout_loss": 6.54321,
    "heldout_eval": {"tokens": 16384, "window": 256},
    "skipped_steps": 0,
    "loss_spikes": 1,
    "checkpoint": "runs/x/checkpoints/step-000010",
    "run_dir_bytes": 2_500_000,
}


def test_minimal_report_lines():
    lines = render_report(BASE).splitlines()
    assert lines[0] == "run runs/x: 10 steps, 20,480 tokens, 3,200 tokens/s (float32 on cpu), 6 s"
    assert lines[1].startswith("train loss 6.1235 | held-out loss 6.5432 (16,384 tokens, window 256)")
    assert lines[-1] == "checkpoint: runs/x/checkpoints/step-000010 (run folder 2.5 MB)"
    assert len(lines) == 3


def test_facts_sample_and_missing_heldout():
    facts = {
        "region": "Europe",
        "countries": ["Spain", "France"],
        "relations": ["capital"],
        "train_templates": {"prompts": 8, "recall": 0.875},
        "heldout_templates": {"prompts": 4, "recall": 0.5},
    }
    report = {**BASE, "heldout_loss": None, "facts": facts, "sample": {"prompt": "The king", "completion": " is \n"}}
    text = render_report(report)
    assert "held-out loss n/a |" in text
    assert "facts (capital, 2 countries): exact greedy recall 0.88 on the 8 trained prompts, 0.50 on 4" in text
    assert text.endswith("sample (greedy): The king is")


def test_compute_line_gives_each_clock_beside_its_own_peak():
    compute = {"model_gflops_per_s": 12.0, "matmul_peak_gflops_per_s": 48.0, "peak_share": 0.25}
    wall_only = render_report({**BASE, "compute": compute}).splitlines()[1]
    assert wall_only == (
        "compute: 12.0 model GFLOP/s = 25% of 48.0 GFLOP/s (wall clock); peaks: the best plain matmul at the "
        "model's shapes, measured now in the same clock"
    )
    cpu = {"model_gflops_per_cpu_s": 30.0, "matmul_peak_gflops_per_cpu_s": 40.0, "cpu_peak_share": 0.75}
    both = render_report({**BASE, "compute": compute | cpu}).splitlines()[1]
    assert both.startswith("compute: 12.0 model GFLOP/s = 25% of 48.0 GFLOP/s (wall clock), 30.0 per CPU-second = ")
    assert "75% of 40.0 (process CPU time); peaks:" in both


def test_model_line_gives_the_run_training_compute():
    accounting = {
        "ffn": "stem",
        "special_layers": [1, 3],
        "parameters_total": 19_794_176,
        "table_parameters": 12_582_912,
        "parameters_active_per_token": 7_211_264,
        "training_flops_per_token": 31_463_424.0,
    }
    line = render_report({**BASE, "accounting": accounting}).splitlines()[1]
    # 31.46 MFLOPs/token x 20,480 tokens = 0.644 TFLOP
    assert line.endswith("31.5 MFLOPs/token to train, 0.64 TFLOP over its 20,480 tokens")
    assert line.startswith("model: ffn stem in layers [1,3]; 19,794,176 parameters (12,582,912 in tables)")
