"""Evaluation scores from scratch, defined exactly as lm-evaluation-harness defines them.

Three kinds of score, one per way of asking a model:

- Likelihood of text (`heldout`): the summed log-probability of held-out documents, each scored
  on its own after one prefix token, as lm-eval's `loglikelihood_rolling` does; reported as
  nats per token, perplexity exp(nats/token) and bits per byte, nats/token x tokens/byte / ln 2
  (`pretrain.loss`'s formulas): per byte, models with different tokenizers compare.
- Multiple choice by log-likelihood (`multiple_choice`): each choice's continuation is scored
  after the context; the prediction is the choice of highest summed log-probability (`acc`),
  of highest log-probability per character of the choice string (`acc_norm`) or per UTF-8 byte
  (`acc_bytes`). The lengths are of the choice strings without the target delimiter, as
  lm-eval's `ConfigurableTask.process_results` takes them; a choice's log-likelihood includes
  the delimiter. `acc_norm` undoes the bias of summed log-probabilities towards short answers.
- Generation with a verifier (`sample_counts`, `pass_at_k`): n samples per item at a
  temperature, each checked by `task.verify`; pass@k is the chance that at least one of k
  samples is right, estimated without bias from n >= k samples by Chen et al. (2021)'s
  1 - C(n-c, k)/C(n, k), computed as a product that never forms a large binomial.

Every score is a mean over items; how noisy it is, is `eval_noise`'s subject.

Chapter: book/alignment/evaluation
"""

from __future__ import annotations

import math
import random
import re
import statistics
from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import nn

from ..pretrain.loss import bits_per_byte, perplexity
from . import policy, task
from .eval_noise import mean_stderr, wilson
from .task import _whole

# lm-evaluation-harness conventions this module follows; tests/test_evaluation.py asserts each
# against the installed lm_eval, so an upgrade that changes one fails a test.
LM_EVAL_TARGET_DELIMITER = " "  # ConfigurableTask's default between context and a choice
LM_EVAL_NORMALISED = {"acc": None, "acc_norm": "chars", "acc_bytes": "bytes"}
FORMS = ("raw", "chat")  # the pretraining form `\n07+58=` or the chat template


@dataclass(frozen=True)
class MCItem:
    """A multiple-choice item: the context, the choice strings and the index of the right one."""

    context: str
    choices: tuple[str, ...]
    gold: int

    def __post_init__(self):
        if not isinstance(self.context, str) or not self.context:
            raise ValueError("an MCItem needs a non-empty context string")
        if len(self.choices) < 2 or not all(isinstance(c, str) and c for c in self.choices):
            raise ValueError(f"an MCItem needs two or more non-empty choices, got "
                             f"{self.choices!r}")
        if not (isinstance(self.gold, int) and 0 <= self.gold < len(self.choices)):
            raise ValueError(f"gold {self.gold!r} is not an index into {len(self.choices)} "
                             "choices")


def raw_context(item: task.Problem) -> str:
    """The base model's form of a question: a line start, then `07+58=` (as in its corpus)."""
    return "\n" + item.prompt + "="


def distractors(answer: int, k: int, rng: random.Random) -> list[int]:
    """k wrong sums a model might prefer: off by one or ten, a carry dropped or added, a digit
    dropped or doubled. Their lengths differ from the answer's, so acc and acc_norm can differ."""
    pool = {answer + 1, answer - 1, answer + 10, answer - 10, answer + 100, answer // 10,
            answer * 10 + answer % 10, answer - 100}
    pool = sorted(x for x in pool if x >= 0 and x != answer)
    if len(pool) < k:
        raise ValueError(f"only {len(pool)} distractors for {answer}; ask for fewer choices")
    return rng.sample(pool, k)


