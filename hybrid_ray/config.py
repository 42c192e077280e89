"""Configuration: tier names, modes and the frozen, validated ``ShuffleConfig``.

Only the orchestration layer (``hybrid_ray.shuffle``) reads a ``ShuffleConfig``; tiers and
clients take explicit arguments derived from it, so they stay testable on their own.
"""

from __future__ import annotations

import dataclasses
import numbers
import operator
import os
import tempfile
import uuid
from collections.abc import Mapping, Sequence
from enum import Enum
from typing import Any

from hybrid_ray.errors import ConfigError, UnknownTierError
from hybrid_ray.ids import check_id, glob_characters_in, has_abnormal_component
from hybrid_ray.redaction import redact_url, redacted_options, split_userinfo

KiB = 1024
MiB = 1024 * KiB
GiB = 1024 * MiB


class TierName(str, Enum):
    """Storage tiers in priority order: the write client tries them top to bottom."""

    MEMORY = "memory"
    DISK = "disk"
    REMOTE = "remote"

    @classmethod
    def parse(cls, value: "str | TierName") -> "TierName":
        """Return the tier for ``value`` or raise ``UnknownTierError`` listing valid names."""
        if isinstance(value, TierName):
            return value
        try:
            return cls(str(value).lower())
        except ValueError:
            valid = ", ".join(t.value for t in cls)
            raise UnknownTierError(
                f"unknown tier {value!r}; valid tiers are: {valid}"
            ) from None

    @property
    def priority(self) -> int:
        return list(TierName).index(self)


class ShuffleMode(str, Enum):
    """FLIP-235: ``hybrid`` reducers read while mappers write; ``blocking`` waits for all maps."""

    HYBRID = "hybrid"
    BLOCKING = "blocking"


class Spilling(str, Enum):
    """FLIP-235 spilling strategy.

    ``selective``: the memory tier is used (data spills to disk/remote only when memory is
    full). ``full``: the memory tier is off, every segment is persisted on disk or remote, so
    a reducer can be retried even if the node's object store lost its objects.
    """

    SELECTIVE = "selective"
    FULL = "full"


class Compression(str, Enum):
    """Arrow IPC body compression of a segment."""

    NONE = "none"
    LZ4 = "lz4"
    ZSTD = "zstd"


# Defaults with the reason for each value.
# FLIP-301 uses 320 KiB memory segments and 4 MiB disk/remote segments. Each segment here
# costs a Python-level actor round trip (~1 ms), so memory segments are larger; remote
# segments are larger still because every S3 PUT has ~10-50 ms of latency.
DEFAULT_SEGMENT_BYTES: dict[TierName, int] = {
    TierName.MEMORY: 4 * MiB,
    TierName.DISK: 8 * MiB,
    TierName.REMOTE: 16 * MiB,
}
# FLIP-301's default for taskmanager.network.hybrid-shuffle.local-disk.min-reserve-space-fraction.
DEFAULT_MIN_RESERVE_FRACTION = 0.05
# Ray's object store also holds task inputs/outputs; leaving most of it to Ray avoids
# forcing Ray's own spilling of the data we are shuffling.
DEFAULT_MEMORY_FRACTION = 0.3
# Orphaned shuffle data (its driver died without releasing it) is removed after this long.
DEFAULT_ORPHAN_TTL_S = 6 * 3600.0
# A shuffle in which no map and no reducer finished for this long fails (ShuffleStalledError)
# instead of waiting forever on a hung worker. Generous: a map or reducer of one large block
# through a slow remote store can legitimately take minutes.
DEFAULT_STALL_TIMEOUT_S = 900.0
# A running shuffle's driver heartbeats the master this often (hybrid_ray.shuffle).
DRIVER_HEARTBEAT_S = 5.0
# A shorter orphan TTL would release live shuffles: a heartbeat can be late by a busy
# driver, a slow master call or a GC pause, so the TTL must cover several missed beats.
MIN_ORPHAN_TTL_S = 3 * DRIVER_HEARTBEAT_S
DEFAULT_NAMESPACE = "hybrid_ray"


