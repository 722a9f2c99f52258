"""Needle-in-a-haystack cases for the retrieval task, generated deterministically from a seed.

A case is one prompt in the model's chat template: an instruction, a haystack holding the needles,
a question, and the assistant turn opened with an answer prefix ending in a space, so that the
answer's tokens are the number's digits (SmolLM2's tokenizer has one token per digit and a separate
space token, so the concatenation is the text's own tokenization).

Tasks:
- ``passkey`` (Mohtashami & Jaggi, 2023): one needle "The pass key is N. Remember it. N is the
  pass key." (5 digits); the question asks for the pass key.
- ``multikey`` (RULER's niah_multikey_1): several needles "The special magic number for <key> is:
  N." (7 digits, keys like ``amber-falcon``), one at the requested depth, the distractors at seeded
  random positions; the question asks for the one at the requested depth.

Haystacks: ``corpus`` (sentences of the bundled English corpus from a seeded offset),
``filler`` (RULER's repeated "The grass is green. The sky is blue. ..." noise), or the path of a
UTF-8 text file (its sentences from a seeded offset, for checks with other haystacks).

Depth is the target needle's position in the haystack as a percentage of its tokens (0: right after
the instruction, 100: right before the question), rounded to the nearest sentence boundary.
The requested length is the whole prompt in tokens (template, instruction, question and answer
prefix included); the haystack is filled up to it, never past it.
"""

from __future__ import annotations

import math
import random
import re
from dataclasses import dataclass, field
from functools import lru_cache
from pathlib import Path
from typing import Any, Callable, Sequence

TASKS = ("passkey", "multikey")
HAYSTACKS = ("corpus", "filler")

#: RULER's "noise" haystack (after Mohtashami & Jaggi's passkey filler)
FILLER = "The grass is green. The sky is blue. The sun is yellow. Here we go. There and back again."
#: tokens kept free after the prompt: the answer (teacher-forced) and a few generated tokens more
ANSWER_ROOM = 16
#: extra tokens greedily generated past the gold answer's length
EXTRA_TOKENS = 4
#: a corpus sentence longer than this is cut into pieces (placement granularity)
MAX_UNIT_WORDS = 40

_ADJECTIVES = (
    "amber", "brave", "calm", "dusty", "eager", "faint", "gentle", "hollow", "icy", "jolly",
    "keen", "lively", "mellow", "narrow", "odd", "pale", "quiet", "rapid", "silent", "tidy",
    "upper", "vivid", "wise", "young", "zesty", "bold", "crisp", "deep", "early", "fresh",
)
_NOUNS = (
    "falcon", "harbor", "meadow", "lantern", "river", "pebble", "orchard", "canyon", "violin",
    "garden", "glacier", "tunnel", "compass", "feather", "island", "kettle", "ladder", "marble",
    "needle", "planet", "quarry", "saddle", "thimble", "umbrella", "valley", "window", "anchor",
    "basket", "candle", "dolphin",
)


@dataclass(frozen=True)
class TaskText:
    instruction: str
    question: str
    answer_prefix: str


def task_text(task: str, key: str | None = None) -> TaskText:
    if task == "passkey":
        return TaskText(
            "There is an important info hidden inside a lot of irrelevant text. Find it and "
            "memorize it. I will quiz you about the important information there.",
            "What is the pass key?",
            "The pass key is ",
        )
    if task == "multikey":
        return TaskText(
            "Some special magic numbers are hidden within the following text. Make sure to "
            "memorize it. I will quiz you about the numbers afterwards.",
            f"What is the special magic number for {key} mentioned in the provided text?",
            f"The special magic number for {key} mentioned in the provided text is ",
        )
    raise ValueError(f"unknown retrieval task {task!r}; known: {', '.join(TASKS)}")


def needle_text(task: str, value: str, key: str | None = None) -> str:
    if task == "passkey":
        return f"The pass key is {value}. Remember it. {value} is the pass key."
    return f"The special magic number for {key} is: {value}."


@dataclass
class PromptFormat:
    """Text to token ids: ``encode`` (no special tokens added) and ``template`` (the user message
    wrapped in the chat template with the assistant turn opened)."""

    encode: Callable[[str], list[int]]
    template: Callable[[str], str]

    @classmethod
    def from_tokenizer(cls, tokenizer: Any) -> "PromptFormat":
        def encode(text: str) -> list[int]:
            return list(tokenizer(text, add_special_tokens=False).input_ids)

        def template(user: str) -> str:
            return tokenizer.apply_chat_template(
                [{"role": "user", "content": user}], tokenize=False, add_generation_prompt=True)

        return cls(encode, template)

    def prompt_ids(self, text: TaskText, context: str) -> list[int]:
        user = f"{text.instruction}\n\n{context}\n\n{text.question}"
        return self.encode(self.template(user)) + self.encode(text.answer_prefix)


