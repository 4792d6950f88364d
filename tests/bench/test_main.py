"""steer.bench's entry point: the command its report quotes, and bad input refused in one line."""
from steer.bench.__main__ import effective


def test_an_override_a_later_one_replaces_is_left_out():
    table = ["configs=[a,b,c,f,h,i]", "repeats=5", "skip=['*/[de]/*@eps/*']", "max_timed_s=30"]
    mine = ["run=[llama3_8b]", "configs=[a,b,c,f,h]", "skip=['*/*/add@eps/*']"]
    assert effective(table + mine) == ["repeats=5", "max_timed_s=30", "run=[llama3_8b]", "configs=[a,b,c,f,h]",
                                       "skip=['*/*/add@eps/*']"]


def test_order_dicts_packages_and_deletions_keep_their_effect():
    # a.x=5 then a={x:2}: Hydra ends at x=2, so the later dict stays after it
    assert effective(["a={x:1}", "a.x=5", "a={x:2}"]) == ["a={x:1}", "a.x=5", "a={x:2}"]
    assert effective(["a.x=5", "a.x=6", "~b"]) == ["a.x=6", "~b"]
    assert effective(["++m={q:1}", "++m={r:2}"]) == ["++m={q:1}", "++m={r:2}"]  # merged by Hydra: both matter
    assert effective(["db=x", "db@pkg=y", "db=z"]) == ["db@pkg=y", "db=z"]  # another package, another key


def test_distinct_keys_and_prefixed_overrides_pass_unchanged():
    given = ["run=[smollm2]", "+models.smollm2.foo=0", "models.smollm2.repeats=8"]
    assert effective(given) == given
    assert effective([]) == []


def test_a_config_hydra_rejects_is_one_line_and_exit_2(tmp_path):
    import subprocess
    import sys

    from helpers import cli_env

    # the schema's refusals and the bench's own checks alike, before any engine starts (none could start here)
    for override, says in (("bogus=1", "error bogus: is not a setting of this config"),
                           ("repeats=abc", "error repeats: Value 'abc'"),
                           ("repeats=0", "error repeats: must be at least 1, got 0"),
                           ("configs=[a,q]", "error configs[1]: unknown configuration 'q'")):
        res = subprocess.run([sys.executable, "-m", "steer.bench", "run=[tiny]", override], cwd=tmp_path,
                             env=cli_env(tmp_path), capture_output=True, text=True, timeout=120)
        assert res.returncode == 2 and res.stderr.startswith("error ") and says in res.stderr, res.stderr
        assert len(res.stderr.strip().splitlines()) == 1
