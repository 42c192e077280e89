"""hybrid_ray: a tiered hybrid shuffle for Ray (memory > local disk > remote object store)."""

from hybrid_ray.clients import ReadClient, WriteClient, WriteStats
from hybrid_ray.config import (
    GiB, KiB, MiB, Compression, ShuffleConfig, ShuffleMode, Spilling, TierName,
)
from hybrid_ray.errors import (
    ActorStartError, ConfigError, CorruptSegmentError, HybridRayError, InputChangedError,
    OutOfSpaceError, RemoteTierError, SegmentNotFoundError, ShuffleFailedError,
    ShuffleMasterLostError, ShuffleNotFoundError, ShuffleReleasedError, ShuffleStalledError,
    UnknownTierError,
)
from hybrid_ray.segment import SegmentId, SegmentMeta, decode_segment, encode_segment
from hybrid_ray.tier_manager import TierManager, build_io_tiers

__all__ = [
    "ActorStartError", "Compression", "ConfigError", "CorruptSegmentError", "GiB",
    "HybridRayError", "InputChangedError", "KiB", "MiB",
    "OutOfSpaceError", "ReadClient", "RemoteTierError", "SegmentId", "SegmentMeta",
    "SegmentNotFoundError", "ShuffleConfig", "ShuffleFailedError", "ShuffleMasterLostError",
    "ShuffleMode",
    "ShuffleNotFoundError", "ShuffleReleasedError", "ShuffleStalledError", "Spilling",
    "TierManager", "TierName", "UnknownTierError",
    "WriteClient", "WriteStats", "build_io_tiers", "decode_segment", "encode_segment",
]

from hybrid_ray.partitioning import (  # noqa: E402
    HashPartitioner, MultiKeyRangePartitioner, Partitioner, RandomPartitioner,
    RangePartitioner,
)
from hybrid_ray.report import ShuffleReport  # noqa: E402
from hybrid_ray.session import init  # noqa: E402
from hybrid_ray.shuffle import (  # noqa: E402
    ShuffleResult, last_report, random_shuffle, repartition, report_of, run_shuffle, sort,
)

__all__ += [
    "HashPartitioner", "MultiKeyRangePartitioner", "Partitioner", "RandomPartitioner",
    "RangePartitioner", "ShuffleReport",
    "ShuffleResult", "init", "last_report", "random_shuffle", "repartition", "report_of",
    "run_shuffle", "sort",
]
