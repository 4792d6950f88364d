"""distinct-2 and repetition on continuations counted by hand."""

import pytest

from steer.runs.metrics import distinct2, repetition


def test_distinct2_counts_distinct_bigrams_over_all():
    assert distinct2([1, 2, 3, 4]) == 1.0
    assert distinct2([7, 7, 7, 7, 7]) == pytest.approx(1 / 4)  # "la la la la la": one bigram, four times
    assert distinct2([1, 2, 1, 2, 3]) == pytest.approx(3 / 4)  # (1,2) (2,1) (1,2) (2,3)
    assert distinct2([5]) is None and distinct2([]) is None


def test_repetition_is_the_share_of_tokens_inside_a_repeated_trigram():
    assert repetition([1, 2, 3, 4, 5, 6]) == 0.0
    assert repetition([9, 9, 9, 9]) == 1.0  # (9,9,9) twice covers every token
    # (1,2,3) at 0 and 4 covers tokens 0-2 and 4-6; token 3 (the 8) and 7 (the 5) are outside
    assert repetition([1, 2, 3, 8, 1, 2, 3, 5]) == pytest.approx(6 / 8)
    assert repetition([1, 2]) == 0.0 and repetition([]) is None
