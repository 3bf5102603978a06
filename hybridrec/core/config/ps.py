"""The embedding PS: capacity, stripes, initialisation, the rows' lifecycle, the disk tier."""
from __future__ import annotations

import enum
from typing import Annotated, Literal

from pydantic import Field, model_validator

from hybridrec.core.wire.ids import MAX_GROUPS
from hybridrec.core.config.section import Section


class WeightStorage(str, enum.Enum):
    """How a store keeps its rows' weights (`ps.storage`); the optimizer state stays float32 either way."""

    FP32 = "fp32"  # float32, as always
    FP16 = "fp16"  # IEEE half, updated in float32 and written back with stochastic rounding
    BF16 = "bf16"  # bfloat16 (8 exponent bits, 7 of mantissa), likewise

    def __str__(self) -> str:  # the name alone in messages
        return self.value


class InitConfig(Section):
    """How the PS initialises a row it has not seen before (deterministic in training.seed and the ID)."""

    distribution: Literal["uniform", "normal"] = "uniform"
    """uniform(-scale, scale) or normal(0, scale)."""
    scale: Annotated[float, Field(ge=0)] = 0.01
    """Half-width (uniform) or standard deviation (normal) of a new row."""


class TableLifecycleConfig(Section):
    """One table's own lifecycle settings (a table is a feature group); an unset key takes `ps.lifecycle`'s."""

    admit_after: Annotated[int, Field(ge=1, le=255)] | None = None
    """Occurrences before this table's IDs get a row (None: `ps.lifecycle.admit_after`)."""
    ttl_steps: Annotated[int, Field(gt=0)] | None = None
    """Training steps without an update after which this table's rows expire (None: `ps.lifecycle.ttl_steps`)."""
    ttl_s: Annotated[float, Field(gt=0)] | None = None
    """Seconds without an update after which this table's rows expire (None: `ps.lifecycle.ttl_s`)."""


class LifecycleConfig(Section):
    """Which IDs get a row and how long a row lives, per table (docs/architecture.md#embedding-lifecycle).

    The defaults (admit at once, no expiry) keep every ID the PS sees until LRU capacity evicts it; no sketch
    and no per-row stamps are allocated then.
    """

    admit_after: Annotated[int, Field(ge=1, le=255)] = 1
    """Occurrences an ID needs (training batches that look it up, counted in a count-min sketch on its PS
    shard) before it gets a row; until then it reads zeros and its gradients are dropped. 1: at once (no
    sketch). `ps.admit_probability` is drawn after this count is reached."""
    ttl_steps: Annotated[int, Field(gt=0)] | None = None
    """Rows not updated for this many training steps are removed (None: no step limit). The PS counts steps
    as the updates it applied divided by the number of NN workers (one update per NN worker per step)."""
    ttl_s: Annotated[float, Field(gt=0)] | None = None
    """Rows not updated for this many seconds are removed (None: no time limit)."""
    tables: dict[Annotated[int, Field(ge=0, lt=MAX_GROUPS)], TableLifecycleConfig] = Field(default_factory=dict)
    """Per-table overrides, keyed by feature group (`features[].group`), e.g. `{4: {admit_after: 3}}`."""
    sketch_width: Annotated[int, Field(ge=1024, le=1 << 31)] = 1 << 22
    """Counters per sketch row of each store (one store per width per shard); the sketch takes
    sketch_width x sketch_depth bytes (one-byte counters) whatever the number of IDs."""
    sketch_depth: Annotated[int, Field(ge=1, le=8)] = 4
    """Rows (hash functions) of the count-min sketch: an ID's count is the smallest of its counters."""
    sketch_window: Annotated[int, Field(gt=0)] | None = None
    """Occurrences counted in a store's sketch after which every counter is halved, so that the sketch follows
    the recent stream instead of filling up: an ID needs its admit_after occurrences within about this many
    (None: sketch_width, which keeps the share of once-seen IDs admitted by collisions near 5 %)."""
    sweep_interval_s: Annotated[float, Field(gt=0)] = 1.0
    """With a TTL: seconds between two sweeps that remove expired rows (a row may outlive its TTL by this)."""

    def admit_after_of(self, group: int) -> int:
        """The occurrence threshold of table `group`."""
        own = self.tables.get(group)
        return own.admit_after if own is not None and own.admit_after is not None else self.admit_after

    def ttl_of(self, group: int) -> tuple[int | None, float | None]:
        """(ttl_steps, ttl_s) of table `group`."""
        own = self.tables.get(group) or TableLifecycleConfig()
        return (own.ttl_steps if own.ttl_steps is not None else self.ttl_steps,
                own.ttl_s if own.ttl_s is not None else self.ttl_s)


