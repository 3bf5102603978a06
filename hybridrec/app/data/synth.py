"""Synthetic Criteo-format data drawn from a planted click model.

Runs wherever the data is prepared (``hybridrec data synth``), not in a
training service, so it lives in the app (hybridrec/app/data/) and imports no
service. It exists so that every part of the trainer can be tested
end to end against a known answer: the true click probability of every eval
row is known, so ``oracle.json`` records the best AUC any model can reach,
and a training run is judged by its distance to that oracle.

Planted model (logit = bias + sum of effects, label ~ Bernoulli(sigmoid)):

* 26 categorical slots with Criteo-like cardinalities (log-spaced 10..10^6),
  Zipf-distributed IDs (exponent 1.05..1.2, truncated at the cardinality),
  some slots often empty (an empty field has no effect, as an empty bag
  pools to zero). Each ID has a Gaussian effect whose scale shrinks with
  the slot's cardinality and, below a frequency of 1 %, with the ID's
  frequency: rare IDs cannot be learned in one epoch, and signal planted
  on them would only inflate the oracle with what no model can recover.
  Each slot's effects are rescaled to a fixed row-weighted std so that the
  oracle does not hinge on the luck of a few head IDs.
* 13 integer columns drawn like Criteo counts (zero-inflated lognormal, some
  empty, I2 sometimes negative) acting through a smooth, mostly linear
  function of log1p(max(x, 0)) -- the reader's transform, under which an
  empty field and 0 coincide, so the model's view of a row loses nothing
  the planted model uses.
* A few weak low-rank pairwise interactions (dot products of 4-d per-ID
  latent vectors) between small, mostly present slots. Kept weak because
  an MLP over concatenated embeddings learns products poorly in one epoch:
  at INTERACTION_SCALE 0.2 instead of 0.12 the reference model's gap to the
  oracle (examples/check_synth_learnable.py) grows from ~0.009 to ~0.014.
* The bias is calibrated to a CTR of about 0.25.
* Optionally a planted drift (`Drift`): from a given training row on, a few
  frequent IDs of one slot change their effect, as when an item suddenly
  becomes popular. The eval file is drawn after the drift (the world the
  final model is judged in), and `drift_probes.tsv` holds rows carrying the
  drifted IDs, with their true click probability before and after in
  `oracle.json`, to watch served predictions follow the change.

Deterministic given the seed; rows are drawn in fixed-size blocks with their
own random streams, so a longer file starts with the rows of a shorter one.

Large vocabularies (`ids`, `hybridrec data synth --ids N`): the slots of
10,000 IDs or more also draw a share of their occurrences from a tail of
rare IDs, uniform over a vocabulary twice the size the tail must show, so
that the training file holds about N distinct IDs (up to 10^9; 100M in 30M
rows). A tail ID is never held in a table: its token (16 hex digits, where a
head ID has 8) and its effect (Gaussian, from a hash of the ID, scaled down
by its rarity as any rare ID's) are computed from the ID itself. The oracle
is computed from the true probabilities as without a tail.
"""

from __future__ import annotations

import gzip as gzip_module
import json
import math
import os
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional

import numpy as np

from hybridrec.core.layouts.criteo_format import NUM_DENSE, NUM_SPARSE
from hybridrec.core.model.evaluation import binary_metrics
from hybridrec.core.runtime.kernel_cache import njit

GENERATOR_VERSION = "2"
BLOCK_ROWS = 1 << 15
"""Rows drawn per random stream; part of the generator's definition."""
TARGET_CTR = 0.25
MIN_CARDINALITY, MAX_CARDINALITY = 10, 1_000_000
LATENT_DIM = 4

# Effect scales, tuned with examples/check_synth_learnable.py so that the
# reference model lands about 0.009 AUC below the oracle (seeds 0, 1, 2).
ID_SCALE_SMALL = 0.5
"""Std of the per-ID effect in a slot of cardinality 10 ..."""
ID_SCALE_LARGE = 0.2
"""... and of cardinality 10^6 (log-linear in between)."""
ID_TAPER_FREQ = 1e-2
"""IDs rarer than this (probability per row) carry proportionally less signal ..."""
ID_TAPER_POWER = 0.5
"""... effect std * (p / ID_TAPER_FREQ) ** ID_TAPER_POWER."""
INTERACTION_SCALE = 0.12
"""Std of one pairwise interaction term over rows where both slots are present."""
NUM_INTERACTIONS = 4
MAX_INTERACTION_CARDINALITY = 2_000
DENSE_SCALE = 0.3
"""Std of the linear dense coefficient of a standardised log1p feature ..."""
DENSE_QUAD_SCALE = 0.075
"""... and of its (mild) quadratic coefficient."""