@dataclass
class Case:
    task: str
    haystack: str
    length: int  # requested prompt length (tokens)
    depth: int  # requested depth of the target needle (percent)
    seed: str
    prompt_ids: list[int]
    answer: str  # the gold number
    answer_ids: list[int]
    context: str  # the haystack with its needles
    needle_offset: int  # character offset of the target needle in ``context``
    key: str | None = None
    distractors: tuple[str, ...] = field(default_factory=tuple)

    @property
    def prompt_tokens(self) -> int:
        return len(self.prompt_ids)


def prompt_budget(length: int, max_positions: int, room: int = ANSWER_ROOM) -> int:
    """The prompt length to build for a requested ``length``: the model's positions must hold
    the prompt plus ``room`` tokens of answer (0 max_positions: no limit)."""
    if length < 64:
        raise ValueError(f"retrieval prompts need >= 64 tokens, got {length}")
    if max_positions and length + room > max_positions:
        return max_positions - room
    return length


def max_new_tokens(answer_ids: Sequence[int]) -> int:
    return len(answer_ids) + EXTRA_TOKENS


# ---- haystack units ---------------------------------------------------------------------------
def _split_long(sentence: str) -> list[str]:
    words = sentence.split(" ")
    return [" ".join(words[i : i + MAX_UNIT_WORDS]) for i in range(0, len(words), MAX_UNIT_WORDS)]


def text_units(text: str) -> tuple[str, ...]:
    """Text as haystack sentences: heading rules such as ``*****`` removed, whitespace collapsed,
    long sentences cut, letterless ones dropped."""
    text = re.sub(r"\s+", " ", re.sub(r"([*=~_#-])\1{2,}", " ", text))
    units: list[str] = []
    for sentence in re.split(r"(?<=[.!?])\s+", text):
        if re.search(r"[A-Za-z]", sentence):
            units.extend(_split_long(sentence.strip()))
    return tuple(units)


@lru_cache(maxsize=1)
def corpus_units() -> tuple[str, ...]:
    """The bundled corpus as haystack sentences."""
    from turbowire.quality.corpus import load_corpus

    return text_units(load_corpus())


@lru_cache(maxsize=4)
def file_units(path: str) -> tuple[str, ...]:
    units = text_units(Path(path).read_text(encoding="utf-8"))
    if not units:
        raise ValueError(f"haystack file {path} has no sentences")
    return units


def filler_units() -> tuple[str, ...]:
    return tuple(s.strip() + "." for s in FILLER.split(".") if s.strip())


def is_haystack(kind: str) -> bool:
    """A known haystack name, or a UTF-8 text file to draw sentences from."""
    return kind in HAYSTACKS or Path(kind).is_file()


def haystack_units(kind: str, rng: random.Random) -> Callable[[int], str]:
    """Unit ``i`` of an endless haystack (corpus or a text file: from a seeded offset, wrapping
    around; filler: from its first sentence)."""
    if kind == "filler":
        units = filler_units()
        start = 0
    elif kind == "corpus" or Path(kind).is_file():
        units = corpus_units() if kind == "corpus" else file_units(kind)
        start = rng.randrange(len(units))
    else:
        raise ValueError(f"unknown haystack {kind!r}; known: {', '.join(HAYSTACKS)} or a text "
                         "file")
    return lambda i: units[(start + i) % len(units)]


# ---- placement --------------------------------------------------------------------------------
def boundary_for_depth(counts: Sequence[int], depth: int) -> int:
    """The unit boundary (0..len(counts)) whose token position is nearest ``depth`` percent of
    the haystack's tokens; ties go to the earlier boundary."""
    if not 0 <= depth <= 100:
        raise ValueError(f"depth must be within 0..100 percent, got {depth}")
    total = sum(counts)
    goal = total * depth / 100.0
    best, best_err, pos = 0, math.inf, 0
    for j in range(len(counts) + 1):
        err = abs(pos - goal)
        if err < best_err:
            best, best_err = j, err
        if j < len(counts):
            pos += counts[j]
    return best


def assemble(units: Sequence[str], inserts: dict[int, list[str]]) -> tuple[str, dict[str, int]]:
    """Join units with the needles of ``inserts[j]`` placed before unit j (j == len(units): at
    the end); returns the text and each needle's character offset in it."""
    parts: list[str] = []
    offsets: dict[str, int] = {}
    length = 0
    for j in range(len(units) + 1):
        pieces = list(inserts.get(j, []))
        if j < len(units):
            pieces.append(units[j])
        for n, piece in enumerate(pieces):
            sep = 1 if parts else 0
            if n < len(pieces) - (j < len(units)):
                offsets[piece] = length + sep
            length += len(piece) + sep
            parts.append(piece)
    return " ".join(parts), offsets


