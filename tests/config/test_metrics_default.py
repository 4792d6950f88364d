"""metrics.sentiment: on for the default joy prompts and the joy experiments, off for other prompts."""

import pytest

from helpers import compose


@pytest.mark.parametrize("overrides,on", [
    ((), True),                                         # the main job: joy minus gloom
    (("prompts=refusal",), False),                      # another concept: VADER says nothing about it
    (("prompts=refusal", "metrics.sentiment=true"), True),
    (("+experiment=smollm2_joy",), True),
    (("+experiment=joy_two_taps", "prompts=refusal"), True),
    (("+experiment=refusal_ablation_layers",), False),
])
def test_sentiment_follows_the_prompts(overrides, on):
    assert compose(*overrides).metrics.sentiment is on