WIDE_MIN_CARDINALITY = 10_000
"""With `ids`: the slots of at least this many IDs draw part of their occurrences from a tail of rare IDs."""
MAX_TAIL_SHARE = 0.9
"""... at most this share of them: a wide slot keeps a tenth of its planted head."""
TAIL_OVERSIZE = 2.0
"""A tail's vocabulary is this many times the distinct tail IDs the file should show (about ln 2 = 69 % of
its draws are then new IDs)."""
MAX_IDS = 10**9

# Criteo-like rates of empty integer fields (I1..I13, Kaggle train set).
DENSE_MISSING = np.array([0.45, 0.0, 0.21, 0.22, 0.03, 0.22, 0.04, 0.001, 0.04,
                          0.45, 0.04, 0.77, 0.22])


@dataclass
class SynthSummary:
    """What synthesize() wrote and the oracle figures of its eval file."""

    out_dir: str
    train_path: str
    eval_path: str
    oracle_path: str
    train_rows: int
    eval_rows: int
    seed: int
    ctr: float
    """Click rate of the train file."""
    oracle_auc: float
    """AUC of the true click probabilities on the eval file."""
    oracle_logloss: float
    seconds: float
    extra: dict = field(default_factory=dict, repr=False)


@dataclass(frozen=True)
class Drift:
    """From training row `at_row` on, `ids` IDs of slot `slot` add `shift` to their effect (in logits).

    The IDs are the slot's most frequent ones from rank `first_rank` on (the 5th most frequent and after, by
    default): each is in about 1-2 % of rows, so a stream carries hundreds of them a second, while the head
    IDs, which a large share of rows hold, keep the overall click rate close to what it was. The slot
    (`None`: the fullest slot of at least 1,000 IDs outside the pairwise interactions) must not be in an
    interaction, so an ID's effect is its own."""

    at_row: int
    slot: Optional[int] = None
    ids: int = 8
    first_rank: int = 4
    shift: float = 1.5

    def resolve(self, model: "_PlantedModel") -> tuple[int, np.ndarray]:
        """(slot, ranks of the drifted IDs) in `model`, or ValueError naming the setting that cannot hold."""
        paired = {a for a, b, _, _ in model.pairs} | {b for a, b, _, _ in model.pairs}
        slot = self.slot
        if slot is None:
            candidates = [s for s in range(NUM_SPARSE) if s not in paired and model.cardinalities[s] >= 1000]
            slot = min(candidates, key=lambda s: model.missing_rates[s])
        if not 0 <= slot < NUM_SPARSE:
            raise ValueError(f"drift slot {slot}: there are {NUM_SPARSE} slots (0..{NUM_SPARSE - 1})")
        if slot in paired:
            raise ValueError(f"drift slot {slot} is in a pairwise interaction ({sorted(paired)}); choose another")
        if self.at_row < 0 or self.ids <= 0 or self.first_rank < 0:
            raise ValueError(f"drift: at_row and first_rank must be >= 0 and ids > 0, got {self}")
        if self.first_rank + self.ids > model.cardinalities[slot]:
            raise ValueError(f"drift: slot {slot} has {model.cardinalities[slot]} IDs, fewer than first_rank + "
                             f"ids = {self.first_rank + self.ids}")
        return slot, np.arange(self.first_rank, self.first_rank + self.ids)


@dataclass(frozen=True)
class Tail:
    """The rare IDs that give the file `ids` distinct IDs: in each of `slots`, an occurrence is a tail ID with
    probability `share`, drawn uniformly from `size` IDs (tokens and effects from hashes, `keys`)."""

    ids: int
    slots: tuple[int, ...]
    share: float
    size: int
    keys: tuple[int, ...]
    head_distinct: int
    """Distinct head IDs expected in the training file (the planted model's own)."""

    def describe(self) -> dict:
        return {"target_distinct_ids": self.ids, "head_distinct_ids": self.head_distinct,
                "tail_slots": [int(s) for s in self.slots], "tail_share": round(self.share, 6),
                "tail_vocabulary_per_slot": self.size, "tail_token_hex_digits": 16}


