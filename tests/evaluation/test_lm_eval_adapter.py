"""The lm-eval adapter: each request type against direct computations, a real offline `simple_evaluate`
run on the shipped tasks, user task folders, and one-line errors for unknown or incomplete tasks."""

from __future__ import annotations

import json

import pytest
import torch
import torch.nn.functional as F
from lm_eval.api.instance import Instance

from stemlm.cli.main import main
from stemlm.errors import StemlmError
from stemlm.evaluation.lm_eval_adapter import StemlmLM, run_lm_eval, summarize_results
from stemlm.evaluation.perplexity import evaluate_perplexity
from stemlm.evaluation.tasks import SHIPPED_TASKS
from stemlm.inference.generate import generate

PAIRS = [
    ("The capital of France is", " Paris"),
    ("", "Once upon a time"),
    ("It was the best of times, it was the worst of times, it was the age of", " wisdom, it was"),
    ("A", " b c d e f"),
]


def _requests(kind, args_list):
    return [Instance(kind, {}, args, i) for i, args in enumerate(args_list)]


def _direct_loglikelihood(model, tok, context, continuation):
    ids = [0, *tok.encode(context).ids]
    cont = tok.encode(continuation).ids
    full = torch.tensor([ids + cont])
    with torch.no_grad():
        logp = F.log_softmax(model(full[:, :-1]).logits[0].float(), -1)
    rows = logp[len(ids) - 1 :]
    return float(rows.gather(-1, torch.tensor(cont)[:, None]).sum()), bool(
        (rows.argmax(-1) == torch.tensor(cont)).all()
    )


def test_loglikelihood_is_sum_of_token_logprobs(lm_and_tok):
    model, tok = lm_and_tok
    got = StemlmLM(model, tok, batch_size=3).loglikelihood(_requests("loglikelihood", PAIRS))
    for (context, continuation), (ll, greedy) in zip(PAIRS, got, strict=True):
        want_ll, want_greedy = _direct_loglikelihood(model, tok, context, continuation)
        assert ll == pytest.approx(want_ll, abs=1e-4)
        assert greedy == want_greedy


def test_trailing_context_space_moves_to_the_continuation(lm_and_tok):
    model, tok = lm_and_tok
    got = StemlmLM(model, tok).loglikelihood(
        _requests("loglikelihood", [("Answer: ", "Paris"), ("Answer:", " Paris"), ("Answer:  ", "Paris")])
    )
    assert got[0] == got[1]
    assert got[2][0] == pytest.approx(_direct_loglikelihood(model, tok, "Answer:", "  Paris")[0], abs=1e-4)


def test_is_greedy_true_for_the_greedy_continuation(lm_and_tok):
    model, tok = lm_and_tok
    context = "The capital of France is"
    new = generate(model, [0, *tok.encode(context).ids], 4, greedy=True)
    continuation = tok.decode(new)
    assert tok.encode(continuation).ids == new  # the decoded text re-encodes to the same tokens
    ((_, greedy),) = StemlmLM(model, tok).loglikelihood(_requests("loglikelihood", [(context, continuation)]))
    assert greedy


def test_long_context_keeps_rightmost_tokens(lm_and_tok):
    model, tok = lm_and_tok
    context, continuation = "word " * 199 + "word", " end"
    ((ll, _),) = StemlmLM(model, tok, max_length=40).loglikelihood(
        _requests("loglikelihood", [(context, continuation)])
    )
    full = [0, *tok.encode(context).ids, *tok.encode(continuation).ids]
    window = torch.tensor([full[-41:-1]])
    with torch.no_grad():
        logp = F.log_softmax(model(window).logits[0, -1].float(), -1)
    assert ll == pytest.approx(float(logp[full[-1]]), abs=1e-4)


def test_rolling_equals_eval_ppl(lm_and_tok):
    model, tok = lm_and_tok
    text = "It is a truth universally acknowledged, that a single man in possession of a good fortune. " * 6
    lm = StemlmLM(model, tok, max_length=48)
    (got,) = lm.loglikelihood_rolling(_requests("loglikelihood_rolling", [(text,)]))
    ppl = evaluate_perplexity(model, tok, [text], window=48)
    assert ppl.tokens > 48  # several windows
    assert got == pytest.approx(-ppl.nats, rel=1e-6)


def test_generate_until_stops_at_the_stop_string(lm_and_tok):
    model, tok = lm_and_tok
    lm = StemlmLM(model, tok)
    context = "Once upon a time"
    full = tok.decode(generate(model, [0, *tok.encode(context).ids], 12, greedy=True, eos_id=0))
    assert len(full) > 4
    stop = full[2:4]
    got = lm.generate_until(
        _requests(
            "generate_until",
            [(context, {"until": [stop], "max_gen_toks": 12}), (context, {"until": [], "max_gen_toks": 12})],
        )
    )
    assert got == [full[: full.find(stop)], full]