def arithmetic_mc(items: Sequence[task.Problem], n_choices: int = 4, seed: int = 0,
                  end: str = "") -> list[MCItem]:
    """Multiple-choice items from task problems in the raw form: the right sum among
    n_choices - 1 distractors, in a seeded order, each choice followed by `end`. With
    end="" a distractor that is a prefix of the answer ("6" for 65) always scores at least as
    high as the answer under acc; end="\n" makes each choice say where the answer stops."""
    if not items:
        raise ValueError("no problems to make items from")
    if not isinstance(end, str):
        raise ValueError(f"end must be a string, got {end!r}")
    if isinstance(n_choices, bool) or not isinstance(n_choices, int) or not 2 <= n_choices <= 9:
        raise ValueError(f"n_choices must be a whole number in 2..9, got {n_choices!r}")
    rng = random.Random(seed)
    out = []
    for p in items:
        answer = int(p.answer)
        options = [answer] + distractors(answer, n_choices - 1, rng)
        rng.shuffle(options)
        out.append(MCItem(raw_context(p), tuple(f"{o}{end}" for o in options),
                          options.index(answer)))
    return out


def _encode(tok, text: str) -> list[int]:
    if not hasattr(tok, "encode"):
        raise ValueError(f"tok must be a tokenizer with encode(), got {type(tok).__name__}")
    return list(tok.encode(text))


@torch.no_grad()
def continuation_logprobs(model: nn.Module, contexts: Sequence[Sequence[int]],
                          continuations: Sequence[Sequence[int]], batch_size: int = 64
                          ) -> tuple[list[float], list[bool]]:
    """Summed log p(continuation | context) of each pair, and whether greedy decoding would
    produce the continuation (every token the argmax): lm-eval's (loglikelihood, is_greedy)."""
    if len(contexts) != len(continuations) or not contexts:
        raise ValueError("give as many contexts as continuations, at least one")
    if any(len(c) == 0 for c in contexts) or any(len(c) == 0 for c in continuations):
        raise ValueError("contexts and continuations must not be empty (lm-eval puts a prefix "
                         "token before an empty context)")
    _whole("batch_size", batch_size, 1)
    was = model.training
    model.eval()
    device = next(model.parameters()).device
    lls: list[float] = []
    greedy: list[bool] = []
    for s in range(0, len(contexts), batch_size):
        ctx, cont = contexts[s:s + batch_size], continuations[s:s + batch_size]
        seqs = [list(a) + list(b) for a, b in zip(ctx, cont)]
        masks = [[0] * len(a) + [1] * len(b) for a, b in zip(ctx, cont)]
        ids, mask = policy.pad(seqs, masks)
        ids, mask = ids.to(device), mask.to(device)
        logits = policy.logits_of(model, ids)[:, :-1]
        lp = torch.log_softmax(logits, -1).gather(2, ids[:, 1:, None]).squeeze(2)
        target = mask[:, 1:].bool()
        lls += (lp * target).sum(-1).tolist()
        hit = (logits.argmax(-1) == ids[:, 1:]) | ~target
        greedy += hit.all(-1).tolist()
    model.train(was)
    return lls, greedy


def predictions(lls: Sequence[float], choices: Sequence[str]) -> dict[str, int]:
    """The predicted choice under each rule of LM_EVAL_NORMALISED (first index on ties, as
    numpy's argmax)."""
    if len(lls) != len(choices) or not choices:
        raise ValueError("give one log-likelihood per choice")
    size = {"chars": len, "bytes": lambda c: len(c.encode("utf-8"))}
    out = {}
    for name, unit in LM_EVAL_NORMALISED.items():
        scores = [ll / (size[unit](c) if unit else 1) for ll, c in zip(lls, choices)]
        out[name] = max(range(len(scores)), key=lambda i: (scores[i], -i))
    return out


@dataclass
class MCResult:
    """Per-item log-likelihoods and scores of a multiple-choice evaluation, and their means."""

    lls: list[list[float]]
    scores: dict[str, list[float]]  # metric -> 1.0/0.0 per item

    def mean(self, metric: str) -> float:
        return statistics.fmean(self.scores[metric])

    def stderr(self, metric: str) -> float:
        return mean_stderr(self.scores[metric])

    def summary(self) -> dict[str, float]:
        out = {}
        for m in self.scores:
            out[m], out[m + "_stderr"] = self.mean(m), self.stderr(m)
        return out