def _head_distinct(model: "_PlantedModel", rows: int, share: float, slots: tuple[int, ...]) -> float:
    """Distinct head IDs expected in `rows` rows when `slots` give a `share` of their occurrences to a tail."""
    total = 0.0
    for s in range(NUM_SPARSE):
        draws = rows * (1 - model.missing_rates[s]) * ((1 - share) if s in slots else 1.0)
        total += float(np.sum(-np.expm1(-draws * np.diff(model.cdfs[s], prepend=0.0))))
    return total


def plan_tail(model: "_PlantedModel", rows: int, ids: int, seed: int, share: Optional[float] = None) -> Tail:
    """The tail that gives `rows` training rows about `ids` distinct IDs, or ValueError naming --ids and the
    limit that `rows` sets. `share` (--tail-share): the share of the large slots' occurrences the tail takes,
    fixed, its vocabulary sized to give `ids` instead: so that data sets of different `ids` have the same
    distinct IDs per batch (a table of 10M rows against one of 100M at the same work per batch)."""
    if not 0 < ids <= MAX_IDS:
        raise ValueError(f"--ids {ids:,}: must be in 1..{MAX_IDS:,}")
    slots = tuple(int(s) for s in np.flatnonzero(model.cardinalities >= WIDE_MIN_CARDINALITY))
    draws = sum(rows * (1 - model.missing_rates[s]) for s in slots)  # occurrences of the wide slots
    keys = tuple(int(k) for k in _stream(seed, 5).integers(0, 1 << 62, len(slots)))
    if share is not None:
        return _tail_of_share(model, rows, ids, slots, draws, share, keys)
    # m uniform draws from V = TAIL_OVERSIZE * D IDs show D = V (1 - e^(-m/V)) distinct: m = V * rate
    rate = -math.log(1 - 1 / TAIL_OVERSIZE)
    new_per_draw = 1 / (TAIL_OVERSIZE * rate)  # distinct tail IDs per tail draw (0.72 at TAIL_OVERSIZE 2)
    share = 0.0
    for _ in range(3):  # the head's distinct count shrinks as the tail's share grows: settle both
        head = _head_distinct(model, rows, share, slots)
        share = max(0.0, ids - head) / (draws * new_per_draw)
        if share > MAX_TAIL_SHARE:
            most = int(head + MAX_TAIL_SHARE * draws * new_per_draw)
            raise ValueError(f"--ids {ids:,}: {rows:,} training rows hold at most about {most:,} distinct IDs in "
                             f"this generator ({len(slots)} slots of {WIDE_MIN_CARDINALITY:,} IDs or more, each "
                             f"giving at most {MAX_TAIL_SHARE:.0%} of its occurrences to rare IDs); raise --rows "
                             f"to at least {math.ceil(rows * share / MAX_TAIL_SHARE):,} or lower --ids")
    if share == 0.0:
        raise ValueError(f"--ids {ids:,}: the planted model alone shows about {int(head):,} distinct IDs in "
                         f"{rows:,} rows; ask for more, or leave --ids out")
    tail_draws = draws * share / len(slots)
    size = max(1, round(tail_draws / rate))
    return Tail(ids=ids, slots=slots, share=share, size=size, keys=keys, head_distinct=int(head))


def _tail_of_share(model: "_PlantedModel", rows: int, ids: int, slots: tuple[int, ...], draws: float,
                   share: float, keys: tuple[int, ...]) -> Tail:
    """`plan_tail` with the tail's share fixed: the vocabulary V per slot whose m draws show the distinct IDs
    asked for, V (1 - e^(-m/V)) = D (bisection: the left side grows with V towards m)."""
    if not 0 < share <= MAX_TAIL_SHARE:
        raise ValueError(f"--tail-share {share}: must be in (0, {MAX_TAIL_SHARE}]")
    head = _head_distinct(model, rows, share, slots)
    m = draws * share / len(slots)
    wanted = (ids - head) / len(slots)
    if wanted <= 0 or wanted >= 0.99 * m:
        most = int(head + 0.99 * m * len(slots))
        raise ValueError(f"--ids {ids:,} with --tail-share {share}: {rows:,} training rows show between about "
                         f"{int(head):,} and {most:,} distinct IDs at that share; choose --ids in that range, or "
                         f"another --tail-share")
    lo, hi = wanted, wanted * 1e6
    for _ in range(100):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if mid * -math.expm1(-m / mid) < wanted else (lo, mid)
    return Tail(ids=ids, slots=slots, share=share, size=max(1, round(hi)), keys=keys, head_distinct=int(head))


