"""Prompt sources: random words, JSONL prompts, ShareGPT JSON, prefix repetition, timed traces.

Every source is deterministic for a given seed. Lengths are in tokens when a tokenizer is given
(``--tokenizer``, a local Hugging Face tokenizer directory; never downloaded), else estimated as the
word count (the random-word vocabulary below is ~1 token per word on mainstream BPE vocabularies).
The server's ``usage`` replaces the estimate in the metrics whenever it is reported.
"""

from __future__ import annotations

import json
import math
import random
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from .errors import DatasetError

# Common short English words: nearly every mainstream BPE/SentencePiece vocabulary
# encodes " word" as one token, so N words ~= N prompt tokens. The server's `usage`
# reports the exact count, which is what the metrics use when available.
WORDS: tuple[str, ...] = tuple(
    """
    the of and to in is was for on are with as his they be at one have this from
    or had by word but what some we can out other were all there when up use your
    how said an each she which do their time if will way about many then them write
    would like so these her long make thing see him two has look more day could go
    come did number sound no most people my over know water than call first who may
    down side been now find any new work part take get place made live where after
    back little only round man year came show every good me give our under name very
    through just form sentence great think say help low line differ turn cause much
    mean before move right boy old too same tell does set three want air well also
    play small end put home read hand port large spell add even land here must big
    high such follow act why ask men change went light kind off need house picture
    try us again animal point mother world near build self earth father head stand
    own page should country found answer school grow study still learn plant cover
    food sun four between state keep eye never last let thought city tree cross farm
    hard start might story saw far sea draw left late run while press close night
    real life few north open seem together next white children begin got walk
    example ease paper group always music those both mark often letter until mile
    river car feet care second book carry took science eat room friend began idea
    fish mountain stop once base hear horse cut sure watch color face wood main
    """.split()
)


@dataclass(frozen=True)
class RequestInput:
    """One prompt to send.

    ``prompt_len`` is an estimate in tokens (word count); the server's ``usage``
    overrides it when reported. ``output_len`` is the ``max_tokens`` to request.
    """

    prompt: str
    prompt_len: int
    output_len: int


def _len_range(center: int, ratio: float) -> tuple[int, int]:
    """Inclusive [lo, hi] around ``center`` (tokens), never below 1, as ``vllm bench`` does."""
    lo = max(1, math.floor(center * (1 - ratio)))
    hi = max(lo, math.ceil(center * (1 + ratio)))
    return lo, hi


def random_requests(n: int, input_len: int, output_len: int, range_ratio: float = 0.0, seed: int = 0) -> list[RequestInput]:
    """``n`` synthetic prompts of ~``input_len`` tokens asking for ``output_len`` tokens.

    With ``range_ratio`` r each length is drawn uniformly from [L*(1-r), L*(1+r)].
    Deterministic for a given ``seed``.
    """
    rng = random.Random(seed)
    in_lo, in_hi = _len_range(input_len, range_ratio)
    out_lo, out_hi = _len_range(output_len, range_ratio)
    out: list[RequestInput] = []
    for _ in range(n):
        n_in = rng.randint(in_lo, in_hi)
        n_out = rng.randint(out_lo, out_hi)
        prompt = " ".join(rng.choice(WORDS) for _ in range(n_in))
        out.append(RequestInput(prompt=prompt, prompt_len=n_in, output_len=n_out))
    return out


def load_jsonl(path: str | Path, default_output_len: int) -> list[RequestInput]:
    """Read ``{"prompt": str, "output_len": int (optional)}`` objects, one per line.

    Blank lines are skipped. Any problem raises :class:`DatasetError` with a one-line
    message naming the file and line number.
    """
    p = Path(path)
    where = f"bad dataset file {p}"
    items: list[RequestInput] = []
    for lineno, obj in _jsonl_objects(p, where):
        prompt = obj.get("prompt")
        if not isinstance(prompt, str) or not prompt:
            raise DatasetError(f"{where}: line {lineno}: 'prompt' must be a non-empty string")
        out_len = obj.get("output_len", default_output_len)
        if not _pos_int(out_len):
            raise DatasetError(f"{where}: line {lineno}: 'output_len' must be an integer >= 1")
        items.append(RequestInput(prompt=prompt, prompt_len=len(prompt.split()), output_len=out_len))
    if not items:
        raise DatasetError(f"{where}: no prompts found")
    return items


def load_tokenizer(path: str | None) -> Callable[[str], int] | None:
    """Token counter from a local Hugging Face tokenizer directory (offline; None if no path).

    Raises :class:`DatasetError` (one line) when the directory cannot be loaded.
    """
    if not path:
        return None
    try:
        from transformers import AutoTokenizer  # optional: only needed with --tokenizer

        tok = AutoTokenizer.from_pretrained(path, local_files_only=True)
    except Exception as e:  # ImportError, OSError, ValueError: all mean "cannot use this tokenizer"
        raise DatasetError(f"cannot load tokenizer {path!r}: {' '.join(str(e).split())[:200]}") from None
    return lambda text: len(tok(text).input_ids)