def multiple_choice(model: nn.Module, tok: task.ChatTokenizer, items: Sequence[MCItem],
                    delimiter: str = "", batch_size: int = 64) -> MCResult:
    """Score MC items by log-likelihood: context, then delimiter + choice, per choice. Tokens
    as lm-eval's causal models take them: the whole string is encoded and the context's tokens
    cut off its front (the same split for a byte-level tokenizer; for BPE, merges across the
    boundary stay with the continuation)."""
    if not items or not all(isinstance(i, MCItem) for i in items):
        raise ValueError("items must be a non-empty list of MCItem")
    ctxs, conts = [], []
    for it in items:
        c = _encode(tok, it.context)
        for choice in it.choices:
            whole = _encode(tok, it.context + delimiter + choice)
            ctxs.append(c)
            conts.append(whole[len(c):])
    flat, _ = continuation_logprobs(model, ctxs, conts, batch_size)
    lls, scores = [], {m: [] for m in LM_EVAL_NORMALISED}
    at = 0
    for it in items:
        ll = flat[at:at + len(it.choices)]
        at += len(it.choices)
        lls.append(ll)
        for m, pred in predictions(ll, it.choices).items():
            scores[m].append(float(pred == it.gold))
    return MCResult(lls, scores)


@torch.no_grad()
def heldout(model: nn.Module, tok: task.ChatTokenizer, texts: Sequence[str],
            prefix_id: int) -> dict[str, float]:
    """Log-likelihood of each text after one prefix token (lm-eval: the tokenizer's BOS, else
    EOS), summed over texts: tokens, bytes, words, nats per token, perplexity, bits per byte,
    and lm-eval's word and byte perplexities."""
    if not texts or not all(isinstance(t, str) and t for t in texts):
        raise ValueError("texts must be a non-empty list of non-empty strings")
    if isinstance(prefix_id, bool) or not isinstance(prefix_id, int) or prefix_id < 0:
        raise ValueError(f"prefix_id must be a token id, got {prefix_id!r}")
    limit = getattr(getattr(model, "cfg", None), "max_seq_len", None)
    ids = [_encode(tok, t) for t in texts]
    if limit and max(len(i) for i in ids) + 1 > limit:
        raise ValueError(f"a text of {max(len(i) for i in ids)} tokens does not fit the model's "
                         f"context of {limit} with its prefix; score shorter documents")
    lls, _ = continuation_logprobs(model, [[prefix_id]] * len(ids), ids)
    nats, tokens = -sum(lls), sum(len(i) for i in ids)
    n_bytes = sum(len(t.encode("utf-8")) for t in texts)
    words = sum(len(re.split(r"\s+", t)) for t in texts)  # lm-eval's count_words
    per_token = nats / tokens
    return {"tokens": tokens, "bytes": n_bytes, "words": words, "nats_per_token": per_token,
            "perplexity": perplexity(per_token),
            "bits_per_byte": bits_per_byte(per_token, tokens / n_bytes),
            "byte_perplexity": math.exp(nats / n_bytes), "word_perplexity": math.exp(nats / words)}


# ---------------------------------------------------------------------------------------------
# Generation with a verifier
# ---------------------------------------------------------------------------------------------

def _check_form(form: str) -> None:
    if form not in FORMS:
        raise ValueError(f"form must be one of {', '.join(FORMS)}, got {form!r}")