@pytest.mark.parametrize(
    "kind, args",
    [
        ("loglikelihood", PAIRS),
        ("loglikelihood_rolling", [(c + t,) for c, t in PAIRS[:2]]),
        ("generate_until", [("Once upon a time", {"until": ["."], "max_gen_toks": 4})] * 3),
    ],
)
def test_each_request_type_shows_a_bar_unless_disabled(lm_and_tok, tty_stderr, kind, args):
    model, tok = lm_and_tok
    method = getattr(StemlmLM(model, tok, batch_size=3), kind)
    quiet = method(_requests(kind, args), disable_tqdm=True)
    assert tty_stderr.readouterr().err == ""
    assert method(_requests(kind, args)) == quiet
    last = tty_stderr.readouterr().err.strip().split("\r")[-1]
    assert last.startswith(f"{kind}: 100%") and f"| {len(args)}/{len(args)} [" in last, last
    assert getattr(StemlmLM(model, tok, batch_size=3, progress=False), kind)(_requests(kind, args)) == quiet
    assert tty_stderr.readouterr().err == ""  # `stemlm eval lm --no-progress`


@pytest.fixture(scope="module")
def shipped_results(lm_and_tok):
    model, tok = lm_and_tok
    return run_lm_eval(StemlmLM(model, tok), limit=3)


def test_real_lm_eval_run_on_shipped_tasks(shipped_results):
    summary = summarize_results(shipped_results)
    assert set(summary) == set(SHIPPED_TASKS)
    for relation in ("capital", "language", "currency"):
        assert 0.0 <= summary[f"stemlm_facts_{relation}"]["acc"] <= 1.0
    assert summary["stemlm_cloze"]["perplexity"] > 1.0
    assert summary["stemlm_heldout_ppl"]["bits_per_byte"] > 0.0
    assert all(n["effective"] == 3 for n in shipped_results["n-samples"].values())


def test_lm_eval_bits_per_byte_matches_eval_ppl(shipped_results, lm_and_tok):
    # lm-eval aggregates our rolling log-likelihoods; the same passages through evaluate_perplexity agree.
    from stemlm.evaluation.tasks import shipped_task_dir

    model, tok = lm_and_tok
    lines = (shipped_task_dir() / "data" / "stemlm_heldout_ppl.jsonl").read_text().splitlines()[:3]
    texts = [json.loads(line)["text"] for line in lines]
    ours = evaluate_perplexity(model, tok, texts, window=model.config.max_position_embeddings)
    lm_eval_bpb = summarize_results(shipped_results)["stemlm_heldout_ppl"]["bits_per_byte"]
    assert lm_eval_bpb == pytest.approx(ours.bits_per_byte, rel=1e-5)


def _user_task(folder, name="my_task", drop=None):
    (folder / "data").mkdir(parents=True, exist_ok=True)
    docs = [
        {"q": "The capital of France is", "choices": [" Paris", " Rome"], "gold": 0},
        {"q": "The capital of Italy is", "choices": [" Paris", " Rome"], "gold": 1},
    ]
    (folder / "data" / "d.jsonl").write_text("".join(json.dumps(d) + "\n" for d in docs))
    fields = {
        "task": name,
        "dataset_path": "json",
        "dataset_kwargs": {"data_files": {"test": "data/d.jsonl"}},
        "test_split": "test",
        "output_type": "multiple_choice",
        "doc_to_text": "{{q}}",
        "doc_to_choice": "{{choices}}",
        "doc_to_target": "gold",
        "target_delimiter": "",
    }
    fields.pop(drop, None)
    (folder / f"{name}.yaml").write_text(json.dumps(fields))  # JSON is valid YAML
    return folder


def test_user_folder_with_relative_data_files_from_another_cwd(lm_and_tok, tmp_path, monkeypatch):
    model, tok = lm_and_tok
    folder = _user_task(tmp_path / "tasks")
    monkeypatch.chdir(tmp_path / "tasks" / "data")  # relative paths must not depend on the working directory
    results = run_lm_eval(StemlmLM(model, tok), ["my_task"], include_paths=[str(folder)])
    want = [
        _direct_loglikelihood(model, tok, "The capital of France is", c)[0]
        > _direct_loglikelihood(model, tok, "The capital of France is", o)[0]
        for c, o in [(" Paris", " Rome")]
    ]
    want.append(
        _direct_loglikelihood(model, tok, "The capital of Italy is", " Rome")[0]
        > _direct_loglikelihood(model, tok, "The capital of Italy is", " Paris")[0]
    )
    assert summarize_results(results)["my_task"]["acc"] == pytest.approx(sum(want) / 2)


