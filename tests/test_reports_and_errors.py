"""What a user reads: the report of each shuffle (also across threads) and errors whose
first words are the cause, not a remote traceback."""

from __future__ import annotations

import threading

import numpy as np
import pyarrow as pa
import pytest

import hybrid_ray
from conftest import base_config
from hybrid_ray import HashPartitioner, ShuffleFailedError


def test_concurrent_shuffles_each_see_their_own_report(ray_local, tmp_path):
    ray = ray_local
    sizes = [1_000, 2_000, 3_000, 4_000]
    seen: dict[int, tuple] = {}
    errors: list[BaseException] = []
    start = threading.Barrier(len(sizes))

    def run(rows):
        try:
            ds = ray.data.from_arrow(pa.table({"key": np.arange(rows) % 7, "v": np.arange(rows)}))
            start.wait(timeout=60)
            out = hybrid_ray.repartition(ds, 3, keys=["key"], config=base_config(tmp_path))
            seen[rows] = (hybrid_ray.last_report().rows, hybrid_ray.report_of(out).rows,
                          hybrid_ray.last_report().shuffle_id,
                          hybrid_ray.report_of(out).shuffle_id)
        except BaseException as exc:  # noqa: BLE001 - re-raised in the test thread
            errors.append(exc)

    threads = [threading.Thread(target=run, args=(n,)) for n in sizes]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=300)
    assert not errors, errors
    for rows in sizes:
        last_rows, own_rows, last_id, own_id = seen[rows]
        assert last_rows == own_rows == rows
        assert last_id == own_id
    assert len({seen[n][3] for n in sizes}) == len(sizes)


def test_report_of_a_dataset_that_no_shuffle_made_is_explained(ray_local):
    with pytest.raises(hybrid_ray.ConfigError, match="not produced by a hybrid_ray shuffle"):
        hybrid_ray.report_of(ray_local.data.range(3))


def test_report_of_survives_materialize_but_not_a_transformation(ray_local, tmp_path):
    """``.materialize()`` of the result (a habit: the result is materialized already) is a
    new Dataset of the same blocks in Ray 2.60, and report_of refused it as "not produced
    by a hybrid_ray shuffle" (found by a review). A transformed one is still refused."""
    ds = ray_local.data.from_arrow(pa.table({"key": np.arange(500) % 7, "v": np.arange(500)}))
    out = hybrid_ray.repartition(ds, 3, keys=["key"], config=base_config(tmp_path))
    again = out.materialize()
    assert again is not out
    assert hybrid_ray.report_of(again) is hybrid_ray.report_of(out)
    assert hybrid_ray.report_of(again.materialize()).rows == 500
    with pytest.raises(hybrid_ray.ConfigError, match="not produced by a hybrid_ray shuffle"):
        hybrid_ray.report_of(again.map_batches(lambda b: b).materialize())


def test_report_of_an_empty_result_survives_materialize(ray_local, tmp_path):
    """The README promises report_of(result) also after ``result.materialize()``; for a
    dataset with no rows (no shuffle ran, empty blocks of its schema) it raised "not
    produced by a hybrid_ray shuffle" instead."""
    ds = ray_local.data.from_arrow(pa.table({"key": pa.array([], pa.int64())}))
    out = hybrid_ray.repartition(ds, 3, keys=["key"], config=base_config(tmp_path))
    report = hybrid_ray.report_of(out.materialize())
    assert report is hybrid_ray.report_of(out)
    assert report.rows == 0 and report.num_partitions == 3
    # What was printed began "shuffle  (repartition, ...)" with no id and no word of why.
    assert "note: the dataset has no rows: no shuffle ran" in report.table()