def default_spill_dir() -> str:
    """The spill directory used when none is configured: a per-user dir under the temp dir.

    The name is predictable, so another user could create it first (in /tmp, anyone may);
    the disk tier therefore refuses it unless it is a real directory owned by this user
    (or root) and its data dir is private (``hybrid_ray.tiers.disk.check_spill_dir``). Not
    ``$XDG_RUNTIME_DIR``: it is a small tmpfs (often 10% of RAM, RAM that the object store
    needs), and it is unset for Ray workers started outside a login session.
    """
    return os.path.join(tempfile.gettempdir(), f"hybrid_ray_spill_{os.getuid()}")


# Bounds of segment and map-chunk sizes (see ShuffleConfig.__post_init__).
MIN_SEGMENT_BYTES = 4 * 1024
MAX_SEGMENT_BYTES = 1 << 30
# The longest wait or TTL taken (about 31 years): beyond it, Ray's millisecond timeouts
# overflow; use a long finite value where "never" is meant.
MAX_DURATION_S = 1e9


def _as_number(value: Any) -> int | float | None:
    """``value`` as a plain int or float if it is a real number (NumPy's too: ``np.int64``,
    ``np.float32``), else None. NumPy numbers were refused as "must be a number, got
    np.float32(0.3)", and one left in the config failed later in the JSON given to the
    JVM shuffle manager. A bool is not a number here. Integers stay ints (never
    ``float(value)``: an int beyond a float's range raised OverflowError)."""
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        return None
    if isinstance(value, numbers.Integral):
        return operator.index(value)
    # np.float16/32/64 too; not a Fraction (the JVM's JSON would refuse it).
    if isinstance(value, float) or type(value).__module__ == "numpy":
        return float(value)
    return None


def require_number(name: str, value: Any, lo: float, hi: float, hi_inclusive: bool) -> float:
    """``value`` as a plain int or float in ``[lo, hi]`` (``[lo, hi)``), NumPy numbers
    taken (see ``_as_number``); else a ConfigError naming ``name``."""
    number = _as_number(value)
    if number is None:
        raise ConfigError(f"{name} must be a number, got {value!r}")
    ok = lo <= number <= hi if hi_inclusive else lo <= number < hi
    if not ok:
        bracket = "]" if hi_inclusive else ")"
        raise ConfigError(f"{name} must be in [{lo}, {hi}{bracket}, got {value!r}")
    # Not float(value): an int beyond a float's range raised OverflowError here, before
    # the caller's _require_at_most could name the field.
    return number


def require_seconds(name: str, value: Any) -> float:
    """``value`` as a positive, finite number of seconds, at most ``MAX_DURATION_S``; else
    a ConfigError naming ``name``. Compared, never converted first: ``math.isfinite`` of
    an int beyond a float's range raised OverflowError instead. NumPy numbers are taken
    (``_as_number``)."""
    number = _as_number(value)
    if number is None or not number > 0 or number == float("inf"):  # NaN fails too
        raise ConfigError(f"{name} must be a positive number of seconds, got {value!r}")
    if number > MAX_DURATION_S:
        raise ConfigError(f"{name} must be at most {MAX_DURATION_S:g} s, got {value!r}: Ray's "
                          "timeouts overflow beyond it")
    return float(number)


def _require_at_most(name: str, value: float, limit: float, why: str) -> None:
    """A number ``require_number`` took, refused above ``limit``."""
    if value > limit:
        raise ConfigError(f"{name} must be at most {limit:g}, got {value!r}: {why}")


def as_int(value: Any) -> int | None:
    """``value`` as a plain int if it is an integer (NumPy's too, via ``__index__``), else
    None. Callers store the plain int: a NumPy integer left in the config failed later, in
    the JSON given to the JVM shuffle manager. A bool is not a size or count."""
    if isinstance(value, bool):
        return None
    try:
        return operator.index(value)
    except TypeError:
        return None


def require_bytes(name: str, value: Any, minimum: int = 0) -> int:
    number = as_int(value)
    if number is None or number < minimum:
        raise ConfigError(
            f"{name} must be an integer number of bytes >= {minimum} "
            f"(use hybrid_ray.MiB/GiB), got {value!r}"
        )
    return number


