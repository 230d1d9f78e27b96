"""Model collapse: what training generation after generation on a model's own samples does to a
distribution, in the Gaussian refit toy (closed forms) and on text with the reference model.

The toy (Shumailov et al. 2024 analyse it): fit a mean and a variance to n samples, draw n new
samples from the fit, fit again. With the maximum-likelihood variance (divide by n) the
expected variance shrinks by (n-1)/n a generation, E[sigma_t^2] = sigma_0^2 ((n-1)/n)^t
(`expected_variance`); with the unbiased one (divide by n-1) the expectation stays sigma_0^2,
yet the log-variance is a random walk with a negative drift (`expected_log_variance`, from the
chi-squared law of the fitted variance), so every run collapses all the same. The spread does
not vanish from the population of runs: it moves into the wandering of the fitted means
(`mean_variance`), and E[sigma_t^2] + Var(mu_t) = sigma_0^2 for the ML estimator.
`gaussian_refit` simulates many independent runs at once, replacing the data each generation
or mixing in the original data (`MODES`): a fixed share of it, or all of it with everything
generated so far (accumulate, as Gerstgrasser et al. 2024).

The text half (`text_collapse`) trains the reference model with the book's trainer on a slice
of tinyshakespeare, samples a corpus of the same size from it, trains the next generation on
that, and so on; it scores each generation on the real held-out text and each corpus for its
diversity (`diversity`), with the same three modes.

Chapter: book/frontier/synthetic-data
"""

from __future__ import annotations

import dataclasses
import math
import re
import tempfile
import time
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from numpy.typing import ArrayLike
from scipy.special import digamma, ndtr
from torch import nn

from .. import train as trainer
from ..align.task import check_fields
from ..bench.gpu_truth import header, read_record, write_record
from ..bench.hf import to_hf
from ..data import ByteTokenizer, load_corpus, pack
from ..pretrain.schedules import quiet

MODES = ("replace", "mix", "accumulate")
ESTIMATORS = ("ml", "unbiased")
# What transformers' generate samples with when neither the model's generation_config.json nor
# the call says otherwise: the 50 likeliest tokens only, a cut of the tail by itself.
HF_SAMPLING_DEFAULTS = {"top_k": 50, "top_p": 1.0, "temperature": 1.0}


def _whole(name: str, value, least: int = 1) -> int:
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < least:
        raise ValueError(f"{name} must be a whole number >= {least}, got {value!r}")
    return int(value)


def _check(n: int, estimator: str, sigma0: float) -> None:
    _whole("n", n, 2)
    if estimator not in ESTIMATORS:
        raise ValueError(f"estimator must be one of {ESTIMATORS}, got {estimator!r}")
    if not (isinstance(sigma0, (int, float)) and math.isfinite(sigma0) and sigma0 > 0):
        raise ValueError(f"sigma0 must be a positive number, got {sigma0!r}")


def _generations(t: ArrayLike) -> np.ndarray:
    t = np.asarray(t, dtype=float)
    if not (np.isfinite(t).all() and (t >= 0).all()):
        raise ValueError(f"t must hold generations >= 0, got {t!r}")
    return t


def _ratio(n: int, estimator: str) -> float:
    """E[fitted variance] / true variance for n samples: (n-1)/n for ML, 1 for unbiased."""
    return (n - 1) / n if estimator == "ml" else 1.0


def expected_variance(t: ArrayLike, n: int, estimator: str = "ml",
                      sigma0: float = 1.0) -> np.ndarray:
    """E[sigma_t^2] after t refits on n samples: sigma0^2 ((n-1)/n)^t (ML) or sigma0^2
    (unbiased). Generation 0 is the truth."""
    _check(n, estimator, sigma0)
    return sigma0 ** 2 * _ratio(n, estimator) ** _generations(t)


def expected_log_variance(t: ArrayLike, n: int, estimator: str = "ml",
                          sigma0: float = 1.0) -> np.ndarray:
    """E[ln sigma_t^2]: each refit multiplies the variance by chi^2_{n-1} / n (ML) or
    / (n-1) (unbiased), whose log has mean digamma((n-1)/2) + ln 2 - ln n (or - ln(n-1))."""
    _check(n, estimator, sigma0)
    step = digamma((n - 1) / 2) + math.log(2) - math.log(n if estimator == "ml" else n - 1)
    return 2 * math.log(sigma0) + step * _generations(t)


