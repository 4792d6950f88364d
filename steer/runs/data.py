"""A user's own prompts and contrastive pairs from files, read with the `datasets` library, before any engine.

- Prompts to continue (`prompts.steer_file`): a .txt file, one prompt a line; a .jsonl / .json / .csv file or a
  `datasets` directory (`Dataset.save_to_disk`), one prompt a record in the field `prompts.field`.
- Contrastive pairs (`prompts.pairs_file`): a .jsonl / .json / .csv file or a `datasets` directory whose records
  hold `prompts.positive_field` and `prompts.negative_field`; or a CAA A/B file, a JSON list of
  `{question, answer_matching_behavior, answer_not_matching_behavior}`, where the positive prompt is the question
  followed by the matching answer and the negative the question followed by the other.
- Two .txt files, as llama.cpp's cvector-generator takes them (`--positive-file`, `--negative-file`):
  `prompts.positive_file` and `prompts.negative_file`, one prompt a line, line i of one paired with line i of the
  other.

In a .txt file a blank line is skipped and the escapes `\\n`, `\\t` and `\\\\` stand for a newline, a tab and a
backslash (a prompt of several lines fits on one). Bad input is a ConfigError naming the config field and the file.
"""

import json
import re
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Dict, List, Sequence, Tuple

from steer.errors import ConfigError

CAA_FIELDS = ("question", "answer_matching_behavior", "answer_not_matching_behavior")
SUFFIXES = {".txt": "text", ".jsonl": "json", ".json": "json", ".csv": "csv"}


@dataclass(frozen=True)
class ABItem:
    """One A/B question in CAA's format: the question shows both options; each answer names one (e.g. "(A)")."""

    question: str
    matching: str
    not_matching: str


def records(path, field: str) -> List[Dict]:
    """The records of a .txt (field "text", one a line), .jsonl, .json or .csv file or of a `datasets` directory,
    as dicts. `field`: the config field that named the file, for errors."""
    p = Path(str(path)).expanduser()
    if not p.exists():
        raise ConfigError(field, f"{str(path)!r} does not exist")
    import datasets

    datasets.disable_progress_bars()
    datasets.logging.set_verbosity_error()
    if p.is_dir():
        try:
            ds = datasets.load_from_disk(str(p), keep_in_memory=True)
        except (FileNotFoundError, ValueError, OSError) as e:
            raise ConfigError(field, f"{str(path)!r} is a directory but not one `datasets` saved "
                                     f"(Dataset.save_to_disk): {e}") from e
        if isinstance(ds, datasets.DatasetDict):
            raise ConfigError(field, f"{str(path)!r} holds several splits ({', '.join(ds)}); save one split "
                                     "(dataset['train'].save_to_disk(...))")
        rows = ds.to_list()
    elif p.suffix.lower() not in SUFFIXES:
        raise ConfigError(field, f"{str(path)!r}: expected a .txt, .jsonl, .json or .csv file or a `datasets` "
                                 "directory")
    elif p.stat().st_size == 0:
        rows = []
    else:
        builder = SUFFIXES[p.suffix.lower()]
        if p.suffix.lower() == ".jsonl":
            _check_jsonl(p, field)  # datasets would say it in its log, without the line
        with tempfile.TemporaryDirectory() as cache:  # read into memory: the file leaves nothing behind it
            try:
                ds = datasets.load_dataset(builder, data_files=str(p), split="train", cache_dir=cache,
                                           keep_in_memory=True)
            except Exception as e:  # datasets and pyarrow raise many kinds for a malformed file
                detail = " ".join(str(e).split())[:300] or type(e).__name__
                raise ConfigError(field, f"{str(path)!r} cannot be read as {p.suffix.lower()[1:]}: {detail}") from e
            rows = ds.to_list()
        if builder == "text":
            rows = [{"text": _unescape(r["text"])} for r in rows if r["text"].strip()]
    if not rows:
        raise ConfigError(field, f"{str(path)!r} is empty; it must hold at least one record")
    return rows


def _check_jsonl(p: Path, field: str) -> None:
    """ConfigError naming the first line of a .jsonl file that is not a JSON object, and the parser's reason."""
    with p.open(encoding="utf-8", errors="replace") as f:
        for n, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                record = json.loads(line)
            except ValueError as e:
                raise ConfigError(field, f"{str(p)!r} line {n} is not JSON: {e.msg} at column {e.colno}") from e
            if not isinstance(record, dict):
                raise ConfigError(field, f"{str(p)!r} line {n} is a JSON {type(record).__name__}; each line of a "
                                         ".jsonl file must be an object ({{\"field\": ...}})")


SHIPPED = Path(__file__).resolve().parent.parent / "data"  # datasets that ship with the package


def dataset_path(name: str) -> Path:
    """`eval.dataset` as a file: a shipped dataset's name (steer/data/<name>.json), else a path."""
    shipped = SHIPPED / f"{name}.json"
    if "/" not in name and not Path(name).suffix and shipped.is_file():
        return shipped
    return Path(name).expanduser()


def shipped() -> List[str]:
    return sorted(p.stem for p in SHIPPED.glob("*.json"))