# Remote-tier transfers in flight per process, at most (``ShuffleConfig.remote_transfers``).
MAX_REMOTE_TRANSFERS = 64


def require_count(name: str, value: Any, minimum: int = 1) -> int:
    number = as_int(value)
    if number is None or number < minimum:
        raise ConfigError(f"{name} must be an integer >= {minimum}, got {value!r}")
    return number


def require_config(what: str, config: Any) -> ShuffleConfig:
    """``config`` if it is a ``ShuffleConfig``, else a ConfigError naming ``what`` and the
    fix (a dict failed with "'dict' object has no attribute 'segment_bytes'")."""
    if not isinstance(config, ShuffleConfig):
        raise ConfigError(f"{what} takes a hybrid_ray.ShuffleConfig, got "
                          f"{type(config).__name__}: build one with ShuffleConfig(...)")
    return config


def refuse_single_spill_dir(spill_dirs: Any) -> None:
    """ConfigError for one path given where a list of spill dirs belongs: iterated, it is
    one directory per character ("/" among them). Every place that takes spill dirs from a
    caller checks this (``ShuffleConfig``, ``DiskTier``, the cleanup sweeps)."""
    if isinstance(spill_dirs, (str, bytes, os.PathLike)):
        raise ConfigError(f"spill_dirs must be a list of directories, got a single path "
                          f"{spill_dirs!r}: write spill_dirs=[{spill_dirs!r}]")


def validate_storage_options(storage_options: Any) -> dict[str, Any]:
    """``storage_options`` as a dict, or ``ConfigError`` naming what is wrong and the fix.
    The one check of every public entry point taking them (``ShuffleConfig``, the cleanup
    sweeps and ``hybrid-ray cleanup --storage-options``): unchecked, a non-mapping
    ``config_kwargs`` or ``client_kwargs`` or a timeout that is no number failed with a
    bare TypeError or ValueError (a traceback from the CLI) before anything was examined.
    The message never quotes a value: the options hold credentials."""
    if not isinstance(storage_options, Mapping) \
            or not all(isinstance(k, str) for k in storage_options):
        raise ConfigError("storage_options must be a mapping of fsspec options with "
                          "string keys, e.g. {'key': ..., 'secret': ...}")
    client_kwargs = storage_options.get("client_kwargs")
    if client_kwargs is not None and not isinstance(client_kwargs, Mapping):
        raise ConfigError("storage_options['client_kwargs'] must be a mapping of the "
                          "storage client's options (e.g. {'endpoint_url': ...}), got "
                          f"{type(client_kwargs).__name__}")
    _check_transfer_timeouts(storage_options)
    return dict(storage_options)


def _check_transfer_timeouts(storage_options: Mapping[str, Any]) -> None:
    """The remote tier bounds each call by ``config_kwargs``' connect and read timeouts
    (``tiers.remote.call_deadline_s``): each must be a positive number of seconds, or a
    bad one failed deep inside the first transfer (or ``hybrid-ray cleanup``) with a bare
    "could not convert string to float"."""
    config_kwargs = storage_options.get("config_kwargs") or {}
    if not isinstance(config_kwargs, Mapping):
        raise ConfigError("storage_options['config_kwargs'] must be a mapping of botocore "
                          f"Config options, got {type(config_kwargs).__name__}")
    for name in ("connect_timeout", "read_timeout"):
        if config_kwargs.get(name) is not None:
            require_seconds(f"storage_options['config_kwargs'][{name!r}]",
                            config_kwargs[name])


