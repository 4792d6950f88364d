"""An LLM judge of steered text (`metrics.judge`), as AxBench (Wu et al. 2025) scores steering: any OpenAI-compatible
endpoint rates each steered continuation 0, 1 or 2 on three criteria, each asked in a request of its own:

- concept: how clearly the text shows the concept (`metrics.judge.concept`);
- instruction: how well it follows on from the prompt (a continuation that answers or carries on from it);
- fluency: how fluent and coherent it is.

A text's score is the harmonic mean of the three, 0 where any is 0 (a text that shows the concept by breaking down
scores 0). A reply the judge gives without a rating in the asked form (`Rating: [[N]]`) is recorded as unparsed
(`judge_unparsed` names the criteria) and the text gets no score; the run goes on. Nothing is sent anywhere unless a
user names an endpoint (`metrics.judge.base_url`); the key, where one is needed, is read from the environment variable
`metrics.judge.api_key_env`, never from the config.
"""

import json
import logging
import os
import re
import urllib.error
import urllib.request
from typing import Dict, List, Optional, Sequence

from steer.errors import ConfigError

log = logging.getLogger(__name__)

CRITERIA = ("concept", "instruction", "fluency")
RATING = re.compile(r"Rating:\s*\[\[\s*([0-2](?:\.0+)?)\s*\]\]")

SYSTEM = "You rate short texts written by a language model. You are strict, brief and consistent."
ASK = {
    "concept": ("Does the text below show the concept: {concept}?\n"
                "Rate 0 if the concept is absent, 1 if it is somewhat or indirectly present, 2 if it is clearly "
                "present.\n\nText: {text}"),
    "instruction": ("The text below was written to continue or answer the prompt \"{prompt}\".\n"
                    "Rate 0 if it is unrelated to the prompt, 1 if it is loosely related, 2 if it follows on from the "
                    "prompt well.\n\nText: {text}"),
    "fluency": ("How fluent is the text below?\n"
                "Rate 0 if it is broken or repetitive, 1 if it is somewhat fluent with errors or repetition, 2 if it "
                "is fluent and coherent.\n\nText: {text}"),
}
END = "\n\nExplain in one sentence, then end with your rating in exactly this form: Rating: [[N]] (N is 0, 1 or 2)."


def parse(reply: Optional[str]) -> Optional[int]:
    """The rating in a judge's reply (its last `Rating: [[N]]`), or None where there is none."""
    found = RATING.findall(reply or "")
    return int(float(found[-1])) if found else None


def score(ratings: Dict[str, Optional[int]]) -> Optional[float]:
    """The harmonic mean of the three ratings; 0 where any is 0; None where one is missing."""
    vals = [ratings.get(c) for c in CRITERIA]
    if any(v is None for v in vals):
        return None
    if any(v == 0 for v in vals):
        return 0.0
    return len(vals) / sum(1.0 / v for v in vals)


def _key(conf) -> Optional[str]:
    if not conf.api_key_env:
        return None
    key = os.environ.get(conf.api_key_env)
    if not key:
        raise ConfigError("metrics.judge.api_key_env", f"names the environment variable {conf.api_key_env!r}, which "
                                                       "is unset or empty; export it with the endpoint's key")
    return key


def request(conf, content: str, key: Optional[str]) -> str:
    """One chat completion from the endpoint: the reply's text. Greedy (temperature 0), `max_tokens` long."""
    body = {"model": conf.model, "messages": [{"role": "system", "content": SYSTEM},
                                              {"role": "user", "content": content}],
            "temperature": 0, "max_tokens": conf.max_tokens}
    headers = {"Content-Type": "application/json"}
    if key:
        headers["Authorization"] = f"Bearer {key}"
    url = conf.base_url.rstrip("/") + "/chat/completions"
    req = urllib.request.Request(url, json.dumps(body).encode(), headers, method="POST")
    with urllib.request.urlopen(req, timeout=conf.timeout_s) as r:
        got = json.loads(r.read().decode())
    return got["choices"][0]["message"]["content"] or ""


def rate(conf, rows: Sequence[Dict]) -> None:
    """Rate every row's steered text (a row of results.jsonl: `prompt`, `steered`) in place: `judge_concept`,
    `judge_instruction`, `judge_fluency` (0-2, or None), `judge` (the score), `judge_unparsed` (the criteria whose
    reply held no rating) and `judge_replies`. An endpoint that cannot be reached fails the run, naming it."""
    key = _key(conf)
    for r in rows:
        ratings, replies, unparsed = {}, {}, []
        for c in CRITERIA:
            content = ASK[c].format(concept=conf.concept, prompt=r["prompt"], text=r["steered"]) + END
            try:
                reply = request(conf, content, key)
            except (urllib.error.URLError, OSError, ValueError, KeyError, IndexError) as e:
                raise ConfigError("metrics.judge.base_url", f"{conf.base_url!r} did not answer a chat completion "
                                                            f"({type(e).__name__}: {e})") from e
            replies[c], ratings[c] = reply, parse(reply)
            if ratings[c] is None:
                unparsed.append(c)
        r.update({f"judge_{c}": ratings[c] for c in CRITERIA})
        r.update(judge=score(ratings), judge_unparsed=unparsed, judge_replies=replies)
        if unparsed:
            log.warning("judge: no rating for %s of %r in its reply; recorded as unparsed", ", ".join(unparsed),
                        r["prompt"])


def counts(rows: List[Dict]) -> Dict[str, Optional[float]]:
    """metrics.json's judge keys: the mean score over the rated texts and how many replies held no rating."""
    scored = [r["judge"] for r in rows if r.get("judge") is not None]
    return {"judge": sum(scored) / len(scored) if scored else None,
            "judge_unparsed": sum(len(r.get("judge_unparsed") or ()) for r in rows)}