_GOLDEN64 = np.uint64(0x9E3779B97F4A7C15)


def _mix64(x: np.ndarray) -> np.ndarray:
    """splitmix64's finaliser over uint64 arrays (a bijection)."""
    x = x ^ (x >> np.uint64(30))
    x = x * np.uint64(0xBF58476D1CE4E5B9)
    x = x ^ (x >> np.uint64(27))
    x = x * np.uint64(0x94D049BB133111EB)
    return x ^ (x >> np.uint64(31))


def _tail_effects(model: "_PlantedModel", tail: Tail, slot: int, ids: np.ndarray) -> np.ndarray:
    """Each tail ID's effect, from a hash of the ID: Gaussian, at the slot's scale, tapered by its rarity."""
    key = np.uint64(tail.keys[tail.slots.index(slot)])
    with np.errstate(over="ignore"):
        h1 = _mix64(ids.astype(np.uint64) * _GOLDEN64 + key)
        h2 = _mix64(h1 + _GOLDEN64)
    u1 = ((h1 >> np.uint64(11)).astype(np.float64) + 1.0) / 2.0**53
    u2 = (h2 >> np.uint64(11)).astype(np.float64) / 2.0**53
    gauss = np.sqrt(-2.0 * np.log(u1)) * np.cos(2.0 * np.pi * u2)
    taper = min(1.0, (tail.share / tail.size / ID_TAPER_FREQ) ** ID_TAPER_POWER)
    return gauss * model.id_scales[slot] * taper


@dataclass
class _PlantedModel:
    cardinalities: np.ndarray  # (26,) int64
    zipf_exponents: np.ndarray  # (26,)
    missing_rates: np.ndarray  # (26,)
    id_scales: np.ndarray  # (26,)
    cdfs: list  # per slot: Zipf CDF over ranks 0..card-1
    effects: list  # per slot: float64 effect per rank
    token_keys: np.ndarray  # (26,) int64, rank -> token permutation key
    pairs: list  # (slot_a, slot_b, latent_a, latent_b)
    dense_mu: np.ndarray
    dense_sigma: np.ndarray
    dense_zero: np.ndarray
    dense_center: np.ndarray
    dense_spread: np.ndarray
    dense_linear: np.ndarray
    dense_quad: np.ndarray
    bias: float = 0.0

    def describe(self) -> dict:
        return {
            "cardinalities": self.cardinalities.tolist(),
            "zipf_exponents": [round(float(a), 4) for a in self.zipf_exponents],
            "missing_rates": [round(float(m), 4) for m in self.missing_rates],
            "id_effect_scales": [round(float(s), 4) for s in self.id_scales],
            "interaction_pairs": [[int(a), int(b)] for a, b, _, _ in self.pairs],
            "dense_missing_rates": DENSE_MISSING.tolist(),
            "bias": round(self.bias, 6),
        }


def _stream(seed: int, *key: int) -> np.random.Generator:
    return np.random.default_rng(np.random.SeedSequence([seed, *key]))