@dataclasses.dataclass(frozen=True)
class ShuffleConfig:
    """How a shuffle stores its segments. Every field is validated on construction.

    Attributes:
        memory_fraction: share of each node's Ray object store capacity that the memory
            tier may use, across all concurrent shuffles on the node (0 disables it).
        memory_capacity_bytes: absolute memory-tier budget per node; overrides
            ``memory_fraction`` when set.
        spill_dirs: local directories of the disk tier, on every node. Empty means one
            directory under the system temp dir. ``{node_id}`` in a path is replaced by the
            Ray node id (separate directories for nodes sharing a filesystem).
        min_reserve_fraction: the disk tier refuses a segment when the filesystem's free
            space after writing it would drop below this fraction of its size (FLIP-301).
        disk_capacity_bytes: optional cap on the bytes the disk tier holds per node, for
            the shuffles of one namespace (each namespace has its own tier managers: two
            sharing a spill dir each get the whole cap; ``min_reserve_fraction`` still
            guards the filesystem).
        remote_path: fsspec URL of the remote tier (``s3://bucket/prefix``,
            ``file:///path``); ``None`` disables the remote tier.
        storage_options: passed to fsspec for ``remote_path`` (e.g. ``endpoint_url``,
            ``key``/``secret``; by default s3fs uses the standard AWS credential chain).
        compression: Arrow IPC compression of each segment. Where it does not shrink a
            segment by 10%, the writer sends the next segments uncompressed for a while
            (``hybrid_ray.clients.MIN_COMPRESSION_SAVING``): incompressible data costs no
            compression CPU.
        segment_bytes: target size of a segment per tier; keys are tier names.
        mode: ``hybrid`` or ``blocking`` (see ``ShuffleMode``).
        spilling: ``selective`` or ``full`` (see ``Spilling``).
        memory_weight: this shuffle's weight when concurrent shuffles on a node share the
            memory-tier budget (FLIP-53 fraction-based quota).
        job_id: the JobID level of the remote layout HomePath/JobID/ShuffleID/Subpartition/.
            Defaults to a fresh id per process.
        orphan_ttl_s: data of a shuffle whose driver stopped heartbeating is removed after
            this many seconds; at least ``MIN_ORPHAN_TTL_S`` (3 driver heartbeats).
        namespace: Ray namespace of the shuffle master and tier managers.
        progress: show a progress bar on shuffles.
        max_concurrent_reducers: reducers running at once (None: the cluster's CPU count;
            at most 4 per CPU). Up to one per CPU run in long-lived reader processes kept
            per namespace (``hybrid_ray.actors.ShuffleWorkerActor``); beyond that, in reader
            processes of that shuffle alone, ended with it. Hybrid reducers wait for data
            while maps write, so this also bounds the processes that wait.
        map_chunk_bytes: a map partitions and commits its block in chunks of about
            this size; smaller chunks make data visible to hybrid readers sooner.
        stall_timeout_s: a shuffle in which no map and no reducer finished for this many
            seconds fails with ``ShuffleStalledError`` (its data removed, the stuck
            worker processes restarted) instead of waiting forever. Raise it for maps or
            reducers that legitimately take longer (very large blocks, a slow store).
        memory_pack_bytes: a writer puts the memory-tier segments of one flush (one per
            subpartition) into shared objects of at most this many bytes, each of a few
            neighbouring subpartitions (``hybrid_ray.tiers.memory.pack_members_for``): one
            object-store create and seal per pack, not per segment. A reader on another node pulls a
            segment's whole pack, so None (the default) packs up to 64 MiB while the
            cluster has one node and not at all on more (``hybrid_ray.tiers.memory.
            pack_bytes_for``); 0 never packs.
        remote_transfers: remote-tier transfers each writer or reader process keeps in
            flight while it goes on partitioning or decoding (an object store's latency
            and per-connection bandwidth are hidden by concurrency). A writer holds at most
            this many remote segments in memory until their uploads finish.

    ``job_id`` and ``namespace`` (like shuffle and node ids elsewhere) become directory
    names, so they must match ``hybrid_ray.ids.ID_PATTERN``. ``repr`` hides credentials
    (``hybrid_ray.redaction``).
    """

    memory_fraction: float = DEFAULT_MEMORY_FRACTION
    memory_capacity_bytes: int | None = None
    spill_dirs: Sequence[str] = ()
    min_reserve_fraction: float = DEFAULT_MIN_RESERVE_FRACTION
    disk_capacity_bytes: int | None = None
    remote_path: str | None = None
    storage_options: Mapping[str, Any] = dataclasses.field(default_factory=dict)
    compression: Compression | str = Compression.LZ4
    segment_bytes: Mapping[TierName | str, int] = dataclasses.field(default_factory=dict)
    mode: ShuffleMode | str = ShuffleMode.HYBRID
    spilling: Spilling | str = Spilling.SELECTIVE
    memory_weight: float = 1.0
    job_id: str | None = None
    orphan_ttl_s: float = DEFAULT_ORPHAN_TTL_S
    namespace: str = DEFAULT_NAMESPACE
    progress: bool = True
    max_concurrent_reducers: int | None = None
    map_chunk_bytes: int = 32 * MiB
    remote_transfers: int = 4
    memory_pack_bytes: int | None = None
    stall_timeout_s: float = DEFAULT_STALL_TIMEOUT_S

    def __post_init__(self) -> None:
        set_ = lambda k, v: object.__setattr__(self, k, v)  # noqa: E731 (frozen dataclass)
        # Stored as plain numbers (require_number converts NumPy's).
        set_("memory_fraction",
             require_number("memory_fraction", self.memory_fraction, 0.0, 1.0, True))
        set_("min_reserve_fraction", require_number(
            "min_reserve_fraction", self.min_reserve_fraction, 0.0, 1.0, False))
        # Finite: an infinite weight makes every quota inf/inf = NaN on the node.
        set_("memory_weight", require_number("memory_weight", self.memory_weight, 1e-9,
                                             float("inf"), False))
        _require_at_most("memory_weight", self.memory_weight, 1e9,
                         "weights are relative: 1 is a fair share, 2 twice that")
        ttl = _as_number(self.orphan_ttl_s)
        if ttl is not None and ttl < MIN_ORPHAN_TTL_S:
            raise ConfigError(
                f"orphan_ttl_s must be >= {MIN_ORPHAN_TTL_S:g} s (3 driver heartbeats of "
                f"{DRIVER_HEARTBEAT_S:g} s), got {self.orphan_ttl_s!r}: with a shorter TTL "
                "the master releases live shuffles whose heartbeat is merely late")
        # Finite: the JVM's JSON parser refuses Infinity, which broke every Spark exchange
        # of a session with orphan_ttl_s=inf (never expire: give a long TTL instead).
        set_("orphan_ttl_s", require_number("orphan_ttl_s", self.orphan_ttl_s, MIN_ORPHAN_TTL_S,
                                            float("inf"), True))
        _require_at_most("orphan_ttl_s", self.orphan_ttl_s, MAX_DURATION_S,
                         "use a long finite TTL, e.g. 30 * 86400, where 'never' is meant")
        if self.memory_capacity_bytes is not None:
            set_("memory_capacity_bytes", require_bytes("memory_capacity_bytes",
                                                        self.memory_capacity_bytes))
        if self.disk_capacity_bytes is not None:
            set_("disk_capacity_bytes", require_bytes("disk_capacity_bytes",
                                                      self.disk_capacity_bytes))
        # At least a few KiB: a chunk of a few bytes (someone meaning MiB) made one commit
        # per row, a shuffle that ran for hours or stalled.
        set_("map_chunk_bytes",
             require_bytes("map_chunk_bytes", self.map_chunk_bytes, MIN_SEGMENT_BYTES))
        set_("remote_transfers", require_count("remote_transfers", self.remote_transfers))
        if self.remote_transfers > MAX_REMOTE_TRANSFERS:
            # Each is a thread and (in a writer) a segment held in memory until uploaded:
            # 10**9 was taken, and meant no bound on either.
            raise ConfigError(
                f"remote_transfers must be at most {MAX_REMOTE_TRANSFERS}, got "
                f"{self.remote_transfers!r}: each is an upload thread holding a segment in "
                "memory in every writer and reader process")
        if self.memory_pack_bytes is not None:
            set_("memory_pack_bytes",
                 require_bytes("memory_pack_bytes", self.memory_pack_bytes))
            if self.memory_pack_bytes > GiB:
                raise ConfigError(
                    f"memory_pack_bytes must be at most 1 GiB ({GiB} bytes), got "
                    f"{self.memory_pack_bytes!r}: a reader fetches a segment's whole pack "
                    "(0 turns packing off, None packs on single-node clusters)")
        set_("stall_timeout_s", require_number("stall_timeout_s", self.stall_timeout_s, 1.0,
                                               float("inf"), False))
        _require_at_most("stall_timeout_s", self.stall_timeout_s, MAX_DURATION_S,
                         "Ray's timeouts overflow beyond it")
        if self.max_concurrent_reducers is not None:
            set_("max_concurrent_reducers",
                 require_count("max_concurrent_reducers", self.max_concurrent_reducers))

        refuse_single_spill_dir(self.spill_dirs)
        try:
            dirs = tuple(self.spill_dirs)
        except TypeError:
            raise ConfigError(f"spill_dirs must be a list of directories, e.g. "
                              f"spill_dirs=['/mnt/nvme0'], got {type(self.spill_dirs).__name__}"
                              ) from None
        set_("spill_dirs", tuple(_validate_spill_dir(i, d) for i, d in enumerate(dirs))
             or (default_spill_dir(),))

        for name, enum in (("compression", Compression), ("mode", ShuffleMode),
                           ("spilling", Spilling)):
            value = getattr(self, name)
            try:
                set_(name, enum(value))
            except ValueError:
                valid = ", ".join(e.value for e in enum)
                raise ConfigError(f"{name} must be one of {valid}; got {value!r}") from None

        sizes = dict(DEFAULT_SEGMENT_BYTES)
        if not isinstance(self.segment_bytes, Mapping):
            raise ConfigError(
                "segment_bytes must be a mapping {tier: bytes}, e.g. {'disk': 8 * MiB}"
            )
        given: dict[TierName, Any] = {}  # tier -> its key as given
        for tier, size in self.segment_bytes.items():
            # Bounded both ways: a few bytes (someone meaning MiB) cut one segment per row,
            # millions of files; above 1 GiB the JVM's int sizes wrapped (4 GiB became 0).
            name = TierName.parse(tier)  # before the size: a misspelt tier is named as such
            if name in given:
                # {"disk": 8 * MiB, "DISK": 4096} name one tier: the last one silently won.
                raise ConfigError(
                    f"segment_bytes names the {name.value} tier twice ({given[name]!r} and "
                    f"{tier!r}); give each tier once")
            given[name] = tier
            sizes[name] = require_bytes(f"segment_bytes[{tier!r}]", size, MIN_SEGMENT_BYTES)
            if size > MAX_SEGMENT_BYTES:
                raise ConfigError(f"segment_bytes[{tier!r}] must be at most 1 GiB, got "
                                  f"{size!r}: segments of a few MiB (e.g. 8 * MiB) serve best")
        set_("segment_bytes", sizes)

        set_("storage_options", validate_storage_options(self.storage_options))
        if self.remote_path is not None:
            set_("remote_path", validate_remote_path(self.remote_path))
            if self.remote_path.split("://", 1)[0] == "memory":
                # fsspec's memory filesystem lives inside one process: readers would never
                # see what writers stored, and the data would outlive its release.
                raise ConfigError("remote_path memory://... cannot be a remote tier: it lives "
                                  "inside one process; use a shared store, e.g. "
                                  "file:///mnt/shared/shuffle or s3://bucket/prefix")
        if not isinstance(self.progress, bool):
            raise ConfigError(f"progress must be True or False, got {self.progress!r}")
        if self.job_id is None:
            set_("job_id", _PROCESS_JOB_ID)
        check_id("job_id", self.job_id)
        check_id("namespace", self.namespace)

    def __repr__(self) -> str:
        # Credentials in storage_options or in remote_path never reach a repr (and so no
        # log line, error or report that formats a config).
        parts = []
        for field in dataclasses.fields(self):
            value = getattr(self, field.name)
            if field.name == "remote_path":
                value = redact_url(value)
            elif field.name == "storage_options":
                value = redacted_options(value)
            parts.append(f"{field.name}={value!r}")
        return f"ShuffleConfig({', '.join(parts)})"

    @property
    def enabled_tiers(self) -> tuple[TierName, ...]:
        """The tiers this config writes to, in priority order."""
        tiers = []
        memory_on = (self.memory_capacity_bytes if self.memory_capacity_bytes is not None
                     else self.memory_fraction) > 0
        if memory_on and self.spilling == Spilling.SELECTIVE:
            tiers.append(TierName.MEMORY)
        tiers.append(TierName.DISK)
        if self.remote_path is not None:
            tiers.append(TierName.REMOTE)
        return tuple(tiers)

    def memory_budget(self, object_store_bytes: int) -> int:
        """The memory-tier byte budget on a node whose object store holds this many bytes."""
        if self.memory_capacity_bytes is not None:
            return self.memory_capacity_bytes
        return int(self.memory_fraction * object_store_bytes)

    def spill_dirs_for(self, node_id: str) -> tuple[str, ...]:
        """The spill directories on node ``node_id`` (``{node_id}`` expanded; the node id
        then becomes a directory name, so it is checked like every id)."""
        if any(NODE_ID_PLACEHOLDER in d for d in self.spill_dirs):
            check_id("node_id", node_id)
        return tuple(d.replace(NODE_ID_PLACEHOLDER, node_id) for d in self.spill_dirs)

    def replace(self, **changes: Any) -> "ShuffleConfig":
        """A copy with ``changes`` applied (validated again)."""
        return dataclasses.replace(self, **changes)