def sample_counts(model: nn.Module, tok: task.ChatTokenizer, items: Sequence[task.Problem],
                  n: int, temperature: float = 1.0, form: str = "chat",
                  generator: torch.Generator | None = None, greedy: bool = False,
                  prompts: Sequence[Sequence[int]] | None = None) -> list[int]:
    """How many of n samples per item the verifier accepts. Chat form: the chat prompt, and a
    completion counts only if it ends with `<|eos|>` (`policy.accuracy`'s rule); raw form: the
    line `07+58=`, the completion up to the newline (`base.raw_accuracy`'s rule). `prompts`
    replaces the form's prompt ids (one per item), to score another rendering."""
    _check_form(form)
    if not items:
        raise ValueError("no items to sample")
    if isinstance(n, bool) or not isinstance(n, int) or n < 1:
        raise ValueError(f"n (samples per item) must be a whole number >= 1, got {n!r}")
    if prompts is not None and len(prompts) != len(items):
        raise ValueError(f"give one prompt per item: {len(prompts)} prompts, {len(items)} items")
    if form == "chat":
        prompts, stop = prompts or task.encode_prompts(tok, items), task.EOS
    else:
        prompts = prompts or [tok.encode(raw_context(p)) for p in items]
        stop = tok.encode("\n")[0]
    budget = max(len(p.answer) for p in items) + 2
    roll = policy.sample(model, tok, [p for p in prompts for _ in range(n)], budget,
                         temperature, greedy, generator, stop_id=stop)
    counts = [0] * len(items)
    for j, (c, text) in enumerate(zip(roll.completions, roll.texts)):
        item = items[j // n]
        ok = c[-1:] == [task.EOS] if form == "chat" else True
        counts[j // n] += int(ok and task.verify(item, text) == 1.0)
    return counts


def pass_at_k(n: int, c: int, k: int) -> float:
    """Unbiased pass@k from n samples of which c are right (Chen et al. 2021, Section 2.1):
    1 - C(n-c, k) / C(n, k) = 1 - prod_{i=n-c+1}^{n} (1 - k / i), a product of numbers in
    [0, 1] instead of a ratio of huge binomials. 1 when fewer than k samples are wrong."""
    _whole("n", n, 1)
    _whole("c", c, 0)
    _whole("k", k, 1)
    if c > n or k > n:
        raise ValueError(f"need c <= n and k <= n (k samples drawn from n), got n={n}, c={c}, "
                         f"k={k}")
    if n - c < k:
        return 1.0
    return 1.0 - math.prod(1.0 - k / i for i in range(n - c + 1, n + 1))


def pass_at_k_naive(n: int, c: int, k: int) -> float:
    """1 - (1 - c/n)^k, the sample rate plugged into the k-trial formula: unbiased only for
    k = 1; for k > 1 the formula is concave in the rate, so on average it comes out low
    (Jensen's inequality). Shown for contrast."""
    pass_at_k(n, c, k)  # the same checks
    return 1.0 - (1.0 - c / n) ** k


def mean_pass_at_k(counts: Sequence[int], n: int, k: int) -> float:
    """pass@k of a benchmark: the mean over items of the per-item estimate."""
    if not counts:
        raise ValueError("no item counts")
    return statistics.fmean(pass_at_k(n, c, k) for c in counts)


def scorecard(model: nn.Module, tok: task.ChatTokenizer, items: Sequence[task.Problem],
              n_choices: int = 4, seed: int = 0, form: str = "chat", samples: int = 0,
              temperature: float = 1.0, ks: Sequence[int] = (1,),
              generator: torch.Generator | None = None) -> dict:
    """Every score of this module on the task's items (what `python -m trainbook eval`
    prints): multiple choice with bare and newline-ended choices, held-out loss of the raw
    lines, greedy accuracy in `form` with its Wilson interval, and pass@k from `samples`
    samples per item at `temperature` (if samples > 0)."""
    if not isinstance(tok, task.ChatTokenizer):
        raise ValueError("the arithmetic task is scored with the book's chat tokenizer; this "
                         f"model has a {type(tok).__name__} (export it with --tokenizer chat "
                         "if it was trained on the chat tokenizer's ids)")
    _check_form(form)
    if samples and any(not 1 <= k <= samples for k in ks):
        raise ValueError(f"every k must be in 1..samples ({samples}), got {list(ks)}")
    out = {"items": len(items), "form": form, "multiple_choice": {}}
    for name, end in (("bare", ""), ("newline", "\n")):
        mc = arithmetic_mc(items, n_choices, seed, end)
        out["multiple_choice"][name] = multiple_choice(model, tok, mc).summary()
    out["heldout"] = heldout(model, tok, [task.raw_line(p) + "\n" for p in items], task.BOS)
    right = sum(sample_counts(model, tok, items, 1, form=form, greedy=True))
    out["greedy"] = {"accuracy": right / len(items), "wilson_95": wilson(right, len(items))}
    if samples:
        counts = sample_counts(model, tok, items, samples, temperature, form, generator)
        out["sampled"] = {"samples": samples, "temperature": temperature,
                          "pass_at_k": {k: mean_pass_at_k(counts, samples, k) for k in ks}}
    return out