def _words(text: str) -> int:
    return len(text.split())


def _read_text(p: Path, where: str) -> str:
    try:
        return p.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as e:
        raise DatasetError(f"{where}: {type(e).__name__}: {e}".replace("\n", " ")) from None


def _jsonl_objects(p: Path, where: str) -> Iterator[tuple[int, dict[str, Any]]]:
    """``(line number, object)`` for each non-blank line; one-line :class:`DatasetError` otherwise."""
    yield from jsonl_objects(_read_text(p, where), where)


def jsonl_objects(text: str, where: str, error: type[Exception] = DatasetError) -> Iterator[tuple[int, dict[str, Any]]]:
    """``(line number, object)`` for each non-blank line of JSON-lines ``text``; a line that is not
    a JSON object raises ``error`` with one line naming ``where`` and the line number (shared
    with ``vllm-powersave tune-serving``'s trace reader)."""
    for lineno, line in enumerate(text.splitlines(), start=1):
        if not line.strip():
            continue
        try:
            obj = json.loads(line)
        except json.JSONDecodeError as e:
            raise error(f"{where}: line {lineno}: invalid JSON ({e.msg})") from None
        if not isinstance(obj, dict):
            raise error(f"{where}: line {lineno}: expected a JSON object")
        yield lineno, obj


def is_valid_sequence(
    prompt_len: int,
    output_len: int,
    *,
    min_len: int = 4,
    max_prompt_len: int = 1024,
    max_total_len: int = 2048,
    skip_min_output_len_check: bool = False,
) -> bool:
    """ShareGPT pruning rule of ``vllm bench serve`` (vllm/benchmarks/datasets/datasets.py, 0.32).

    A pair is kept if prompt >= 4 tokens, output >= 4 tokens (unless the output length is fixed),
    prompt <= 1024 tokens and prompt + output <= 2048 tokens.
    """
    return not (
        prompt_len < min_len
        or (not skip_min_output_len_check and output_len < min_len)
        or prompt_len > max_prompt_len
        or prompt_len + output_len > max_total_len
    )


def load_sharegpt(
    path: str | Path, n: int, *, seed: int = 0, output_len: int | None = None, count: Callable[[str], int] | None = None
) -> list[RequestInput]:
    """``n`` requests from a ShareGPT-format JSON file, sampled as ``vllm bench serve`` does.

    The file is a JSON list of ``{"conversations": [{"from": "human", "value": str},
    {"from": "gpt", "value": str}, ...]}``. Entries with fewer than two turns are dropped, the rest
    shuffled with ``random.Random(seed)`` (the same order as vLLM's ``random.seed(seed);
    random.shuffle``), turn 0 is the prompt and turn 1's length the output length (unless
    ``output_len`` fixes it), and pairs failing :func:`is_valid_sequence` are skipped. Lengths use
    ``count`` (a tokenizer) or the word count. Fewer valid pairs than ``n`` are cycled.

    Raises :class:`DatasetError` (one line) for an unreadable file, a non-list, or no usable pair.
    """
    p = Path(path)
    where = f"bad dataset file {p}"
    try:
        data = json.loads(_read_text(p, where))
    except json.JSONDecodeError as e:
        raise DatasetError(f"{where}: invalid JSON ({e.msg} at line {e.lineno})") from None
    if not isinstance(data, list):
        raise DatasetError(f"{where}: expected a JSON list of ShareGPT entries, got {type(data).__name__}")
    entries = [e for e in data if isinstance(e, dict) and isinstance(e.get("conversations"), list) and len(e["conversations"]) >= 2]
    random.Random(seed).shuffle(entries)
    cnt = count or _words
    items: list[RequestInput] = []
    for e in entries:
        if len(items) >= n:
            break
        t0, t1 = e["conversations"][0], e["conversations"][1]
        prompt = t0.get("value") if isinstance(t0, dict) else None
        completion = t1.get("value") if isinstance(t1, dict) else None
        if not isinstance(prompt, str) or not isinstance(completion, str) or not prompt:
            continue
        p_len = cnt(prompt)
        o_len = cnt(completion) if output_len is None else output_len
        if not is_valid_sequence(p_len, o_len, skip_min_output_len_check=output_len is not None):
            continue
        items.append(RequestInput(prompt=prompt, prompt_len=p_len, output_len=o_len))
    if not items:
        raise DatasetError(
            f"{where}: no usable conversation (need >= 2 turns with string values; prompt 4..1024 tokens, output >= 4, total <= 2048)"
        )
    return [items[i % len(items)] for i in range(n)]