_PROCESS_JOB_ID = f"job-{uuid.uuid4().hex[:12]}"
NODE_ID_PLACEHOLDER = "{node_id}"
# Protocols whose first path component is a bucket (or container): it must be given.
_BUCKET_PROTOCOLS = {"s3", "s3a", "gs", "gcs", "abfs", "abfss", "az", "adl", "wasb", "wasbs"}


def _validate_spill_dir(index: int, value: Any) -> str:
    """One ``spill_dirs`` element as an absolute path, or a ConfigError naming it.

    A path that exists here and is not a directory is refused now (the common case: the
    driver's node is a worker too); other nodes' disks are checked by their disk tier
    before the first segment is written there (``hybrid_ray.tiers.disk.check_spill_dir``).
    """
    name = f"spill_dirs[{index}]"
    if isinstance(value, os.PathLike):
        value = os.fspath(value)
    if not isinstance(value, str):
        raise ConfigError(f"{name} must be a directory path (str or os.PathLike of str), "
                          f"got {type(value).__name__} {value!r}")
    if not value.strip():
        raise ConfigError(f"{name} is an empty path; name a directory such as '/mnt/nvme0'")
    if "\0" in value:
        raise ConfigError(f"{name} {value!r} contains a NUL character")
    if value.startswith("~"):
        raise ConfigError(f"{name} {value!r} starts with '~', which is not expanded (it "
                          "would be a directory named '~'): use os.path.expanduser(...)")
    if not os.path.isabs(value):
        raise ConfigError(f"{name} {value!r} is relative: the same path is used on every "
                          "node, where the driver's working directory means nothing; give "
                          "an absolute path (os.path.abspath(...))")
    if NODE_ID_PLACEHOLDER in value and NODE_ID_PLACEHOLDER not in os.path.normpath(value):
        raise ConfigError(f"{name} {value!r} loses its {NODE_ID_PLACEHOLDER} when normalised "
                          "('..' after it): every node would share one directory")
    path = os.path.abspath(value)
    if NODE_ID_PLACEHOLDER not in path and os.path.lexists(path) and not os.path.isdir(path):
        raise ConfigError(f"{name} {path} exists and is not a directory; point spill_dirs "
                          "at a directory (it is created if missing)")
    return path