def test_unknown_task_and_missing_fields_are_clear_errors(lm_and_tok, tmp_path):
    model, tok = lm_and_tok
    lm = StemlmLM(model, tok)
    with pytest.raises(StemlmError, match="unknown task 'no_such_task'"):
        run_lm_eval(lm, ["no_such_task"])
    folder = _user_task(tmp_path / "broken", drop="doc_to_choice")
    with pytest.raises(StemlmError, match="missing 'doc_to_choice'"):
        run_lm_eval(lm, ["my_task"], include_paths=[str(folder)])
    folder = _user_task(tmp_path / "nodata", name="other", drop="dataset_path")
    with pytest.raises(StemlmError, match="missing 'dataset_path'"):
        run_lm_eval(lm, ["other"], include_paths=[str(folder)])


def test_cli_errors_exit_2_with_one_line(tiny_ckpt, tmp_path, capsys):
    assert main(["eval", "lm", str(tiny_ckpt), "--tasks", "no_such_task"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("stemlm eval: error: unknown task 'no_such_task'") and "\n" not in err
    folder = _user_task(tmp_path / "broken", drop="test_split")
    assert main(["eval", "lm", str(tiny_ckpt), "--tasks", "my_task", "--include-path", str(folder)]) == 2
    err = capsys.readouterr().err.strip()
    assert "missing 'test_split' or 'validation_split'" in err and "\n" not in err


def test_cli_json(tiny_ckpt, tty_stderr):
    argv = ["eval", "lm", str(tiny_ckpt), "--tasks", "stemlm_facts_capital", "--limit", "2", "--json"]
    assert main(argv) == 0
    out, err = tty_stderr.readouterr()
    out = json.loads(out)
    assert set(out["results"]) == {"stemlm_facts_capital"} and 0 <= out["results"]["stemlm_facts_capital"]["acc"] <= 1
    assert "loglikelihood: 100%" in err
    assert main([*argv, "--no-progress"]) == 0
    assert "loglikelihood:" not in tty_stderr.readouterr().err


def test_registered_with_lm_eval_by_name(tiny_ckpt, lm_and_tok):
    from lm_eval.api.registry import get_model

    model, _ = lm_and_tok
    lm = get_model("stemlm").create_from_arg_string(f"pretrained={tiny_ckpt},batch_size=2", {"device": None})
    assert isinstance(lm, StemlmLM) and lm.batch_size == 2 and lm.max_length == model.config.max_position_embeddings
    ((ll, _),) = lm.loglikelihood(_requests("loglikelihood", [PAIRS[0]]))
    assert ll == pytest.approx(_direct_loglikelihood(model, lm.tok, *PAIRS[0])[0], abs=1e-4)
    with pytest.raises(StemlmError, match="pretrained=CKPT"):
        get_model("stemlm").create_from_arg_string("batch_size=2")


def test_task_report_gives_n_stderr_and_chance(shipped_results):
    import json as _json
    import math

    from stemlm.evaluation.lm_eval_adapter import task_report
    from stemlm.evaluation.tasks import shipped_task_dir

    report = task_report(shipped_results)
    capital = report["stemlm_facts_capital"]
    rows = [_json.loads(line) for line in (shipped_task_dir() / "data" / "stemlm_facts_capital.jsonl").open()][:3]
    assert capital["n"] == 3 and capital["chance"] == pytest.approx(sum(1 / len(r["choices"]) for r in rows) / 3)
    p = capital["metrics"]["acc"]["value"]
    assert capital["metrics"]["acc"]["stderr"] == pytest.approx(math.sqrt(p * (1 - p) / 2))
    assert report["stemlm_cloze"]["chance"] is None  # a greedy-match task has no uniform-guess level
    assert report["stemlm_heldout_ppl"]["metrics"]["bits_per_byte"]["stderr"] is None


def test_cli_text_shows_n_stderr_and_chance(tiny_ckpt, capsys):
    assert main(["eval", "lm", str(tiny_ckpt), "--tasks", "stemlm_facts_capital", "--limit", "4"]) == 0
    out = capsys.readouterr().out
    assert "stemlm_facts_capital  n    4  acc " in out and " ± " in out and "(chance 0.250)" in out


def test_rendered_table_aligns_tasks_and_ends_with_the_legend():
    from stemlm.evaluation.lm_eval_adapter import render_task_report

    report = {
        "a": {"n": 4, "chance": 0.25, "metrics": {"acc": {"value": 0.5, "stderr": 0.2887}}},
        "longer": {"n": 10, "chance": None, "metrics": {"bits_per_byte": {"value": 1.25, "stderr": None}}},
    }
    lines = render_task_report(report).splitlines()
    assert lines[0] == "a       n    4  acc 0.5000 ± 0.2887  (chance 0.250)"
    assert lines[1] == "longer  n   10  bits_per_byte 1.2500  (chance n/a)"
    assert lines[2].startswith("± is one standard error")


def test_results_summary_is_what_the_json_prints(shipped_results):
    from stemlm.evaluation.lm_eval_adapter import results_summary, summarize_results, task_report

    summary = results_summary(shipped_results)
    assert summary["results"] == summarize_results(shipped_results) and summary["tasks"] == task_report(shipped_results)
    assert summary["n_samples"] == shipped_results.get("n-samples", {})
