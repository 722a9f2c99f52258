"""Long-context retrieval through a KV codec: passkey and multi-key needles (``eval --task
retrieval``), in the P/D handoff scenario.

Per case (one prompt of ``needles.build_case``): the prefill side computes the prompt's KV once
(fp32 compute, K/V rounded to bf16 as a vLLM cache holds them); every method replaces it with its
reconstruction; the decode side then computes the prompt's last token against that KV (as vLLM's
decode engine does after a full remote hit) and writes the answer. The exact KV is the reference.

Per method and case:
- retrieval: greedy decoding of up to ``len(answer) + 4`` tokens, correct when the first number
  written is the gold number. Greedy steps are read off the teacher-forced pass while they agree
  with the gold answer, then decoded one token at a time (same result, fewer forward passes);
- answer NLL: the mean negative log-likelihood of the gold answer's tokens, teacher-forced;
- answer KL: KL(exact || method) of the next-token distributions at those positions, averaged.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field
from typing import Callable, Sequence

import torch

from turbowire.quality.harness import (
    KV,
    ModelUnderTest,
    apply_method,
    kv_cache,
    prefill_kv,
    recomputed_tail,
)
from turbowire.quality.methods import KVMethod, RecomputedTailMethod
from turbowire.quality.needles import (
    HAYSTACKS,
    TASKS,
    PromptFormat,
    answer_complete,
    build_case,
    case_seed,
    extract_number,
    is_haystack,
    max_new_tokens,
    prompt_budget,
    wilson,
)

REFERENCE = "bf16 (reference)"


@dataclass
class RetrievalConfig:
    lengths: Sequence[int] = (1024, 2048, 4096, 8192)
    depths: Sequence[int] = (0, 25, 50, 75, 100)
    cases: int = 2
    tasks: Sequence[str] = TASKS
    haystacks: Sequence[str] = HAYSTACKS
    keys: int = 4
    seed: int = 0
    threads: int = 2

    def __post_init__(self) -> None:
        if self.cases < 1:
            raise ValueError("cases must be >= 1")
        if not self.lengths or not self.depths:
            raise ValueError("at least one length and one depth")
        if any(not 0 <= d <= 100 for d in self.depths):
            raise ValueError("depths are percentages within 0..100")
        if unknown := set(self.tasks) - set(TASKS):
            raise ValueError(f"unknown tasks {sorted(unknown)}; known: {', '.join(TASKS)}")
        if unknown := [h for h in self.haystacks if not is_haystack(h)]:
            raise ValueError(f"unknown haystacks {unknown}; known: {', '.join(HAYSTACKS)} or "
                             "the path of a text file")
        if not self.tasks or not self.haystacks:
            raise ValueError("at least one task and one haystack")

    def grid(self) -> list[tuple[str, str, int, int, int]]:
        """(task, haystack, length, depth, index) of every case; haystacks rotate over depths and
        cases so that one case per cell still covers every haystack at every length."""
        out = []
        for length in self.lengths:
            for ti, task in enumerate(self.tasks):
                for di, depth in enumerate(self.depths):
                    for c in range(self.cases):
                        haystack = self.haystacks[(ti + di + c) % len(self.haystacks)]
                        out.append((task, haystack, length, depth, c))
        return out


@dataclass
class CaseResult:
    """One method on one case."""

    method: str
    family: str
    task: str
    haystack: str
    length: int  # requested
    prompt_tokens: int
    depth: int
    seed: str
    answer: str
    generated: str
    correct: bool
    nll: float  # mean over answer tokens
    kl: float  # mean over answer tokens; 0 for the reference
    wire_bytes: int
    dense_elements: int


@dataclass
class Summary:
    """A group of case results of one method (a length, a depth, a task, or all of them)."""

    method: str
    family: str
    n: int
    correct: int
    nll: float
    ref_nll: float
    kl: float
    kl_ci95: float
    bits_per_element: float
    prompt_tokens: float
    #: per case answer NLL of the method and of the reference on the same case (paired)
    pairs: tuple[tuple[float, float], ...] = field(default=(), repr=False)

    @property
    def accuracy(self) -> float:
        return self.correct / self.n if self.n else float("nan")

    @property
    def ci(self) -> tuple[float, float]:
        return wilson(self.correct, self.n)

    @property
    def nll_ratio(self) -> float:
        return self.nll / self.ref_nll if self.ref_nll > 0 else float("nan")

    @property
    def nll_ratio_ci(self) -> tuple[float, float]:
        """Paired bootstrap 95% interval of the answer NLL ratio."""
        return ratio_ci([a for a, _ in self.pairs], [b for _, b in self.pairs])


def ratio_ci(values: Sequence[float], refs: Sequence[float], resamples: int = 2000,
             seed: int = 0) -> tuple[float, float]:
    """Paired bootstrap 95% interval of mean(values) / mean(refs) over cases (percentiles;
    seeded, so a run's report is reproducible)."""
    n = len(values)
    if n < 2 or len(refs) != n:
        return math.nan, math.nan
    gen = torch.Generator().manual_seed(seed)
    idx = torch.randint(n, (resamples, n), generator=gen)
    num = torch.tensor(values, dtype=torch.float64)[idx].sum(1)
    den = torch.tensor(refs, dtype=torch.float64)[idx].sum(1)
    ratios = (num / den)[den > 0]
    if ratios.numel() == 0:
        return math.nan, math.nan
    lo, hi = torch.quantile(ratios, torch.tensor([0.025, 0.975], dtype=torch.float64)).tolist()
    return lo, hi


@dataclass
class RetrievalRun:
    model: str
    config: RetrievalConfig
    results: list[CaseResult] = field(default_factory=list)

    def methods(self) -> list[tuple[str, str]]:
        seen: dict[str, str] = {}
        for r in self.results:
            seen.setdefault(r.method, r.family)
        return list(seen.items())

    def summarize(self, method: str, **where: object) -> Summary:
        """The results of ``method`` whose fields equal ``where`` (e.g. length=1024, depth=50),
        with the reference's answer NLL over the same cases."""
        rows = [r for r in self.results if r.method == method
                and all(getattr(r, k) == v for k, v in where.items())]
        refs = {(r.seed, r.task): r for r in self.results if r.method == REFERENCE
                and all(getattr(r, k) == v for k, v in where.items())}
        n = len(rows)
        if n == 0:
            return Summary(method, "", 0, 0, math.nan, math.nan, math.nan, math.nan, math.nan, 0)
        kl = [r.kl for r in rows]
        kl_mean = sum(kl) / n
        kl_ci = (1.96 * math.sqrt(sum((x - kl_mean) ** 2 for x in kl) / (n - 1) / n)
                 if n > 1 else math.nan)
        matched = [refs[(r.seed, r.task)].nll for r in rows if (r.seed, r.task) in refs]
        paired = len(matched) == n
        return Summary(
            method=method, family=rows[0].family, n=n, correct=sum(r.correct for r in rows),
            nll=sum(r.nll for r in rows) / n,
            ref_nll=sum(matched) / n if paired else math.nan,
            kl=kl_mean, kl_ci95=kl_ci,
            bits_per_element=sum(r.wire_bytes for r in rows) * 8
            / max(sum(r.dense_elements for r in rows), 1),
            prompt_tokens=sum(r.prompt_tokens for r in rows) / n,
            pairs=tuple(zip((r.nll for r in rows), matched)) if paired else (),
        )

    def to_json(self) -> dict:
        return {"model": self.model, "config": asdict(self.config),
                "results": [asdict(r) for r in self.results]}

    @classmethod
    def from_json(cls, data: dict) -> "RetrievalRun":
        """The run :meth:`to_json` wrote (no checks of its config: a haystack file named there
        need not exist any more)."""
        config = object.__new__(RetrievalConfig)
        config.__dict__.update(data["config"])
        return cls(data["model"], config, [CaseResult(**r) for r in data["results"]])


@dataclass
class AnswerPass:
    logprobs: torch.Tensor  # [len(answer) + 1, vocab]: position i predicts answer token i
    generated: list[int]


def answer_pass(
    mut: ModelUnderTest, kv: KV, last: int, answer: Sequence[int], max_new: int, stop: set[int],
    decode: Callable[[list[int]], str],
) -> AnswerPass:
    """The decode side: the prompt's last token and the teacher-forced answer against ``kv``,
    then greedy decoding from the first position where greedy leaves the gold answer."""
    cache = kv_cache(kv)
    inputs = torch.tensor([[last, *answer]])
    logprobs = torch.log_softmax(
        mut.model(inputs, past_key_values=cache).logits[0].to(torch.float32), dim=-1)
    greedy = logprobs.argmax(-1).tolist()
    agree = 0
    while agree < len(answer) and greedy[agree] == answer[agree]:
        agree += 1
    generated = list(answer[:agree]) + [greedy[agree]]
    if agree < len(answer):  # drop the gold tokens past the agreement from the cache
        cache.crop(agree - len(answer))
    while (len(generated) < max_new and generated[-1] not in stop
           and not answer_complete(decode(generated))):
        logits = mut.model(torch.tensor([[generated[-1]]]), past_key_values=cache).logits
        generated.append(int(logits[0, -1].argmax()))
    return AnswerPass(logprobs, generated)


@torch.inference_mode()
def evaluate_retrieval(
    methods: Sequence[KVMethod],
    config: RetrievalConfig,
    mut: ModelUnderTest | None = None,
    progress: Callable[[str, int, int], None] | None = None,
) -> RetrievalRun:
    """Every case of ``config.grid()`` with the exact KV and every method."""
    torch.set_num_threads(config.threads)
    mut = mut or ModelUnderTest()
    fmt = PromptFormat.from_tokenizer(mut.tokenizer)
    tok = mut.tokenizer
    stop = {t for t in (tok.eos_token_id, tok.convert_tokens_to_ids("<|im_end|>"))
            if isinstance(t, int) and t >= 0}

    def decode(ids: list[int]) -> str:
        return tok.decode(ids, skip_special_tokens=True)

    run = RetrievalRun(mut.name, config)
    grid = config.grid()
    total = len(grid) * (len(methods) + 3)  # the prefill counts as two steps
    done = 0
    for task, haystack, length, depth, index in grid:
        budget = prompt_budget(length, mut.max_positions)
        case = build_case(fmt, task, haystack, budget, depth,
                          case_seed(config.seed, task, haystack, length, depth, index),
                          keys=config.keys)
        label = f"{task} {haystack} {length} d={depth}%"
        if progress:
            progress(f"{label}: prefill", done, total)
        prompt = torch.tensor(case.prompt_ids)
        layers = prefill_kv(mut, prompt[:-1])
        dense = sum(k.numel() + v.numel() for k, v in layers)
        done += 2
        max_new = max_new_tokens(case.answer_ids)
        targets = torch.tensor(case.answer_ids)

        def score(name: str, family: str, kv: KV, nbytes: int,
                  ref: torch.Tensor | None) -> torch.Tensor:
            out = answer_pass(mut, kv, case.prompt_ids[-1], case.answer_ids, max_new, stop,
                              decode)
            lp = out.logprobs[:-1]
            nll = float(-lp.gather(1, targets[:, None]).mean())
            kl = 0.0 if ref is None else float((ref.exp() * (ref - lp)).sum(-1).mean())
            text = decode(out.generated)
            run.results.append(CaseResult(
                method=name, family=family, task=task, haystack=haystack, length=length,
                prompt_tokens=case.prompt_tokens, depth=depth, seed=case.seed,
                answer=case.answer, generated=text,
                correct=extract_number(text) == case.answer, nll=nll, kl=kl,
                wire_bytes=nbytes, dense_elements=dense))
            return lp

        ref = score(REFERENCE, "reference", layers, dense * 2, None)
        done += 1
        for method in methods:
            if progress:
                progress(f"{label}: {method.name}", done, total)
            if isinstance(method, RecomputedTailMethod):
                # the last prompt token is the answer pass's first input, so the last but one
                # of the recomputed tail
                recon, nbytes = recomputed_tail(mut, method, layers, prompt[:-1], later=1)
            else:
                recon, nbytes = apply_method(method, layers)
            score(method.name, method.family, recon, nbytes, ref)
            done += 1
        if progress:
            progress(label, done, total)
    return run
