"""steer.bench's entry point: the command its report quotes."""
from steer.bench.__main__ import effective


def test_a_key_given_twice_keeps_its_last_value_in_its_first_place():
    table = ["configs=[a,b,c,f,h,i]", "trace=[]", "skip=['*/[de]/*@eps/*']", "lanes=[{runs:['*'],cpus:'2-9'}]"]
    mine = ["run=[llama3_8b]", "configs=[a,b,c,f,h]", "skip=['*/*/add@eps/*']"]
    assert effective(table + mine) == ["configs=[a,b,c,f,h]", "trace=[]", "skip=['*/*/add@eps/*']",
                                       "lanes=[{runs:['*'],cpus:'2-9'}]", "run=[llama3_8b]"]


def test_distinct_keys_and_prefixed_overrides_pass_unchanged():
    given = ["run=[smollm2]", "+models.smollm2.env.VLLM_ENABLE_V1_MULTIPROCESSING=0", "models.smollm2.min_timed_s=8"]
    assert effective(given) == given
    assert effective([]) == []