class TierConfig(Section):
    """A disk tier under each store (docs/architecture.md#disk-tier): the store's memory holds the recently used
    rows, a file on disk every row it evicted, so a table larger than the PS's memory forgets nothing."""

    dir: str
    """Directory on a disk (not tmpfs) of the tier's files (`shard-NNNNN/dim-D/`); each store's tier is
    preallocated sparse, so this filesystem must have room for `capacity` rows of every width."""
    capacity: Annotated[int, Field(gt=0)]
    """Rows per shard per embedding width the disk tier holds: every distinct ID the shard may see. Must be
    larger than `ps.capacity` (the rows in memory)."""


class PSConfig(Section):
    """The embedding parameter server: one store per embedding width on every shard."""

    capacity: Annotated[int, Field(gt=0)] = 2_000_000
    """Rows per shard per embedding width; the least recently used row is evicted beyond it."""
    shm_dir: str = "/dev/shm/hybridrec"
    """Directory of the store's mmap'd files (`shard-NNNNN/`) and of each embedding worker's batch buffer
    (`embedding-worker-NNNNN/`); a restarted PS or embedding worker re-attaches to its own."""
    worker_buffer_bytes: Annotated[int, Field(gt=0)] = 1 << 30
    """The most bytes of batches an embedding worker keeps in its buffer under `shm_dir` (their frames, until
    consumed). Past it a data loader's PutBatch is answered UNAVAILABLE, which the data loader retries for
    `cluster.retry_s` while the NN workers consume batches: back-pressure, not a failure. A batch alone always
    fits. Normally far from it: the staleness bound and prefetch keep a few batches per NN worker in flight."""
    num_stripes: Annotated[int, Field(ge=1, le=1024)] = 16
    """Independently locked parts of each store (parallelism across request threads)."""
    admit_probability: Annotated[float, Field(gt=0, le=1)] = 1.0
    """Chance that a training lookup of a new ID inserts it, drawn once the ID has its `lifecycle.admit_after`
    occurrences (at once by default); each later lookup draws again, so an ID gets in after about 1/p of them."""
    storage: WeightStorage = WeightStorage.FP32
    """Weights of every store: fp32, or fp16 / bf16 (two weights a float32 word, updated in float32 and written
    back with stochastic rounding; with `optimizer.embedding.name: rowwise_adagrad` a row of width 16 is 36
    bytes instead of 128). Recorded in the store's files and checkpoints (docs/architecture.md#compact-rows)."""
    weight_bound: Annotated[float, Field(gt=0)] | None = None
    """Clip embedding weights to [-bound, bound] after each update (None: no clipping)."""
    init: InitConfig = Field(default_factory=InitConfig)
    """Initialisation of new rows."""
    threads: Annotated[int, Field(ge=1, le=64)] = 2
    """Request threads running the store's kernels."""
    keep_shm: bool = False
    """Keep the store and buffer files after `hybridrec run` ends (they are removed by default)."""
    lifecycle: LifecycleConfig = Field(default_factory=LifecycleConfig)
    """Admission after k occurrences and expiry by age (TTL), per table."""
    replicas: Annotated[int, Field(ge=1, le=2)] = 1
    """Copies of each shard. 2: PS process i also keeps a backup of shard i-1 (of the next lower index, the last
    shard's on PS 0); every update is applied on both before it is acknowledged, and a shard that loses its
    store copies it back from its backup, losing nothing (services/embedding_ps/replica.py). Doubles the PS
    memory; needs at least two PS shards."""
    tier: TierConfig | None = None
    """A disk tier under the stores (None: memory only, and a row evicted past `capacity` is forgotten)."""

    @model_validator(mode="after")
    def _tier_fits(self) -> "PSConfig":
        if self.tier is None:
            return self
        if self.tier.capacity <= self.capacity:
            raise ValueError(f"ps.tier.capacity ({self.tier.capacity}) must be larger than ps.capacity "
                             f"({self.capacity}), the rows kept in memory")
        life = self.lifecycle
        if life.ttl_steps is not None or life.ttl_s is not None or any(
                t.ttl_steps is not None or t.ttl_s is not None for t in life.tables.values()):
            raise ValueError("ps.tier cannot be used with ps.lifecycle TTLs (ttl_steps, ttl_s) yet: rows on disk "
                             "carry no update time")
        if self.replicas > 1:
            raise ValueError("ps.tier cannot be used with ps.replicas: 2 yet (a backup copies rows in memory only)")
        return self
