"""spark_bridge.last_report() after a refused call (no Spark session needed)."""
from __future__ import annotations

import pytest

from hybrid_ray.errors import ConfigError


def test_a_refused_bridge_call_leaves_no_report_of_the_exchange_before_it():
    """978c003 made hybrid_ray.last_report() None after a refused call; the bridge's
    last_report() kept returning the previous exchange's report after a refused
    repartition/sort/aggregate/join (bad partitions, unknown column...)."""
    from pyspark.sql import DataFrame

    import spark_bridge
    from spark_bridge import exchange

    class Previous:
        report = "the previous exchange's report"

    df = DataFrame.__new__(DataFrame)  # isinstance passes; refused before Spark is used
    refused = [
        lambda: spark_bridge.repartition(df, 0, "k"),
        lambda: spark_bridge.repartition(df, 4),
        lambda: spark_bridge.sort(df),
        lambda: spark_bridge.aggregate(df, [], {"n": ("*", "count")}),
        lambda: spark_bridge.join(df, df, []),
    ]
    for call in refused:
        exchange._last.shuffle = Previous()
        assert spark_bridge.last_report() == Previous.report
        with pytest.raises(ConfigError):
            call()
        assert spark_bridge.last_report() is None
