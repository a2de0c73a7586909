"""A kind's model variant as an arm of its own in `stemlm experiment compare`: `--kinds engram-reference` or
`--variants reference` (one `<kind>-reference` arm after each listed kind that has a `<kind>_variant` setting),
configured with the variant (and the layers it needs), labelled by its arm name in the rows and tables, and
trained as that variant by a compare run.

    OMP_NUM_THREADS=1 python -m pytest tests/experiments/test_compare_variants.py -q
"""

from __future__ import annotations

import pytest

from stemlm.cli.main import build_parser, main
from stemlm.errors import StemlmError
from stemlm.experiments.compare import CompareConfig, arms, model_configs, plan_steps, seed_entry
from stemlm.experiments.compare_report import diff_table, results_table
from tests.experiments.compare_results import TOK, result_row, train_two_steps

SMALL = dict(
    hidden_size=32,
    intermediate_size=48,
    num_hidden_layers=6,  # value_embed's reference needs the five layers 1,2,-3,-2,-1
    num_attention_heads=2,
    max_position_embeddings=128,
    seq_len=32,
    batch_size=4,
)


def test_variants_add_a_reference_arm_after_each_kind_that_has_one():
    cfg = CompareConfig(kinds=("dense", "engram", "memory", "value_embed", "stem"), variants=("default", "reference"))
    want = ("dense", "engram", "engram-reference", "memory", "memory-reference", "value_embed")
    assert arms(cfg) == (*want, "value_embed-reference", "stem")
    listed = CompareConfig(kinds=("engram", "engram-reference"), variants=("reference",))
    assert arms(listed) == ("engram", "engram-reference")  # named in --kinds already: not added twice


def test_an_arm_is_its_kind_with_the_variant_set():
    cfg = CompareConfig(kinds=("dense", "engram", "memory", "value_embed"), variants=("reference",), **SMALL)
    configs = model_configs(cfg, TOK)
    for kind in ("engram", "memory", "value_embed"):
        default, reference = configs[kind], configs[f"{kind}-reference"]
        assert default.ffn == reference.ffn == kind
        assert getattr(default, f"{kind}_variant") == "stemlm" and getattr(reference, f"{kind}_variant") == "reference"
    assert configs["engram-reference"].special_layers == configs["engram"].special_layers == [1, 3, 5]
    assert configs["value_embed-reference"].special_layers == [1, 2, 3, 4, 5]
    assert configs["dense"].hidden_size == configs["memory-reference"].hidden_size == 32  # one backbone
    steps = plan_steps(cfg, configs, "flops")
    assert set(steps) == set(configs) and steps["dense"] == 200


def test_bad_arms_are_one_line_errors(tmp_path, capsys):
    with pytest.raises(StemlmError, match="unknown kind 'dense-reference'"):
        model_configs(CompareConfig(kinds=("dense-reference",), **SMALL), TOK)  # dense has no variants
    with pytest.raises(
        StemlmError, match=r"arm engram-bogus \(engram_variant=bogus, on 6 layers\): invalid config: engram_variant"
    ):
        model_configs(CompareConfig(kinds=("engram-bogus",), **SMALL), TOK)
    four = {**SMALL, "num_hidden_layers": 4}
    message = "arm value_embed-reference .*ffn_layers=1,2,-3,-2,-1, on 4 layers.*lists a layer twice"
    with pytest.raises(StemlmError, match=message):
        model_configs(CompareConfig(kinds=("value_embed",), variants=("reference",), **four), TOK)
    args = ["experiment", "compare", "--kinds", "dense,engram", "--variants", "nope", "--out", str(tmp_path / "c")]
    assert main(args) == 2
    err = capsys.readouterr().err.strip()
    assert "engram-nope" in err and "\n" not in err
    parsed = build_parser().parse_args(["experiment", "compare", "--variants", "default,reference"])
    assert parsed.variants == ("default", "reference")


def test_the_report_labels_rows_by_arm():
    from stemlm.experiments.stats import summarize_seeds

    steps = {"flops": {"engram": 3, "engram-reference": 3}}
    per_seed = [
        seed_entry(
            s, steps, {"engram-3steps": result_row("engram", 4.0), "engram-reference-3steps": result_row("e", 4.0 + d)}
        )
        for s, d in ((0, 0.5), (1, 0.25))
    ]
    assert per_seed[1]["diff"]["flops"]["engram-reference-engram"]["heldout_loss"] == pytest.approx(0.25)
    with_dense = {"dense-3steps": result_row("dense", 4.5), "engram-3steps": result_row("engram", 4.0)}
    with_dense["engram-reference-3steps"] = result_row("e", 4.25)
    diffs = seed_entry(0, {"flops": {"dense": 3, "engram": 3, "engram-reference": 3}}, with_dense)["diff"]["flops"]
    assert list(diffs) == ["engram-dense", "engram-reference-dense", "engram-reference-engram"]
    assert diffs["engram-reference-engram"]["heldout_loss"] == pytest.approx(0.25)
    report = {
        "per_seed": per_seed,
        "summary": summarize_seeds([{k: v for k, v in s.items() if k != "seed"} for s in per_seed]),
    }
    table = results_table(report, "flops")
    assert "| engram-reference | 4.375 ±" in table and "(4.500 / 4.250)" in table
    assert "| engram-reference-engram | 0.375 ±" in diff_table(report, "flops")


def test_a_compare_run_trains_the_named_variant(tmp_path):
    cfg = CompareConfig(kinds=("engram-reference",), **SMALL)
    result = train_two_steps(cfg, "engram-reference", tmp_path)
    assert result["kind"] == "engram-reference" and result["model"]["engram_variant"] == "reference"
    assert result["fit"]["steps"] == 2 and result["table_lr"] is not None
    # the arms are not part of a run's digest: adding --variants keeps the default arms' finished runs
    assert CompareConfig(variants=("reference",)).digest() == CompareConfig().digest()
