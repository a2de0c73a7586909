"""`generate()` (the Python API) refuses prompts that are not one flat list of integer ids with one StemlmError line,
instead of truncating floats (1.7 -> 1), reading booleans as ids or raising torch's errors for ragged lists."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from stemlm.errors import StemlmError
from stemlm.inference.generate import generate, stream_tokens
from tests.conftest import make_tiny_model


@pytest.fixture(scope="module")
def model():
    return make_tiny_model("stem")


@pytest.mark.parametrize(
    ("ids", "message"),
    [
        ([1.5, 2.0], "flat list of integer token ids; got an element 1.5"),
        ([1, 2.0], "got an element 2.0"),
        ([[1, 2], [3]], "got an element [1, 2]"),
        ([[1.0, 2.0]], "got an element 1.0"),
        ([True, False], "got an element True"),
        ([1, "2"], "got an element '2'"),
        ([1, None], "got an element None"),
        ([np.float32(1.0)], "got an element"),
        ([np.bool_(True)], "got an element"),
        ("1,2,3", "takes a list of token ids, got str"),
        (None, "takes a list of token ids, got NoneType"),
        (7, "takes a list of token ids, got int"),
        (torch.tensor([1.0, 2.0]), "integer token ids, got a torch.float32 tensor"),
        (torch.tensor([True, False]), "got a torch.bool tensor"),
        (np.array([1.5, 2.5]), "integer token ids, got a float64 array"),
    ],
)
def test_a_prompt_that_is_not_flat_integer_ids_is_refused(model, ids, message):
    for call in (generate, stream_tokens):
        with pytest.raises(StemlmError, match="generate takes") as info:
            call(model, ids, 2)
        assert message in str(info.value)


@pytest.mark.parametrize("ids", [[5, 9, 2], [[5, 9, 2]], (5, 9, 2), np.array([5, 9, 2]), torch.tensor([[5, 9, 2]])])
def test_every_accepted_form_gives_the_same_tokens(model, ids):
    assert generate(model, ids, 3, greedy=True) == generate(model, [5, 9, 2], 3, greedy=True)