def mean_variance(t: ArrayLike, n: int, estimator: str = "ml", sigma0: float = 1.0) -> np.ndarray:
    """Var(mu_t) across runs: the fitted mean moves by sigma_{s}^2 / n in variance each
    generation, so Var(mu_t) = (sigma0^2 / n) sum_{s<t} E[sigma_s^2]: sigma0^2 (1 - ((n-1)/n)^t)
    for ML, t sigma0^2 / n for unbiased."""
    _check(n, estimator, sigma0)
    t = _generations(t)
    if estimator == "unbiased":
        return sigma0 ** 2 * t / n
    return sigma0 ** 2 * (1 - _ratio(n, estimator) ** t)


def tail_mass(var: ArrayLike, k: float = 2.0, sigma0: float = 1.0) -> np.ndarray:
    """P(|X - mu| > k sigma0) for X ~ N(mu, var): the share of a fitted Gaussian's mass farther
    than k original standard deviations from its own mean (2 Phi(-k) = 4.55% at k = 2 for the
    truth)."""
    var = np.asarray(var, dtype=float)
    if not (np.isfinite(var).all() and (var >= 0).all()):
        raise ValueError("var must hold finite, non-negative variances")
    for name, value in (("k", k), ("sigma0", sigma0)):
        if not (isinstance(value, (int, float)) and math.isfinite(value) and value > 0):
            raise ValueError(f"{name} must be a positive number, got {value!r}")
    with np.errstate(divide="ignore"):
        return 2 * ndtr(-k * sigma0 / np.sqrt(var))


@dataclass
class GaussianRuns:
    """Fitted means and variances of independent runs: arrays (replicates, generations + 1);
    column 0 is the truth, column t the fit of generation t."""

    mu: np.ndarray
    var: np.ndarray
    n: int
    estimator: str
    mode: str
    real_fraction: float


def gaussian_refit(n: int, generations: int, replicates: int = 10_000, estimator: str = "ml",
                   mode: str = "replace", real_fraction: float = 0.0, sigma0: float = 1.0,
                   seed: int = 0) -> GaussianRuns:
    """Refit a Gaussian to n samples `generations` times, in `replicates` independent runs.

    Generation 1 fits n draws from the truth N(0, sigma0^2) (the real data, kept per run).
    Each later generation fits, by `mode`: 'replace', n draws from the previous fit; 'mix',
    round(real_fraction n) points of the real data (a fresh random subset) plus draws from the
    previous fit to make n; 'accumulate', the real data and every generation's n draws so far."""
    _check(n, estimator, sigma0)
    _whole("generations", generations)
    _whole("replicates", replicates)
    if mode not in MODES:
        raise ValueError(f"mode must be one of {MODES}, got {mode!r}")
    if not 0 <= real_fraction <= 1 or (mode == "mix") != (real_fraction > 0):
        raise ValueError(f"real_fraction {real_fraction!r}: give a share in (0, 1] with mode "
                         "'mix' and 0 with the other modes")
    rng = np.random.default_rng(seed)
    real = rng.normal(0.0, sigma0, (replicates, n))
    mu = np.zeros((replicates, generations + 1))
    var = np.zeros((replicates, generations + 1))
    var[:, 0] = sigma0 ** 2
    sums, squares, count = real.sum(1), (real ** 2).sum(1), n  # accumulate's running totals
    data, m = real, round(real_fraction * n)
    for g in range(1, generations + 1):
        if mode == "accumulate":
            mean = sums / count
            fit = squares / count - mean ** 2
            fit = fit * count / (count - 1) if estimator == "unbiased" else fit
        else:
            mean, fit = data.mean(1), data.var(1, ddof=1 if estimator == "unbiased" else 0)
        mu[:, g], var[:, g] = mean, np.maximum(fit, 0.0)
        draws = mean[:, None] + np.sqrt(var[:, g])[:, None] * rng.standard_normal((replicates, n))
        if mode == "accumulate":
            sums, squares, count = sums + draws.sum(1), squares + (draws ** 2).sum(1), count + n
        elif mode == "mix":
            pick = np.argsort(rng.random((replicates, n)), axis=1)[:, :m]
            data = np.concatenate([np.take_along_axis(real, pick, 1), draws[:, :n - m]], 1)
        else:
            data = draws
    return GaussianRuns(mu, var, n, estimator, mode, float(real_fraction))


# ---- the reference model on text --------------------------------------------------------------