def _build_model(seed: int) -> _PlantedModel:
    rng = _stream(seed, 0)
    cards = np.round(np.logspace(math.log10(MIN_CARDINALITY), math.log10(MAX_CARDINALITY),
                                 NUM_SPARSE)).astype(np.int64)
    cards = cards[rng.permutation(NUM_SPARSE)]
    exponents = rng.uniform(1.05, 1.2, NUM_SPARSE)
    # Criteo: most slots almost always filled, a third often empty.
    missing = np.where(rng.random(NUM_SPARSE) < 0.35, rng.uniform(0.3, 0.8, NUM_SPARSE),
                       rng.uniform(0.0, 0.05, NUM_SPARSE))
    frac = (np.log10(cards) - math.log10(MIN_CARDINALITY)) / (
        math.log10(MAX_CARDINALITY) - math.log10(MIN_CARDINALITY))
    scales = ID_SCALE_SMALL * (ID_SCALE_LARGE / ID_SCALE_SMALL) ** frac
    cdfs, pmfs, effects = [], [], []
    for s in range(NUM_SPARSE):
        w = np.arange(1, cards[s] + 1, dtype=np.float64) ** -exponents[s]
        pmf = w / w.sum()
        cdfs.append(np.cumsum(pmf))
        pmfs.append(pmf)
        taper = np.minimum(1.0, (pmf / ID_TAPER_FREQ) ** ID_TAPER_POWER)
        eff = rng.standard_normal(cards[s]) * taper
        # The few head IDs hold much of a slot's rows: rescale so that the
        # slot's row-weighted effect std does not hinge on their luck.
        target = scales[s] * math.sqrt(pmf @ taper**2)
        effects.append(eff * (target / math.sqrt(pmf @ eff**2)))
    keys = rng.integers(0, 1 << 32, NUM_SPARSE)
    # Interactions between the small slots that are least often empty, so
    # that they are seen often enough to be learned in one epoch.
    small = np.flatnonzero(cards <= MAX_INTERACTION_CARDINALITY)
    candidates = small[np.argsort(missing[small], kind="stable")][:6]
    combos = [(a, b) for i, a in enumerate(candidates) for b in candidates[i + 1:]]
    pairs = []
    for c in rng.choice(len(combos), size=NUM_INTERACTIONS, replace=False):
        a, b = combos[c]
        u = rng.standard_normal((cards[a], LATENT_DIM))
        v = rng.standard_normal((cards[b], LATENT_DIM))
        # E[(u.v)^2] over Zipf-drawn IDs, then scale so its std is INTERACTION_SCALE
        m_u, m_v = (u.T * pmfs[a]) @ u, (v.T * pmfs[b]) @ v
        scale = math.sqrt(INTERACTION_SCALE / math.sqrt(float((m_u * m_v).sum())))
        pairs.append((int(a), int(b), u * scale, v * scale))
    model = _PlantedModel(
        cardinalities=cards, zipf_exponents=exponents, missing_rates=missing,
        id_scales=scales, cdfs=cdfs, effects=effects, token_keys=keys, pairs=pairs,
        dense_mu=rng.uniform(0.0, 4.0, NUM_DENSE), dense_sigma=rng.uniform(0.7, 1.8, NUM_DENSE),
        dense_zero=rng.uniform(0.0, 0.4, NUM_DENSE), dense_center=np.zeros(NUM_DENSE),
        dense_spread=np.ones(NUM_DENSE), dense_linear=rng.standard_normal(NUM_DENSE) * DENSE_SCALE,
        dense_quad=rng.standard_normal(NUM_DENSE) * DENSE_QUAD_SCALE)
    # Standardise the dense features and calibrate the bias on a sample.
    calib = _stream(seed, 3)
    _, t = _draw_dense(model, calib, 100_000)
    model.dense_center, model.dense_spread = t.mean(0), t.std(0) + 1e-6
    model.bias = _calibrated_bias(model, calib)
    return model


def _calibrated_bias(model: _PlantedModel, rng: np.random.Generator, tail: Optional[Tail] = None) -> float:
    """The bias that gives a sample of rows a click rate of TARGET_CTR."""
    logit, _, _, _ = _draw_rows(model, rng, 200_000, tail)
    lo, hi = -10.0, 10.0
    for _ in range(60):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if np.mean(1 / (1 + np.exp(-(logit + mid)))) < TARGET_CTR else (lo, mid)
    return (lo + hi) / 2


def _draw_dense(model: _PlantedModel, rng: np.random.Generator, n: int):
    """Integer columns (with -1 meaning empty is kept apart) and their log1p view."""
    x = np.floor(np.exp(model.dense_mu + model.dense_sigma * rng.standard_normal((n, NUM_DENSE))))
    x[rng.random((n, NUM_DENSE)) < model.dense_zero] = 0
    neg = rng.random(n) < 0.08  # Criteo's I2 takes small negative values
    x[neg, 1] = -rng.integers(1, 4, int(neg.sum()))
    empty = rng.random((n, NUM_DENSE)) < DENSE_MISSING
    x[empty] = 0
    t = np.log1p(np.maximum(x, 0))  # exactly what the reader gives the model
    return (x.astype(np.int64), empty), t