def prefix_repetition_requests(
    n: int, prefix_len: int, suffix_len: int, num_prefixes: int, output_len: int, seed: int = 0
) -> list[RequestInput]:
    """``n`` prompts in ``num_prefixes`` groups sharing a ``prefix_len``-token prefix (prefix caching).

    As ``vllm bench serve --dataset-name prefix_repetition``: group g has ``n // num_prefixes``
    prompts, each ``prefix_g + random suffix of suffix_len``, groups in order; the ``n % num_prefixes``
    remainder cycles from the start (vLLM oversamples). Deterministic for ``seed``.

    Raises :class:`DatasetError` when ``num_prefixes`` > ``n`` or a length is < 1.
    """
    if num_prefixes < 1 or prefix_len < 1 or suffix_len < 1:
        raise DatasetError(
            f"prefix repetition needs num_prefixes, prefix_len and input_len >= 1 (got {num_prefixes}, {prefix_len}, {suffix_len})"
        )
    per = n // num_prefixes
    if per == 0:
        raise DatasetError(f"prefix repetition: num_prompts ({n}) must be >= num_prefixes ({num_prefixes})")
    rng = random.Random(seed)
    items: list[RequestInput] = []
    for _ in range(num_prefixes):
        prefix = " ".join(rng.choice(WORDS) for _ in range(prefix_len))
        for _ in range(per):
            suffix = " ".join(rng.choice(WORDS) for _ in range(suffix_len))
            items.append(RequestInput(prompt=f"{prefix} {suffix}", prompt_len=prefix_len + suffix_len, output_len=output_len))
    return [items[i % len(items)] for i in range(n)]


def _pos_int(v: object) -> bool:
    # bool is an int subclass; reject it so `true` is not read as 1 token.
    return isinstance(v, int) and not isinstance(v, bool) and v >= 1


def load_trace(
    path: str | Path, default_output_len: int, *, seed: int = 0, time_scale: float = 1.0
) -> tuple[list[float], list[RequestInput]]:
    """Timed trace: ``(send offsets in s, requests)`` from a JSONL file, sorted by time.

    Each line: ``{"timestamp": seconds, "prompt": str}`` or ``{"timestamp": s, "input_len": tokens}``
    (a seeded random-word prompt of that length), optional ``"output_len"`` (else
    ``default_output_len``). Offsets are ``(timestamp - first timestamp) * time_scale``.

    Raises :class:`DatasetError` naming the file and line for any malformed entry.
    """
    p = Path(path)
    where = f"bad trace file {p}"
    rows: list[tuple[float, int, RequestInput]] = []
    for lineno, obj in _jsonl_objects(p, where):
        ts = obj.get("timestamp")
        if isinstance(ts, bool) or not isinstance(ts, (int, float)) or not math.isfinite(ts) or ts < 0:
            raise DatasetError(f"{where}: line {lineno}: 'timestamp' must be a number of seconds >= 0, got {ts!r}")
        out_len = obj.get("output_len", default_output_len)
        if not _pos_int(out_len):
            raise DatasetError(f"{where}: line {lineno}: 'output_len' must be an integer >= 1, got {out_len!r}")
        prompt = obj.get("prompt")
        if prompt is not None:
            if not isinstance(prompt, str) or not prompt:
                raise DatasetError(f"{where}: line {lineno}: 'prompt' must be a non-empty string")
            req = RequestInput(prompt=prompt, prompt_len=_words(prompt), output_len=out_len)
        else:
            n_in = obj.get("input_len")
            if not _pos_int(n_in):
                raise DatasetError(f"{where}: line {lineno}: need 'prompt' (string) or 'input_len' (integer >= 1)")
            rng = random.Random(f"{seed}:{lineno}")
            req = RequestInput(prompt=" ".join(rng.choice(WORDS) for _ in range(n_in)), prompt_len=n_in, output_len=out_len)
        rows.append((float(ts), lineno, req))
    if not rows:
        raise DatasetError(f"{where}: no requests found")
    rows.sort(key=lambda r: (r[0], r[1]))
    t0 = rows[0][0]
    return [(t - t0) * time_scale for t, _, _ in rows], [r for _, _, r in rows]


def sample_requests(
    spec: str,
    n: int,
    *,
    input_len: int,
    output_len: int,
    range_ratio: float = 0.0,
    seed: int = 0,
    prefix_len: int = 256,
    num_prefixes: int = 10,
    sharegpt_output_len: int | None = None,
    tokenizer: str | None = None,
) -> list[RequestInput]:
    """Return exactly ``n`` requests from ``spec``.

    ``random``, ``jsonl:PATH`` (cycled in file order when shorter than ``n``), ``sharegpt:PATH``
    (:func:`load_sharegpt`) or ``prefix-repetition`` (:func:`prefix_repetition_requests` with a
    suffix of ``input_len`` tokens). Raises :class:`DatasetError` with a one-line message.
    """
    if spec == "random":
        return random_requests(n, input_len, output_len, range_ratio, seed)
    if spec == "prefix-repetition":
        return prefix_repetition_requests(n, prefix_len, input_len, num_prefixes, output_len, seed)
    if spec.startswith("jsonl:"):
        items = load_jsonl(spec[len("jsonl:") :], output_len)
        return [items[i % len(items)] for i in range(n)]
    if spec.startswith("sharegpt:"):
        return load_sharegpt(spec[len("sharegpt:") :], n, seed=seed, output_len=sharegpt_output_len, count=load_tokenizer(tokenizer))
    raise DatasetError(f"unknown dataset {spec!r}: expected 'random', 'prefix-repetition', 'jsonl:PATH' or 'sharegpt:PATH'")