def test_a_refused_call_leaves_no_report_of_the_shuffle_before_it(ray_local, tmp_path):
    """A call refused before it starts (an unknown column, a bad partitioner) is the most
    recent call too: last_report() kept returning the previous shuffle's report."""
    ray = ray_local
    table = pa.table({"key": np.arange(100)})
    ds = ray.data.from_arrow(table)
    refused = [
        lambda: hybrid_ray.run_shuffle([ray.put(table)], 2, "key", table.schema,
                                       base_config(tmp_path)),
        lambda: hybrid_ray.repartition(ds, 2, keys=["nope"], config=base_config(tmp_path)),
        lambda: hybrid_ray.sort(ds, "nope", config=base_config(tmp_path)),
        lambda: hybrid_ray.random_shuffle(ds, num_partitions=0,
                                          config=base_config(tmp_path)),
    ]
    for call in refused:
        hybrid_ray.repartition(ds, 2, keys=["key"], config=base_config(tmp_path))
        assert hybrid_ray.last_report().rows == 100
        with pytest.raises(hybrid_ray.ConfigError):
            call()
        assert hybrid_ray.last_report() is None

class FailsInMapOne(HashPartitioner):
    def assign(self, table, map_index, num_partitions):
        if map_index == 1:
            raise ValueError("the key column holds a value the job cannot handle")
        return super().assign(table, map_index, num_partitions)


def test_a_failed_shuffle_says_its_cause_first_and_attaches_the_traceback(ray_local,
                                                                          tmp_path):
    ray = ray_local
    table = pa.table({"key": np.arange(1000)})
    ok = hybrid_ray.run_shuffle([ray.put(table)], 2, hybrid_ray.HashPartitioner(["key"]),
                                table.schema, base_config(tmp_path))
    assert hybrid_ray.last_report() is ok.report
    with pytest.raises(ShuffleFailedError) as info:
        hybrid_ray.run_shuffle([ray.put(table), ray.put(table)], 2, FailsInMapOne(["key"]),
                               table.schema, base_config(tmp_path))
    # The failed shuffle is the most recent: not the one before it (a review found
    # last_report() still returning that one's report).
    assert hybrid_ray.last_report() is None
    message = str(info.value)
    first_line = message.splitlines()[0]
    assert "ValueError: the key column holds a value the job cannot handle" in first_line
    assert 'File "' not in message and len(message.splitlines()) == 1, message
    # The remote traceback is attached, not pasted.
    assert isinstance(info.value.__cause__, ray.exceptions.RayTaskError)
    assert 'File "' in str(info.value.__cause__) and "in assign" in str(info.value.__cause__)


def test_a_failed_bridge_shuffle_whose_release_fails_says_so_instead_of_hiding_it(
        monkeypatch):
    """Was: the bridge's release of a failed shuffle swallowed its own failure silently
    (the data then stayed until the orphan TTL with nothing telling the user)."""
    from spark_bridge import exchange

    def master_gone(shuffle_id, reason="", failed=False):
        raise ConnectionError("the shuffle master is unreachable")

    monkeypatch.setattr(exchange, "release", master_gone)
    left = exchange._release_failed("spk-0123456789ab", "its map stage failed: boom")
    assert "could not be removed now: ConnectionError: the shuffle master is unreachable" \
        in left
    assert "orphan_ttl_s" in left and "hybrid-ray cleanup" in left
    monkeypatch.setattr(exchange, "release", lambda *a, **k: True)
    assert exchange._release_failed("spk-0123456789ab", "boom") == ""


def test_a_call_that_fails_after_its_shuffle_leaves_no_report(ray_local, tmp_path,
                                                              monkeypatch):
    """The shuffle ran and set its report; the Dataset around its blocks then failed to
    build (its block stats could not be got): the call failed, so no report stands."""
    from hybrid_ray import shuffle

    ds = ray_local.data.from_arrow(pa.table({"key": np.arange(100)}))

    def broken(*_args):
        raise RuntimeError("block stats lost")

    monkeypatch.setattr(shuffle, "_materialized_dataset", broken)
    with pytest.raises(RuntimeError, match="block stats lost"):
        hybrid_ray.repartition(ds, 2, keys=["key"], config=base_config(tmp_path))
    assert hybrid_ray.last_report() is None
