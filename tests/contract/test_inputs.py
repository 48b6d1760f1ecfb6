"""The mask check every edge shares (contract/inputs.py): the stateless model, the session engines'
step check and the gateway all refuse a mask value other than 0 or 1 with the same message."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from contract import names
from contract.config import preset
from contract.inputs import InputError, check_mask_values
from serving.engine.steps import StepRequest, check_step


@pytest.mark.parametrize("value", [5, -1, 2])
def test_a_mask_value_other_than_0_or_1_is_refused_naming_the_input_the_value_and_where(value):
    mask = np.ones((2, 4), np.int64)
    mask[1, 3] = value
    with pytest.raises(InputError) as raised:
        check_mask_values({names.ATTENTION_MASK: mask})
    assert raised.value.input_name == names.ATTENTION_MASK
    assert str(raised.value) == (
        f"input 'attention_mask': expected values 0 (padding) or 1 (attend), got {value} at index [1, 3]"
    )


def test_masks_of_0_and_1_and_left_out_masks_pass():
    check_mask_values({names.ATTENTION_MASK: np.array([[0, 1, 1, 0]], np.int64)})
    check_mask_values({names.ATTENTION_MASK: np.zeros((1, 0), np.int64)})
    check_mask_values({names.HIDDEN_STATES: np.full((1, 1, 4), 7.0, np.float32)})  # no mask: all ones


def test_a_session_step_refuses_the_same_mask_with_the_same_message():
    cfg = preset("tiny")
    step = StepRequest(7, start=True, end=False, hidden=np.ones((1, 2, cfg.d_model), np.float32))
    with pytest.raises(InputError) as stateless:
        check_mask_values({names.ATTENTION_MASK: np.array([[1, 5]], np.int64)})
    with pytest.raises(InputError) as stepped:
        check_step(cfg, dataclasses.replace(step, mask=np.array([[1, 5]], np.int64)))
    assert str(stepped.value) == str(stateless.value)
    assert check_step(cfg, dataclasses.replace(step, mask=np.array([[0, 1]], np.int64))) == 2
