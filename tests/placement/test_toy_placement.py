"""Adding a table placement is one file: this one. `CountingTables` keeps its rows behind a counting wrapper, in
training (the model's own tables, every row read counted) and in inference (the checkpoint's rows in host
memory, every gathered row counted); registered, it trains two steps bitwise equal to resident tables and
generates the same greedy tokens, through the same trainer, loader and engine, which name no placement.
docs/architecture.md's recipe ("Add a table placement") follows this file. Run:
`OMP_NUM_THREADS=1 python -m pytest tests/placement/test_toy_placement.py -q`.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from stemlm.errors import StemlmError
from stemlm.inference.generate import generate
from stemlm.inference.load import InferenceOptions, load_inference
from stemlm.offload.providers import TableProvider
from stemlm.placement.base import Placement, StoredTables
from stemlm.placement.registry import ENTRY_POINT_GROUP, register, unregister
from stemlm.train.report import final_report, render_report
from stemlm.train.trainer import Trainer
from tests.placement.test_host import same_run


class CountingProvider(TableProvider):
    """Inference rows: every table layer's rows in host memory, one token-major gather, each row counted."""

    def __init__(self, stored: StoredTables) -> None:
        layers = sorted(stored.sources)
        tables = [stored.sources[i].rows(slice(None), stored.dtype or torch.float32) for i in layers]
        super().__init__(tables[0].shape[0], layers, [t.shape[1] for t in tables], tables[0].dtype)
        self.matrix = torch.cat(tables, dim=1)
        self.rows_read = 0

    def gather(self, ids: torch.Tensor) -> torch.Tensor:
        self.rows_read += ids.numel()
        return self.matrix.index_select(0, ids)


class CountingTables(Placement):
    """`--tables counting`: the tables where resident ones are, every row read through a counter."""

    name = "counting"
    tables = "counting"
    where = "behind a counter"
    offloaded = True  # inference: the tables leave the model; rows come through the provider and the row cache
    providers: list[CountingProvider] = []  # every provider built, to read the counts back

    @classmethod
    def provider(cls, stored: StoredTables) -> TableProvider:
        cls.providers.append(CountingProvider(stored))
        return cls.providers[-1]

    def __init__(self, model: torch.nn.Module) -> None:
        self.tables_of = model.token_tables()
        self.rows_read = 0

    @classmethod
    def for_training(cls, model: torch.nn.Module, device: torch.device) -> CountingTables:
        return cls(model)

    def read(self, layer: int, ids: torch.Tensor) -> torch.Tensor:
        self.rows_read += ids.numel()
        return self.tables_of[layer](ids)  # the model's own lookup, so gradients reach its own table

    def rows(self, window: int, ids: torch.Tensor):
        return {"token": self.read}

    def lookup_rows(self):
        return {"token": self.read}

    def summary(self, optimizers) -> dict:
        return {"rows_read": self.rows_read}

    @classmethod
    def report_lines(cls, record: dict) -> list[str]:
        return [f"tables behind a counter: {record['rows_read']:,} rows read"]


@pytest.fixture
def counting():
    register(CountingTables)
    CountingTables.providers.clear()
    yield CountingTables
    unregister(CountingTables.name)


def test_a_placement_defined_here_trains_and_generates_like_resident(
    counting, tmp_path, make_train_config, make_model_config
):
    kw = dict(steps=2, eval_every=2, table_optim="lazy_adamw")
    resident = Trainer(make_model_config("stem"), make_train_config(tmp_path / "a", **kw), progress=False)
    resident.fit()
    toy = Trainer(make_model_config("stem"), make_train_config(tmp_path / "b", tables="counting", **kw), progress=False)
    result = toy.fit()
    assert isinstance(toy.tables, CountingTables)
    same_run(resident, toy, tmp_path / "a" / "run", tmp_path / "b" / "run")  # losses, grad norms, weights: bitwise
    # Two steps of 4 windows of 32 tokens, each row read once per table layer, plus the held-out evaluation.
    layers = len(toy.model.token_tables())
    assert result["rows_read"] >= 2 * 4 * 32 * layers
    assert result["placement"] == "counting"
    assert (
        f"tables behind a counter: {result['rows_read']:,} rows read"
        in render_report(final_report(toy, result, "", 0)).splitlines()
    )

    checkpoint = tmp_path / "a" / "run" / "checkpoints" / "step-000002"
    prompt = list(range(5, 17))
    with load_inference(checkpoint) as lm:
        expected = generate(lm.model, prompt, 12, greedy=True)
    with load_inference(checkpoint, InferenceOptions(tables="counting", cache_rows=4)) as lm:
        assert generate(lm.model, prompt, 12, greedy=True) == expected
        assert lm.offloaded.memory()["placement"] == "counting"
        assert lm.offloaded.summary().splitlines()[0].split(", ")[1].startswith("tables behind a counter")
    assert [p.rows_read > 0 for p in counting.providers] == [True]  # the misses of the 4-row cache, counted


def test_a_placement_a_package_declares_is_every_command_s_choice(tmp_path, make_train_config, make_model_config):
    """The toy placement as another package would ship it: an entry point in the `stemlm.placement` group of an
    installed distribution; `stemlm generate --tables counting` then runs it, with the resident run's tokens."""
    site = tmp_path / "site"
    dist = site / "stemlm_counting-0.1.dist-info"
    dist.mkdir(parents=True)
    (dist / "METADATA").write_text("Metadata-Version: 2.1\nName: stemlm-counting\nVersion: 0.1\n")
    (dist / "entry_points.txt").write_text(
        f"[{ENTRY_POINT_GROUP}]\ncounting = tests.placement.test_toy_placement:CountingTables\n"
    )
    Trainer(make_model_config("stem"), make_train_config(tmp_path / "a", steps=2, eval_every=0), progress=False).fit()
    checkpoint = tmp_path / "a" / "run" / "checkpoints" / "step-000002"
    repo = Path(__file__).resolve().parents[2]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(site), str(repo), os.environ.get("PYTHONPATH", "")])}

    def generate_with(tables: str) -> tuple[list[int], str | None]:
        argv = [sys.executable, "-m", "stemlm", "generate", str(checkpoint), "--ids", "5,6,7,8,9,10"]
        argv += ["--max-new-tokens", "8", "--greedy", "--tables", tables, "--json"]
        done = subprocess.run(argv, capture_output=True, text=True, env=env, cwd=tmp_path)
        assert done.returncode == 0, done.stderr
        out = json.loads(done.stdout)
        return out["token_ids"], out.get("tables", {}).get("placement")

    assert generate_with("counting") == (generate_with("resident")[0], "counting")


def test_an_unregistered_placement_is_a_one_line_error(tmp_path, make_train_config):
    with pytest.raises(StemlmError, match="tables must be one of device, host, got 'counting'"):
        make_train_config(tmp_path, tables="counting")