# Object stores whose bucket is the URL's whole authority: a bucket name never holds "@".
_BUCKET_IS_AUTHORITY = {"s3", "s3a", "gs", "gcs"}


def credentials_in_url_problem(protocol: str, rest: str) -> str:
    """What is wrong with credentials written into a remote URL (``s3://KEY:SECRET@b``),
    or '' if it holds none. s3fs and gcsfs read no credentials from a URL: they take
    ``KEY:SECRET@bucket`` for a bucket name, so every request went to a bucket that cannot
    exist, and the storage's own errors then quoted the secret. (``abfs://container@account``
    is Azure's URL form, not credentials: a user part without a ':' stays allowed there.)"""
    # KEY:SECRET@ (a secret may hold '/', '?' or '@': split_userinfo), or any '@' in a
    # bucket name.
    parts = split_userinfo(f"{protocol}://{rest}")
    if parts is not None and (":" in parts[1] or protocol in _BUCKET_IS_AUTHORITY):
        return ("carries credentials (or an '@') before the bucket; fsspec does not read "
                "credentials from the URL. Write the URL without them, e.g. "
                "s3://bucket/prefix, and pass them as storage_options (for S3: "
                "{'key': ..., 'secret': ...}) or through the environment "
                "(AWS_ACCESS_KEY_ID, AWS_SECRET_ACCESS_KEY)")
    return ""


