"""Tests of `stemlm info`: JSON contract, the paper-1b-counts comparison, config sources, overrides, errors, and
that inspecting the 6.7B-parameter preset allocates no real tensor (checked with a dispatch mode).

    OMP_NUM_THREADS=1 python -m pytest tests/cli/test_info.py -q
"""

from __future__ import annotations

import json

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from stemlm.cli.main import main
from stemlm.model import accounting as acc
from stemlm.model import build_model
from stemlm.model.presets import get_preset, list_presets, preset_source


def run_json(capsys, *argv: str) -> dict:
    assert main(["info", *argv, "--json"]) == 0
    out = capsys.readouterr().out
    return json.loads(out)  # fails unless stdout is exactly one JSON document


class LargestRealTensor(TorchDispatchMode):
    """Records the largest non-meta tensor any op (factories included) produces while active."""

    def __init__(self) -> None:
        super().__init__()
        self.largest = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in tree_flatten(out)[0]:
            if isinstance(t, torch.Tensor) and t.device.type != "meta":
                self.largest = max(self.largest, t.numel() * t.element_size())
        return out


def test_paper_1b_json_allocates_nothing(capsys):
    with LargestRealTensor() as mode:
        s = run_json(capsys, "--preset", "paper-1b-counts", "--verify")
    assert mode.largest < 2**20  # the smallest weight of paper-1b-counts (k_proj, fp32) is 4 MiB
    total = acc.total_parameters(get_preset("paper-1b-counts"))
    assert s["verified_parameters_on_meta"] == s["parameters"]["total"] == total
    assert s["seq_len"] == 2048 and s["paper"]["preset"] == "paper-1b-counts"
    assert all(s["paper"]["reproduced"].values())


def test_allocation_probe_sees_a_real_model(tiny_config):
    with LargestRealTensor() as mode:  # the control: a CPU build of a small model is seen
        build_model(tiny_config("stem"))
    assert mode.largest >= 256 * 128 * 4


def test_json_matches_the_accounting_api(capsys):
    s = run_json(capsys, "--preset", "paper-350m", "--seq-len", "4096", "--attention", "full", "--dtype", "fp32")
    config = get_preset("paper-350m")
    assert s["model"] == "paper-350m" and "paper" not in s
    assert s["parameters"]["active_backbone"] == acc.active_parameters(config)["backbone"]
    assert s["flops"]["forward_per_token"] == acc.forward_flops_per_token(config, 4096, "full")
    assert s["decode"]["bytes_per_token"] == acc.decode_bytes_per_token(config, 4096, 4)
    assert s["stem"]["layer_saving_fraction"] == acc.layer_saving_fraction(config, 4096, "full")


def test_default_seq_len_is_capped_by_the_config(capsys):
    assert run_json(capsys, "--preset", "tiny")["seq_len"] == get_preset("tiny").max_position_embeddings


def test_text_output_shows_the_paper_figures(capsys):
    assert main(["info", "--preset", "paper-1b-counts"]) == 0
    out = capsys.readouterr().out
    assert "vs the paper (paper-1b-counts)" in out and "6.75B" in out and "2.83" in out and "why:" in out


@pytest.mark.parametrize("name", ["paper-350m", "paper-1b", "paper-1b-counts-dense", "tiny"])
def test_info_prints_the_presets_source(capsys, tmp_path, name):
    assert main(["info", "--preset", name]) == 0
    assert capsys.readouterr().out.splitlines()[1] == f"source: {preset_source(name)}"
    assert run_json(capsys, "--preset", name)["source"] == preset_source(name)
    (tmp_path / "config.json").write_text(get_preset(name).to_json())
    assert "source" not in run_json(capsys, "--config", str(tmp_path / "config.json"))  # a config file has none


def test_list_presets(capsys):
    assert main(["info", "--list-presets"]) == 0
    listed = [line.split()[0] for line in capsys.readouterr().out.splitlines()[1:]]
    assert listed == list_presets()
    rows = run_json(capsys, "--list-presets")["presets"]
    assert [r["name"] for r in rows] == list_presets()
    assert rows[0]["total"] == acc.total_parameters(get_preset(rows[0]["name"]))


def test_overrides(capsys):
    s = run_json(capsys, "--preset", "tiny", "--set", "intermediate_size=1024", "--set", "model.ffn_layers=all")
    config = get_preset("tiny").replace(intermediate_size=1024, ffn_layers="all")
    assert s["special_layers"] == [0, 1, 2, 3]
    assert s["parameters"]["total"] == acc.total_parameters(config)


@pytest.mark.parametrize("as_folder", [True, False])
def test_config_from_file_or_folder(capsys, tmp_path, as_folder):
    config = get_preset("paper-350m")
    (tmp_path / "config.json").write_text(config.to_json())
    s = run_json(capsys, "--config", str(tmp_path if as_folder else tmp_path / "config.json"), "--seq-len", "512")
    assert s["parameters"]["total"] == acc.total_parameters(config)


def test_nested_run_config(capsys, tmp_path):
    (tmp_path / "run.json").write_text(json.dumps({"model": get_preset("tiny").to_dict(), "steps": 10}))
    s = run_json(capsys, "--config", str(tmp_path / "run.json"))
    assert s["parameters"]["total"] == acc.total_parameters(get_preset("tiny"))


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--preset", "nonsense"], "unknown preset 'nonsense'"),
        (["--preset", "tiny", "--set", "hidden=3"], "unknown config key 'hidden'"),
        (["--preset", "tiny", "--seq-len", "4096"], "exceeds max_position_embeddings"),
        (["--config", "/nonexistent/folder"], "neither a config.json"),
        ([], "give --preset"),
    ],
)
def test_errors_are_one_line_exit_2(capsys, argv, message):
    assert main(["info", *argv]) == 2
    captured = capsys.readouterr()
    assert captured.out == ""
    lines = captured.err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("stemlm info: error: ") and message in lines[0]


def test_bad_json_file(capsys, tmp_path):
    (tmp_path / "config.json").write_text("{not json")
    assert main(["info", "--config", str(tmp_path)]) == 2
    assert "not valid JSON" in capsys.readouterr().err


@pytest.mark.parametrize("with_run_config", [True, False])
def test_config_from_a_run_folder(capsys, tmp_path, with_run_config):
    config = get_preset("tiny")
    step = tmp_path / "checkpoints" / "step-000010"
    step.mkdir(parents=True)
    (step / "config.json").write_text(config.to_json())
    (step / "model.safetensors").write_bytes(b"")  # resolution needs the weights file to exist
    if with_run_config:
        (tmp_path / "run_config.json").write_text(json.dumps({"model": config.to_dict(), "train": {}}))
    s = run_json(capsys, "--config", str(tmp_path))
    assert s["parameters"]["total"] == acc.total_parameters(config)


def test_verify_says_what_it_verified(capsys):
    assert main(["info", "--preset", "tiny", "--verify"]) == 0
    out = capsys.readouterr().out
    total = acc.total_parameters(get_preset("tiny"))
    assert f"verified: the model built on the meta device has {total:,} parameters" in out


@pytest.mark.parametrize("kind", ["stem_ngram", "engram", "memory"])
def test_ffn_flag_with_the_meta_model(capsys, kind):
    s = run_json(capsys, "--preset", "tiny", "--ffn", kind, "--verify")
    config = get_preset("tiny").replace(ffn=kind)
    assert s["ffn"] == kind and s["verified_parameters_on_meta"] == s["parameters"]["total"]
    assert s["parameters"]["total"] == acc.total_parameters(config)
    assert s["decode"]["params_touched"] == acc.decode_params_touched(config)