@dataclass(frozen=True)
class TextRecipe:
    """Each generation: the reference model (bytes) trained from the same seed by the book's
    trainer on `chars` characters for `steps` steps, then `chars` characters sampled from it
    at `temperature`, restricted to the real corpus's characters, in documents of `seq_len`
    that start at a newline."""

    chars: int = 40_000
    generations: int = 4
    temperature: float = 0.8
    d_model: int = 64
    n_layers: int = 2
    n_heads: int = 2
    d_ff: int = 176
    seq_len: int = 64
    batch_size: int = 16
    steps: int = 300
    lr: float = 3e-3
    heldout: int = 20_000  # real characters, from the corpus's end, every generation is scored on
    seed: int = 0

    def __post_init__(self):
        check_fields(self, positive=[f for f in self.__dataclass_fields__ if f != "seed"],
                     non_negative=["seed"])
        if self.chars < 10 * self.seq_len:
            raise ValueError(f"TextRecipe.chars={self.chars} is too few for seq_len "
                             f"{self.seq_len}; give at least 10 * seq_len")


def real_text(recipe: TextRecipe) -> tuple[str, str]:
    """(the first `chars` characters of tinyshakespeare, its last `heldout` characters)."""
    text = load_corpus("tinyshakespeare")
    if recipe.chars + recipe.heldout > len(text):
        raise ValueError(f"chars + heldout = {recipe.chars + recipe.heldout} exceeds the corpus "
                         f"({len(text)} characters)")
    return text[:recipe.chars], text[-recipe.heldout:]