def load_texts(path, text_field: str = "text", field: str = "prompts.steer_file") -> List[str]:
    """One prompt per record: a .txt file's lines, else each record's `text_field`."""
    return _column(records(path, field), text_field, path, field, "prompts.field")


def _pairs(rows: Sequence[Dict], path, positive: str, negative: str, field: str) -> Tuple[List[str], List[str]]:
    """(positive prompts, negative prompts) of a pairs file's records: the fields `positive` and `negative`, or
    CAA A/B items (question + matching answer, question + the other)."""
    if _is_caa(rows):
        items = _ab_items(rows, path, field)
        return [ab_text(x.question, x.matching) for x in items], [ab_text(x.question, x.not_matching) for x in items]
    return (_column(rows, positive, path, field, "prompts.positive_field"),
            _column(rows, negative, path, field, "prompts.negative_field"))


def load_txt_pairs(positive_path, negative_path) -> Tuple[List[str], List[str]]:
    """Two .txt files as llama.cpp's cvector-generator reads them (--positive-file, --negative-file): line i of one
    paired with line i of the other, so both hold as many prompts."""
    pos = load_texts(positive_path, field="prompts.positive_file")
    neg = load_texts(negative_path, field="prompts.negative_file")
    if len(pos) != len(neg):
        raise ConfigError("prompts.negative_file", f"{str(negative_path)!r} holds {len(neg)} prompts and "
                                                   f"{str(positive_path)!r} (prompts.positive_file) {len(pos)}; the "
                                                   "files are paired line by line")
    return pos, neg


def load_ab(path, field: str = "eval.dataset") -> List[ABItem]:
    """The items of a CAA A/B file (or `datasets` directory): each with a question and two different answers."""
    rows = records(path, field)
    if not _is_caa(rows):
        raise ConfigError(field, f"{str(path)!r} is not in the CAA A/B format: its records need the fields "
                                 f"{', '.join(CAA_FIELDS)} (it has {', '.join(sorted(rows[0]))})")
    return _ab_items(rows, path, field)


def ab_text(question: str, answer: str) -> str:
    """A CAA pair's prompt for extraction through `prompts.pairs_file`: the question, then the answer."""
    return f"{question}\n{answer}"


def fill_prompts(p) -> bool:
    """Replace `prompts.steer` / `positive` / `negative` (a PromptsConf) by what the files it names hold; whether
    the pairs are CAA A/B items (from `pairs_file`)."""
    from steer.config import checks

    checks.prompt_files(p)
    if p.steer_file is not None:
        p.steer = load_texts(p.steer_file, p.field)
    for side in ("positive", "negative"):  # an edit's condition prompts (edit.when, task=condition)
        path = getattr(p, f"condition_{side}_file")
        if path is not None:
            setattr(p, f"condition_{side}", load_texts(path, p.field, f"prompts.condition_{side}_file"))
    if p.pairs_file is not None:
        rows = records(p.pairs_file, "prompts.pairs_file")  # read once: the pairs, and whether they are A/B items
        p.positive, p.negative = _pairs(rows, p.pairs_file, p.positive_field, p.negative_field, "prompts.pairs_file")
        return _is_caa(rows)
    if p.positive_file is not None:
        p.positive, p.negative = load_txt_pairs(p.positive_file, p.negative_file)
    return False


def is_caa_file(path) -> bool:
    """Whether a pairs file holds CAA A/B items (read as fill_prompts reads it)."""
    return _is_caa(records(path, "prompts.pairs_file"))


def _is_caa(rows: Sequence[Dict]) -> bool:
    return "question" in rows[0] and any(k in rows[0] for k in CAA_FIELDS[1:])


def _ab_items(rows: Sequence[Dict], path, field: str) -> List[ABItem]:
    q, m, n = (_column(rows, k, path, field) for k in CAA_FIELDS)
    for i, (a, b) in enumerate(zip(m, n)):
        if a.strip() == b.strip():
            raise ConfigError(field, f"{str(path)!r} item {i}: answer_matching_behavior and "
                                     f"answer_not_matching_behavior are both {a!r}; they must differ")
    return [ABItem(*x) for x in zip(q, m, n)]


def _column(rows: Sequence[Dict], key: str, path, field: str, key_field: str = "") -> List[str]:
    """Every record's `key`, each a non-empty string."""
    if key not in rows[0]:
        hint = f" (set {key_field} to one of them)" if key_field else ""
        raise ConfigError(field, f"{str(path)!r} has no field {key!r}; its fields are "
                                 f"{', '.join(map(str, sorted(rows[0])))}{hint}")
    out = []
    for i, r in enumerate(rows):
        v = r.get(key)
        if not isinstance(v, str) or not v.strip():
            raise ConfigError(field, f"{str(path)!r} item {i}: field {key!r} is "
                                     f"{'missing' if v is None else repr(v)}; expected non-empty text")
        out.append(v)
    return out


_ESCAPES = {"n": "\n", "t": "\t", "\\": "\\"}


def _unescape(line: str) -> str:
    return re.sub(r"\\([nt\\])", lambda m: _ESCAPES[m.group(1)], line.rstrip("\r"))
