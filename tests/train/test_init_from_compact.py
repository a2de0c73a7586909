"""Training from a checkpoint whose tables are stored compactly (`stemlm convert CKPT --table-dtype int8`):
`--init-from` starts from the dequantised rows; resuming from one is refused (it is no trainer checkpoint)."""

from __future__ import annotations

import pytest
import torch

from stemlm.checkpoint.folder import save_pretrained
from stemlm.convert.table_dtype import convert_tables
from stemlm.data.tokenizer import load_tokenizer
from stemlm.errors import StemlmError
from stemlm.model import build_model
from stemlm.train.state import read_trainer_state
from stemlm.train.trainer import Trainer


def test_init_from_int8_starts_from_dequantised_tables(tmp_path, make_train_config, make_model_config, train_assets):
    start = build_model(make_model_config("stem"), seed=5)
    save_pretrained(start, tmp_path / "fp32", tokenizer=load_tokenizer(train_assets["tokenizer"]))
    convert_tables(tmp_path / "fp32", "int8", tmp_path / "int8")
    cfg = make_train_config(tmp_path, steps=1, tokenizer=None, init_from=str(tmp_path / "int8"), eval_every=0)
    trainer = Trainer(None, cfg, progress=False)
    for name, param in trainer.model.named_parameters():
        original = start.get_parameter(name).detach()
        if name.endswith("stem_embedding.weight"):  # within half a quantisation step of the fp32 rows
            step = original.abs().amax(dim=1, keepdim=True) / 127
            assert param.dtype == torch.float32 and not torch.equal(param, original)
            assert ((param - original).abs() <= step / 2 * (1 + 1e-5)).all()
        else:
            assert torch.equal(param, original), name
    with pytest.raises(StemlmError, match="not a trainer checkpoint.*--init-from"):
        read_trainer_state(tmp_path / "int8")