def _draw_rows(model: _PlantedModel, rng: np.random.Generator, n: int, tail: Optional[Tail] = None):
    """Returns (logit without bias, ranks (-1 = empty; with a tail, -2 - i = the slot's tail ID i), dense
    columns, dense empty mask)."""
    ranks = np.empty((n, NUM_SPARSE), np.int64 if tail is not None else np.int32)
    logit = np.zeros(n)
    for s in range(NUM_SPARSE):
        r = np.searchsorted(model.cdfs[s], rng.random(n), side="right")
        np.minimum(r, model.cardinalities[s] - 1, out=r)
        eff = model.effects[s][r]
        if tail is not None and s in tail.slots:
            rare = rng.random(n) < tail.share
            ids = rng.integers(0, tail.size, int(rare.sum()))
            r = r.astype(np.int64)
            r[rare] = -2 - ids
            eff[rare] = _tail_effects(model, tail, s, ids)
        if model.missing_rates[s] > 0:
            empty = rng.random(n) < model.missing_rates[s]
            r[empty] = -1
            eff[empty] = 0.0
        ranks[:, s] = r
        logit += eff
    for a, b, u, v in model.pairs:
        ok = (ranks[:, a] >= 0) & (ranks[:, b] >= 0)
        logit[ok] += np.einsum("ij,ij->i", u[ranks[ok, a]], v[ranks[ok, b]])
    (ints, empty), t = _draw_dense(model, rng, n)
    z = np.clip((t - model.dense_center) / model.dense_spread, -3, 3)
    logit += z @ model.dense_linear + ((z * z - 1) / 2) @ model.dense_quad
    return logit, ranks, ints, empty


_HEX = np.frombuffer(b"0123456789abcdef", dtype=np.uint8)


@njit(cache=True)
def _token(rank, key):
    """Rank -> 32-bit token: add, xorshift and odd multiplies are bijections."""
    m = 0xFFFFFFFF
    x = (rank + key) & m
    x = ((x ^ (x >> 16)) * 0x45D9F3B) & m
    x = ((x ^ (x >> 16)) * 0x45D9F3B) & m
    return x ^ (x >> 16)