def validate_remote_path(path: Any) -> str:
    """``path`` as a remote tier's URL (trailing slashes dropped), or ``ConfigError``
    naming what is wrong with it and the fix."""
    import fsspec

    if not isinstance(path, str) or not path.strip():
        raise ConfigError("remote_path must be an fsspec URL such as 's3://bucket/prefix', "
                          f"got {type(path).__name__} {redact_url(path)!r}")
    shown = redact_url(path)
    if "://" in path:
        protocol, rest = path.split("://", 1)
    elif path.startswith("/"):
        protocol, rest = "file", path
    else:
        # "s3:/bucket", "s3:", "bucket/prefix": fsspec would take them as a relative local
        # directory (named "s3:") and a shuffle would "succeed" without its object store.
        raise ConfigError(
            f"remote_path {shown!r} has no protocol and is not an absolute local path; "
            "write it as a URL: s3://bucket/prefix or file:///abs/path")
    credentials = credentials_in_url_problem(protocol, rest)
    if credentials:
        raise ConfigError(f"remote_path {shown!r} {credentials}")
    if "::" in rest:
        # fsspec reads "a::b" as a chain of filesystems and uses only "a" as the path:
        # "file:///tmp/hr::/tmp/other" wrote to /tmp/hr, not where the user pointed.
        raise ConfigError(
            f"remote_path {shown!r} holds '::', which fsspec reads as a chain of URLs and "
            "would store the shuffle somewhere other than the path as written; choose a "
            "path without '::'")
    try:
        fsspec.get_filesystem_class(protocol)
    except ValueError:
        raise ConfigError(
            f"remote_path {shown!r}: fsspec knows no protocol {protocol!r}; "
            "use e.g. s3://bucket/prefix or file:///abs/path"
        ) from None
    except ImportError as exc:
        raise ConfigError(
            f"remote_path {shown!r} needs an extra package for {protocol!r}: {exc}"
        ) from None
    location = rest.split("?", 1)[0].rsplit("@", 1)[-1] if protocol in _BUCKET_PROTOCOLS \
        else rest
    if not location.strip("/"):
        what = "bucket" if protocol in _BUCKET_PROTOCOLS else "path"
        raise ConfigError(
            f"remote_path {shown!r} names no {what}; write e.g. s3://bucket/prefix or "
            "file:///abs/path")
    # For object stores, what follows the credentials, query included (fsspec keeps it
    # in the key).
    literal = rest.rsplit("@", 1)[-1] if protocol in _BUCKET_PROTOCOLS else rest
    if glob_characters_in(literal):
        raise ConfigError(
            f"remote_path {shown!r} holds {glob_characters_in(literal)!r}: fsspec expands "
            "* ? [ ] as wildcards when it deletes, so removing a shuffle could reach other "
            "data. Choose a bucket and prefix without these characters")
    if protocol in ("file", "local") and not location.startswith("/"):
        raise ConfigError(
            f"remote_path {shown!r} is a relative local path; write file:///abs/path "
            "(three slashes) so every node resolves the same directory")
    # Reads and deletes refuse paths with empty, '.' or '..' components (the storage acts
    # on the path as given: see ids.require_normal_remote_path), so such a remote_path
    # wrote segments that could then never be read back.
    if has_abnormal_component(location.rstrip("/").split("?", 1)[0].lstrip("/")):
        raise ConfigError(
            f"remote_path {shown!r} has an empty, '.' or '..' component ('//', '/./' or "
            "'/../'); write the path in its normal form, e.g. s3://bucket/prefix")
    return path.rstrip("/")