def _numbers(rng: random.Random, digits: int, count: int) -> list[str]:
    seen: set[str] = set()
    while len(seen) < count:
        seen.add(str(rng.randrange(10 ** (digits - 1), 10**digits)))
    return rng.sample(sorted(seen), count)


def _keys(rng: random.Random, count: int) -> list[str]:
    pairs = rng.sample([(a, n) for a in _ADJECTIVES for n in _NOUNS], count)
    return [f"{a}-{n}" for a, n in pairs]


def case_seed(seed: int, task: str, haystack: str, length: int, depth: int, index: int) -> str:
    return f"{seed}/{task}/{haystack}/{length}/{depth}/{index}"


def build_case(
    fmt: PromptFormat,
    task: str,
    haystack: str,
    length: int,
    depth: int,
    seed: str,
    keys: int = 4,
) -> Case:
    """One prompt of at most ``length`` tokens (and close to it) with the target needle at
    ``depth`` percent of the haystack."""
    rng = random.Random(seed)
    if task == "passkey":
        key, distractor_keys = None, []
        value, *distractor_values = _numbers(rng, 5, 1)
    elif task == "multikey":
        if keys < 1:
            raise ValueError("multikey needs >= 1 key")
        key, *distractor_keys = _keys(rng, keys)
        value, *distractor_values = _numbers(rng, 7, keys)
    else:
        raise ValueError(f"unknown retrieval task {task!r}; known: {', '.join(TASKS)}")
    text = task_text(task, key)
    target = needle_text(task, value, key)
    distractors = [needle_text(task, v, k) for k, v in zip(distractor_keys, distractor_values)]
    unit_at = haystack_units(haystack, rng)

    # fill the haystack with whole units, then with the words of one more unit
    overhead = len(fmt.prompt_ids(text, " ".join([target, *distractors])))
    budget = length - overhead
    if budget < 1:
        raise ValueError(f"a {task} prompt needs more than {length} tokens")
    units: list[str] = []
    counts: list[int] = []
    used = 0
    while True:
        unit = unit_at(len(units))
        c = len(fmt.encode(" " + unit))
        if used + c > budget:
            break
        units.append(unit)
        counts.append(c)
        used += c
    words = unit_at(len(units)).split(" ")
    lo, hi = 0, len(words)  # the most words of the next unit that still fit
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if used + len(fmt.encode(" " + " ".join(words[:mid]))) <= budget:
            lo = mid
        else:
            hi = mid - 1
    if lo:
        units.append(" ".join(words[:lo]))
        counts.append(len(fmt.encode(" " + units[-1])))

    slot = boundary_for_depth(counts, depth)
    others = [j for j in range(len(units) + 1) if j != slot] or [slot]
    inserts: dict[int, list[str]] = {slot: [target]}
    for needle in distractors:
        inserts.setdefault(rng.choice(others), []).append(needle)
    # tokens merge across joins: trim the last unit until the prompt fits
    while True:
        context, offsets = assemble(units, inserts)
        ids = fmt.prompt_ids(text, context)
        if len(ids) <= length or not units:
            break
        excess = len(ids) - length
        last = units[-1].split(" ")
        if len(last) > excess:
            units[-1] = " ".join(last[: len(last) - excess])
        else:
            units.pop()
            counts.pop()
            for j in [j for j in inserts if j > len(units)]:
                inserts.setdefault(len(units), []).extend(inserts.pop(j))
    if len(ids) > length:
        raise ValueError(f"a {task} prompt needs more than {length} tokens")
    return Case(
        task=task, haystack=haystack, length=length, depth=depth, seed=seed, prompt_ids=ids,
        answer=value, answer_ids=fmt.encode(value), context=context, needle_offset=offsets[target],
        key=key, distractors=tuple(distractor_values),
    )


# ---- scoring ----------------------------------------------------------------------------------
def extract_number(text: str) -> str | None:
    """The first run of digits in a generated answer (None when there is none)."""
    m = re.search(r"\d+", text)
    return m.group(0) if m else None


def is_correct(generated: str, gold: str) -> bool:
    """Exact retrieval: the first number in the answer is the gold number (no prefix, no
    extra digits)."""
    return extract_number(generated) == gold


def answer_complete(text: str) -> bool:
    """Generation can stop: a number has been written and something other than a digit follows."""
    return re.search(r"\d\D", text) is not None


def wilson(successes: int, n: int, z: float = 1.96) -> tuple[float, float]:
    """Wilson score interval of a binomial proportion (95% by default); (0, 1) for n == 0."""
    if n == 0:
        return 0.0, 1.0
    if not 0 <= successes <= n:
        raise ValueError(f"{successes} successes out of {n}")
    p = successes / n
    denom = 1 + z * z / n
    centre = (p + z * z / (2 * n)) / denom
    half = z * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n)) / denom
    return max(0.0, centre - half), min(1.0, centre + half)
