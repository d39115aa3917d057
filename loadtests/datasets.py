"""Prompt sources: synthetic random-word prompts and JSONL files."""

from __future__ import annotations

import json
import math
import random
from dataclasses import dataclass
from pathlib import Path

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


def random_requests(
    n: int, input_len: int, output_len: int, range_ratio: float = 0.0, seed: int = 0
) -> list[RequestInput]:
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
    try:
        text = p.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as e:
        raise DatasetError(f"{where}: {type(e).__name__}: {e}".replace("\n", " ")) from None
    items: list[RequestInput] = []
    for lineno, line in enumerate(text.splitlines(), start=1):
        if not line.strip():
            continue
        try:
            obj = json.loads(line)
        except json.JSONDecodeError as e:
            raise DatasetError(f"{where}: line {lineno}: invalid JSON ({e.msg})") from None
        if not isinstance(obj, dict):
            raise DatasetError(f"{where}: line {lineno}: expected a JSON object")
        prompt = obj.get("prompt")
        if not isinstance(prompt, str) or not prompt:
            raise DatasetError(f"{where}: line {lineno}: 'prompt' must be a non-empty string")
        out_len = obj.get("output_len", default_output_len)
        # bool is an int subclass; reject it so `true` is not read as 1 token.
        if not isinstance(out_len, int) or isinstance(out_len, bool) or out_len < 1:
            raise DatasetError(f"{where}: line {lineno}: 'output_len' must be an integer >= 1")
        items.append(RequestInput(prompt=prompt, prompt_len=len(prompt.split()), output_len=out_len))
    if not items:
        raise DatasetError(f"{where}: no prompts found")
    return items


def sample_requests(
    spec: str,
    n: int,
    *,
    input_len: int,
    output_len: int,
    range_ratio: float = 0.0,
    seed: int = 0,
) -> list[RequestInput]:
    """Return exactly ``n`` requests from ``spec`` (``random`` or ``jsonl:PATH``).

    A JSONL file shorter than ``n`` is cycled in file order.
    """
    if spec == "random":
        return random_requests(n, input_len, output_len, range_ratio, seed)
    if spec.startswith("jsonl:"):
        items = load_jsonl(spec[len("jsonl:") :], output_len)
        return [items[i % len(items)] for i in range(n)]
    raise DatasetError(f"unknown dataset {spec!r}: expected 'random' or 'jsonl:PATH'")