@njit(cache=True)
def _token64(i, key):
    """Tail ID -> 64-bit token: splitmix64 of the ID and the slot's key (a bijection per slot)."""
    x = i * np.uint64(0x9E3779B97F4A7C15) + key
    x = (x ^ (x >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
    x = (x ^ (x >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
    return x ^ (x >> np.uint64(31))


@njit(cache=True)
def _format_rows(labels, ints, int_empty, ranks, keys, hexd, out, tail_keys):
    """Write rows as Criteo TSV bytes into ``out``; returns the byte count. `tail_keys`: per slot, the key of
    its tail IDs' tokens (ranks below -1)."""
    p = 0
    digits = np.empty(20, np.uint8)
    for i in range(labels.shape[0]):
        out[p] = 48 + labels[i]
        p += 1
        for j in range(ints.shape[1]):
            out[p] = 9
            p += 1
            if int_empty[i, j]:
                continue
            v = ints[i, j]
            if v < 0:
                out[p] = 45
                p += 1
                v = -v
            nd = 0
            while True:
                digits[nd] = 48 + v % 10
                nd += 1
                v //= 10
                if v == 0:
                    break
            for d in range(nd - 1, -1, -1):
                out[p] = digits[d]
                p += 1
        for k in range(ranks.shape[1]):
            out[p] = 9
            p += 1
            if ranks[i, k] == -1:
                continue
            if ranks[i, k] < -1:  # a tail ID: 16 hex digits, never one of the 8-digit head tokens
                t64 = _token64(np.uint64(-2 - ranks[i, k]), np.uint64(tail_keys[k]))
                for d in range(16):
                    out[p + d] = hexd[(t64 >> np.uint64(60 - 4 * d)) & np.uint64(15)]
                p += 16
                continue
            t = _token(np.int64(ranks[i, k]), keys[k])
            for d in range(8):
                out[p + d] = hexd[(t >> (28 - 4 * d)) & 15]
            p += 8
        out[p] = 10
        p += 1
    return p


def _tail_keys(tail: Optional[Tail]) -> np.ndarray:
    """Per slot, the key of its tail IDs' tokens (0 where it has no tail)."""
    keys = np.zeros(NUM_SPARSE, np.uint64)
    if tail is not None:
        keys[list(tail.slots)] = tail.keys
    return keys


def _write_file(path: Path, model: _PlantedModel, seed: int, file_key: int, rows: int,
                use_gzip: bool, drift: Optional[tuple[int, int, np.ndarray, float]] = None,
                tail: Optional[Tail] = None):
    """Write ``rows`` rows; returns (labels, click probabilities).

    ``drift``: (first row it applies to, slot, drifted ranks, shift)."""
    all_labels, all_p = [], []
    tail_keys, token_bytes = _tail_keys(tail), 17 if tail is not None else 9
    opener = (lambda: gzip_module.open(path, "wb", compresslevel=3)) if use_gzip else (
        lambda: open(path, "wb"))
    with opener() as f:
        for block, start in enumerate(range(0, rows, BLOCK_ROWS)):
            rng = _stream(seed, file_key, block)
            n = min(BLOCK_ROWS, rows - start)
            logit, ranks, ints, empty = _draw_rows(model, rng, BLOCK_ROWS, tail)
            if drift is not None:
                logit += _drift_shift(drift, start, ranks)
            p = 1.0 / (1.0 + np.exp(-(logit + model.bias)))
            labels = (rng.random(BLOCK_ROWS) < p).astype(np.int8)
            # Full blocks are always drawn, then cut: a file's rows do not
            # depend on its length.
            labels, p, ranks, ints, empty = labels[:n], p[:n], ranks[:n], ints[:n], empty[:n]
            max_int_digits = max(1, len(str(int(np.abs(ints).max())))) + 1
            out = np.empty(n * (2 + NUM_DENSE * (1 + max_int_digits) + NUM_SPARSE * token_bytes), np.uint8)
            nbytes = _format_rows(labels, ints, empty, ranks, model.token_keys, _HEX, out, tail_keys)
            f.write(memoryview(out[:nbytes]))
            all_labels.append(labels)
            all_p.append(p)
    return np.concatenate(all_labels), np.concatenate(all_p)


def _drift_shift(drift: tuple[int, int, np.ndarray, float], start: int, ranks: np.ndarray) -> np.ndarray:
    """The logit shift of each row of a block starting at file row `start`: rows from the drift's first row
    on that hold a drifted ID get its shift. The rows and the random streams stay as they were."""
    at_row, slot, drifted, shift = drift
    after = np.arange(start, start + len(ranks)) >= at_row
    return np.where(after & np.isin(ranks[:, slot], drifted), shift, 0.0)


def _token_hex(rank: int, key: int) -> str:
    """An ID as the TSV files spell it."""
    return f"{int(_token(np.int64(rank), int(key))):08x}"


def _write_probes(path: Path, model: _PlantedModel, seed: int, slot: int, ranks: np.ndarray, shifts: np.ndarray,
                  per_id: int) -> tuple[list[float], list[float]]:
    """`per_id` rows for each ID of `slot` in `ranks` (feature rows drawn as usual, then `slot` set to the ID),
    without a label: the inference service's `rows` input. Returns each ID's mean true click probability over
    its rows before the drift and after it (`shifts`: each ID's shift)."""
    rng = _stream(seed, 3, 0)
    logit, drawn, ints, empty = _draw_rows(model, rng, per_id * len(ranks))
    old = np.where(drawn[:, slot] >= 0, model.effects[slot][np.maximum(drawn[:, slot], 0)], 0.0)
    drawn[:, slot] = np.repeat(ranks, per_id)
    logit += model.effects[slot][drawn[:, slot]] - old + model.bias
    out = np.empty(len(drawn) * (2 + NUM_DENSE * 22 + NUM_SPARSE * 9), np.uint8)
    nbytes = _format_rows(np.zeros(len(drawn), np.int8), ints, empty, drawn, model.token_keys, _HEX, out,
                          _tail_keys(None))
    # _format_rows writes a label first: drop it and its tab from every line.
    lines = bytes(out[:nbytes]).split(b"\n")[:-1]
    path.write_bytes(b"".join(line[2:] + b"\n" for line in lines))
    sigmoid = lambda x: 1.0 / (1.0 + np.exp(-x))  # noqa: E731
    before = sigmoid(logit).reshape(len(ranks), per_id).mean(1)
    after = sigmoid(logit + np.repeat(shifts, per_id)).reshape(len(ranks), per_id).mean(1)
    return [round(float(x), 6) for x in before], [round(float(x), 6) for x in after]


PROBE_FILE = "drift_probes.tsv"
PROBE_ROWS_PER_ID = 100


def _plant_drift(out: Path, model: _PlantedModel, seed: int, drift: Drift, rows: int) -> dict:
    """Write the drift's probe rows; returns what oracle.json records of it.

    The probe file holds the drifted IDs' rows, then as many rows of as many control IDs: the slot's IDs
    right after the drifted ones in frequency (when the slot has them), whose effect does not change, so a
    served model that moves them too has not learnt the drift but moved as a whole."""
    if drift.at_row >= rows:
        raise ValueError(f"drift at row {drift.at_row}: the training file has only {rows} rows")
    slot, drifted = drift.resolve(model)
    control = np.arange(drifted[-1] + 1, min(drifted[-1] + 1 + len(drifted), model.cardinalities[slot]))
    ranks = np.concatenate([drifted, control])
    shifts = np.where(np.arange(len(ranks)) < len(drifted), drift.shift, 0.0)
    before, after = _write_probes(out / PROBE_FILE, model, seed, slot, ranks, shifts, PROBE_ROWS_PER_ID)
    hex_ids = [_token_hex(r, model.token_keys[slot]) for r in ranks]
    n = len(drifted)
    return {"at_row": drift.at_row, "slot": slot, "column": f"C{slot + 1}", "ranks": drifted.tolist(),
            "ids": hex_ids[:n], "shift": drift.shift,
            "share_of_rows": round(float(np.diff(model.cdfs[slot], prepend=0.0)[drifted].sum()
                                         * (1 - model.missing_rates[slot])), 6),
            "probe_file": PROBE_FILE, "probe_rows_per_id": PROBE_ROWS_PER_ID,
            "probe_p_before": before[:n], "probe_p_after": after[:n],
            "control_ids": hex_ids[n:], "control_p": before[n:]}


def synthesize(out_dir: str | os.PathLike, *, rows: int, eval_rows: int | None = None,
               seed: int = 0, gzip: bool = False, drift: Optional[Drift] = None,
               ids: Optional[int] = None, tail_share: Optional[float] = None) -> SynthSummary:
    """Write train.tsv, eval.tsv (``.tsv.gz`` with ``gzip``) and oracle.json.

    ``eval_rows`` defaults to rows // 10, at least 10,000. The eval file is
    drawn from the same planted model as the train file, with its own
    random streams (after the drift, with ``drift``: see `Drift`). ``ids``:
    about this many distinct IDs in the training file (`Tail`; ValueError
    naming --ids when ``rows`` cannot hold them); ``tail_share`` fixes the
    rare IDs' share of the large slots (`plan_tail`).
    """
    if tail_share is not None and ids is None:
        raise ValueError("--tail-share: only with --ids (the share of the rare IDs that make up --ids)")
    if rows <= 0:
        raise ValueError(f"rows must be positive, got {rows}")
    if eval_rows is None:
        eval_rows = max(rows // 10, 10_000)
    if eval_rows <= 0:
        raise ValueError(f"eval_rows must be positive, got {eval_rows}")
    started = time.perf_counter()
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    suffix = ".tsv.gz" if gzip else ".tsv"
    train_path, eval_path = out / f"train{suffix}", out / f"eval{suffix}"
    model = _build_model(seed)
    tail = plan_tail(model, rows, ids, seed, tail_share) if ids is not None else None
    if tail is not None:
        model.bias = _calibrated_bias(model, _stream(seed, 3, 1), tail)
    planted = _plant_drift(out, model, seed, drift, rows) if drift is not None else None
    shifts = (planted["slot"], np.asarray(planted["ranks"]), drift.shift) if drift is not None else None
    train_labels, train_p = _write_file(train_path, model, seed, 1, rows, gzip,
                                        (drift.at_row, *shifts) if shifts else None, tail)
    eval_labels, eval_p = _write_file(eval_path, model, seed, 2, eval_rows, gzip, (0, *shifts) if shifts else None,
                                      tail)
    oracle = binary_metrics(eval_labels, eval_p)
    oracle_auc, oracle_logloss = oracle["auc"], oracle["logloss"]
    ctr = float(train_labels.mean())
    oracle = {
        "generator_version": GENERATOR_VERSION,
        "seed": seed,
        "train_rows": rows,
        "eval_rows": eval_rows,
        "train_file": train_path.name,
        "eval_file": eval_path.name,
        "ctr": round(ctr, 6),
        "eval_ctr": round(float(eval_labels.mean()), 6),
        "oracle_auc": round(oracle_auc, 6),
        "oracle_logloss": round(oracle_logloss, 6),
        "oracle_auc_train": round(binary_metrics(train_labels, train_p)["auc"], 6),
        **model.describe(),
        **({"drift": planted} if planted is not None else {}),
        **({"ids": tail.describe()} if tail is not None else {}),
    }
    oracle_path = out / "oracle.json"
    oracle_path.write_text(json.dumps(oracle, indent=2) + "\n")
    return SynthSummary(
        out_dir=str(out), train_path=str(train_path), eval_path=str(eval_path),
        oracle_path=str(oracle_path), train_rows=rows, eval_rows=eval_rows, seed=seed,
        ctr=ctr, oracle_auc=oracle_auc, oracle_logloss=oracle_logloss,
        seconds=time.perf_counter() - started, extra=oracle)