def train_generation(text: str, recipe: TextRecipe) -> nn.Module:
    """The reference model trained on `text` by the trainer (quietly; one thread on a CPU, the
    GPU where there is one)."""
    if not isinstance(recipe, TextRecipe):
        raise ValueError(f"recipe must be a TextRecipe, got {type(recipe).__name__}")
    if len(text) <= recipe.seq_len:
        raise ValueError(f"the text has {len(text)} characters; give more than seq_len "
                         f"{recipe.seq_len}")
    with tempfile.TemporaryDirectory() as tmp:
        corpus = Path(tmp) / "generation.txt"
        corpus.write_text(text)
        cfg = trainer.TrainConfig(
            model="tiny-llama", d_model=recipe.d_model, n_layers=recipe.n_layers,
            n_heads=recipe.n_heads, n_kv_heads=recipe.n_heads, d_ff=recipe.d_ff,
            tokenizer="bytes", corpus=str(corpus), seq_len=recipe.seq_len,
            batch_size=recipe.batch_size, steps=recipe.steps, lr=recipe.lr,
            warmup_steps=min(20, recipe.steps // 10), seed=recipe.seed, device="auto",
            log_every=0, eval_batches=1, progress=False)
        with quiet():
            return trainer.train(cfg).model.eval()


def heldout_loss(model: nn.Module, text: str, seq_len: int) -> float:
    """Mean next-byte loss (nats per byte) of the model on `text`, in blocks of seq_len."""
    _whole("seq_len", seq_len)
    if len(text) <= seq_len:
        raise ValueError(f"the held-out text has {len(text)} characters; give more than "
                         f"seq_len {seq_len}")
    blocks = pack(torch.tensor(ByteTokenizer().encode(text)), seq_len)
    device = next(model.parameters()).device
    return trainer.evaluate(model, blocks, 64, len(blocks), device)


def synthesize(model: nn.Module, chars: int, recipe: TextRecipe, alphabet: str,
               seed: int = 0) -> str:
    """`chars` characters sampled from the model with transformers' `generate` (a KV cache,
    on the same weights: `bench.hf.to_hf`), at the recipe's temperature, over the bytes of
    `alphabet` only; documents of seq_len bytes, each from a newline."""
    _whole("chars", chars)
    codes = sorted({ord(c) for c in alphabet})
    if not codes or codes[-1] > 127 or ord("\n") not in codes:
        raise ValueError("alphabet must be ASCII text that includes a newline")
    hf = to_hf(model).eval()
    docs, per = [], recipe.seq_len - 1
    need = -(-chars // (per + 1))
    gen = dict(do_sample=True, temperature=recipe.temperature, top_k=0, top_p=1.0,
               max_new_tokens=per, min_new_tokens=per, eos_token_id=None, pad_token_id=0,
               suppress_tokens=[i for i in range(256) if i not in codes])
    with torch.random.fork_rng(), torch.no_grad():
        torch.manual_seed(seed)
        for start in range(0, need, 256):
            ids = torch.full((min(256, need - start), 1), ord("\n"), device=hf.device)
            out = hf.generate(ids, attention_mask=torch.ones_like(ids), **gen)
            docs += [bytes(row).decode("ascii") for row in out.tolist()]
    return "".join(docs)[:chars]


def diversity(text: str, reference: str, n: int = 4) -> dict[str, float]:
    """How varied a corpus is, against the real one: distinct character n-grams per 1,000
    characters, the character entropy (bits), the share of characters that are rare in the
    reference (each under 1/1,000 of it), and of words the reference never uses."""
    _whole("n", n)
    if len(text) < n or not reference:
        raise ValueError(f"need a text of at least n={n} characters and a reference")
    counts, ref = Counter(text), Counter(reference)
    p = np.array(list(counts.values()), dtype=float) / len(text)
    rare = {c for c, k in ref.items() if k / len(reference) < 1e-3}
    words = re.findall(r"[a-z]+", text.lower())
    known = set(re.findall(r"[a-z]+", reference.lower()))
    grams = {text[i:i + n] for i in range(len(text) - n + 1)}
    return {f"distinct_{n}grams_per_1k": 1000 * len(grams) / len(text),
            "entropy_bits": float(-(p * np.log2(p)).sum()),
            "rare_share": sum(counts[c] for c in rare) / len(text),
            "unknown_words": sum(w not in known for w in words) / max(1, len(words))}


def text_collapse(recipe: TextRecipe = TextRecipe(), mode: str = "replace",
                  real_fraction: float = 0.0, first: nn.Module | None = None) -> list[dict]:
    """Train `recipe.generations` + 1 generations; one row each: the loss on real held-out
    text and the diversity of the generation's samples. Generation 0 trains on the real slice;
    generation g + 1 on generation g's samples ('replace'), on those with `real_fraction` of the
    real slice in their place ('mix'), or on the real slice and every sample so far
    ('accumulate'). `first` is a generation-0 model to reuse (it depends on the recipe only)."""
    if mode not in MODES:
        raise ValueError(f"mode must be one of {MODES}, got {mode!r}")
    if not 0 <= real_fraction < 1 or (mode == "mix") != (real_fraction > 0):
        raise ValueError(f"real_fraction {real_fraction!r}: give a share in (0, 1) with mode "
                         "'mix' and 0 with the other modes")
    real, held = real_text(recipe)
    alphabet = "".join(sorted(set(real + held)))
    corpus, synthetic, rows = real, [], []
    for g in range(recipe.generations + 1):
        model = first if g == 0 and first is not None else train_generation(corpus, recipe)
        sample = synthesize(model, recipe.chars, recipe, alphabet, recipe.seed + g)
        rows.append({"mode": mode, "generation": g, "train_chars": len(corpus),
                     "heldout_loss": heldout_loss(model, held, recipe.seq_len),
                     **diversity(sample, real)})
        synthetic.append(sample)
        keep = round(real_fraction * recipe.chars)
        corpus = {"replace": sample, "mix": real[:keep] + sample[keep:],
                  "accumulate": real + "".join(synthetic)}[mode]
    return rows


def write_text_collapse(path: str | Path, recipe: TextRecipe = TextRecipe(),
                        modes: tuple[str, ...] = MODES, real_fraction: float = 0.5,
                        progress: bool = True) -> Path:
    """Run `text_collapse` in each mode (one generation-0 model shared by all: it trains on the
    real slice whatever the mode) and store the rows with provenance."""
    if not modes or any(m not in MODES for m in modes):
        raise ValueError(f"modes must be a non-empty selection of {MODES}, got {modes!r}")
    if "mix" in modes and not 0 < real_fraction < 1:
        raise ValueError(f"real_fraction must be in (0, 1) for mode 'mix', got {real_fraction!r}")
    if Path(path).suffix != ".json":
        raise ValueError(f"write the record to a .json file, not {str(path)!r}")
    t0 = time.perf_counter()
    first = train_generation(real_text(recipe)[0], recipe)
    rows = []
    for mode in modes:
        rows += text_collapse(recipe, mode, real_fraction if mode == "mix" else 0.0, first)
        if progress:
            print(f"collapse: mode {mode} done, {time.perf_counter() - t0:.0f} s", flush=True)
    real, _ = real_text(recipe)
    options = [f"--{k.replace('_', '-')} {v}" for k, v in dataclasses.asdict(recipe).items()
               if v != getattr(TextRecipe(), k)]
    command = " ".join(["python -m trainbook collapse", *options, f"--modes {','.join(modes)}",
                        f"--real-fraction {real_fraction} --out {path}"])
    device = next(first.parameters()).device
    record = header("synthetic-collapse", command, device,
                    "small" if device.type == "cpu" else "large")
    record.update(recipe=dataclasses.asdict(recipe), modes=list(modes),
                  real_fraction=real_fraction, real=diversity(real, real), rows=rows,
                  seconds=time.perf_counter() - t0)
    path = Path(path)
    return write_record(path.parent, path.stem, record)


def read_text_collapse(path: str | Path) -> dict:
    """A stored text-collapse record (`write_text_collapse`, `python -m trainbook collapse`)."""
    return read_record(path, "synthetic-collapse", "python -m trainbook collapse")
