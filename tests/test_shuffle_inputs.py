"""Careless and hostile inputs to the shuffle driver (issue 14 items 4, 5, 8, 15, 16):
equal keys in different representations, empty and column-less data, unbounded work, bad
seeds and partition counts, blocks of different schemas, sort keys with nulls."""

from __future__ import annotations

import collections
import time

import numpy as np
import pyarrow as pa
import pytest

import hybrid_ray
from conftest import assert_no_leftovers, base_config, row_fingerprint
from hybrid_ray import ConfigError

MAX_PARTITIONS = 100_000  # hybrid_ray.shuffle.MAX_PARTITIONS, the documented limit


def outputs(ray_mod, ds) -> list[pa.Table]:
    return ray_mod.get(ds.to_arrow_refs())


def key_partitions(parts: list[pa.Table], column: str) -> dict:
    """Each distinct value of ``column`` (as Python sees it: -0.0 == 0.0) and the output
    partitions it was found in."""
    seen = collections.defaultdict(set)
    for i, part in enumerate(parts):
        for value in part[column].to_pylist():
            seen[value].add(i)
    return seen


# ---- item 4: equal keys, different representations, one partition ----------------------------
def test_group_by_after_repartition_is_exact_with_mixed_representations(ray_local, tmp_path):
    rng = np.random.default_rng(4)
    names = [f"customer-{i}" for i in range(50)]
    n = 2_000

    def block(seed_offset: int, dictionary: bool, negative_zero: bool) -> pa.Table:
        picks = rng.integers(0, len(names), n)
        key = pa.array([names[i] for i in picks])
        amount = np.where(picks % 5 == 0, -0.0 if negative_zero else 0.0, picks / 4.0)
        return pa.table({"key": key.dictionary_encode() if dictionary else key,
                         "amount": amount,
                         "row": np.arange(seed_offset, seed_offset + n)})

    blocks = [block(0, True, True), block(n, False, False), block(2 * n, True, False),
              block(3 * n, False, True)]
    ds = ray_local.data.from_arrow(blocks).materialize()
    assert ds.num_blocks() == 4
    cfg = base_config(tmp_path)
    plain = pa.concat_tables([b.cast(blocks[1].schema) for b in blocks])
    for keys, column in ((["key"], "key"), (["amount"], "amount")):
        parts = outputs(ray_local, hybrid_ray.repartition(ds, 7, keys=keys, config=cfg))
        # Every key value in exactly one partition: a per-partition group-by is exact.
        spread = {k: p for k, p in key_partitions(parts, column).items() if len(p) > 1}
        assert not spread, spread
        got = pa.concat_tables([p.cast(plain.schema) for p in parts])
        assert row_fingerprint([got]) == row_fingerprint([plain])
        # The group-by: count per key within each partition, then put the partitions'
        # groups together; each key's count must be whole (Python: -0.0 == 0.0).
        groups: dict = {}
        for part in parts:
            for k, c in collections.Counter(part[column].to_pylist()).items():
                assert k not in groups, f"{k!r} grouped in two partitions"
                groups[k] = c
        assert groups == collections.Counter(plain[column].to_pylist())
    assert_no_leftovers(cfg, ray_local)


# ---- item 5: no columns, no rows --------------------------------------------------------------
def test_run_shuffle_refuses_blocks_without_columns(ray_local):
    rows_no_columns = pa.table({"x": pa.nulls(5)}).drop_columns(["x"])
    assert rows_no_columns.num_rows == 5
    with pytest.raises(ConfigError, match="no columns"):
        hybrid_ray.run_shuffle([ray_local.put(rows_no_columns)], 2,
                               hybrid_ray.RandomPartitioner(1), rows_no_columns.schema)


def test_a_dataset_filtered_to_no_rows_shuffles_to_an_empty_result(ray_local, tmp_path):
    cfg = base_config(tmp_path)
    base = ray_local.data.range(100, override_num_blocks=3)
    unknown = base.filter(lambda row: False).materialize()  # Ray Data keeps no schema
    for out in (hybrid_ray.repartition(unknown, 3, keys=["id"], config=cfg),
                hybrid_ray.sort(unknown, "id", config=cfg),
                hybrid_ray.random_shuffle(unknown, seed=1, config=cfg)):
        assert out.count() == 0
    known = base.filter(expr="id > 1000").materialize()
    assert known.schema() is not None
    out = hybrid_ray.repartition(known, 3, keys=["id"], config=cfg)
    parts = outputs(ray_local, out)
    assert len(parts) == 3 and all(p.num_rows == 0 for p in parts)
    assert out.count() == 0 and out.schema().names == ["id"]
    assert [p.schema.names for p in parts] == [["id"]] * 3
    assert hybrid_ray.sort(known, "id", descending=True, config=cfg).count() == 0
    assert hybrid_ray.random_shuffle(known, config=cfg, num_partitions=2).count() == 0
    # Its report says no rows moved (last_report() kept the previous shuffle's, and
    # report_of refused the result as "not produced by a hybrid_ray shuffle").
    hybrid_ray.repartition(base, 2, keys=["id"], config=cfg)
    assert hybrid_ray.last_report().rows == 100
    empty = hybrid_ray.sort(known, "id", config=cfg, num_partitions=4)
    report = hybrid_ray.report_of(empty)
    assert hybrid_ray.last_report() is report
    assert (report.operation, report.rows, report.num_maps, report.num_partitions) == \
        ("sort", 0, 0, 4)
    assert sum(report.bytes_per_tier().values()) == 0
    with pytest.raises(ConfigError, match=r"unknown column\(s\) \['nope'\]; the dataset has "
                                          r"columns \['id'\]"):
        hybrid_ray.repartition(known, 3, keys=["nope"], config=cfg)


# ---- item 8: unbounded work -------------------------------------------------------------------
def test_num_partitions_above_the_limit_is_refused(ray_local):
    ds = ray_local.data.range(10)
    for call in (lambda: hybrid_ray.repartition(ds, 10**7, keys=["id"]),
                 lambda: hybrid_ray.sort(ds, "id", num_partitions=10**7),
                 lambda: hybrid_ray.random_shuffle(ds, num_partitions=MAX_PARTITIONS + 1)):
        with pytest.raises(ConfigError, match=f"limit of {MAX_PARTITIONS}"):
            call()
    from hybrid_ray.shuffle import check_num_partitions

    check_num_partitions(MAX_PARTITIONS)  # the limit itself is fine


def _alive_workers(ray_mod) -> list[str]:
    """Ids of the alive writer and reader actors, from the GCS (the state API needs the
    dashboard, which the test cluster does not run)."""
    from ray._private.state import actors

    return sorted(actor_id for actor_id, info in actors().items()
                  if info["ActorClassName"] == "ShuffleWorkerActor"
                  and info["State"] == "ALIVE")


def test_max_concurrent_reducers_above_four_per_cpu_is_refused(ray_local, tmp_path):
    cpus = int(ray_local.cluster_resources()["CPU"])
    ds = ray_local.data.range(100)
    with pytest.raises(ConfigError, match=f"max_concurrent_reducers=1000000 .* at most "
                                          f"{4 * cpus}"):
        hybrid_ray.repartition(ds, 4, keys=["id"],
                               config=base_config(tmp_path, max_concurrent_reducers=10**6))


def test_reducers_beyond_the_cpus_end_with_their_shuffle(ray_local, tmp_path):
    cpus = int(ray_local.cluster_resources()["CPU"])
    table = pa.table({"key": np.arange(60_000) % 997, "v": np.arange(60_000)})
    ds = ray_local.data.from_arrow(table).repartition(4).materialize()
    cfg = base_config(tmp_path, max_concurrent_reducers=cpus)
    hybrid_ray.repartition(ds, 2, keys=["key"], config=cfg)  # start the kept workers
    before = _alive_workers(ray_local)
    cfg = base_config(tmp_path, max_concurrent_reducers=3 * cpus)
    out = hybrid_ray.repartition(ds, 12, keys=["key"], config=cfg)
    deadline = time.time() + 30
    while _alive_workers(ray_local) != before and time.time() < deadline:
        time.sleep(0.2)
    assert _alive_workers(ray_local) == before
    # The output blocks outlive the reader processes that made them.
    assert row_fingerprint(outputs(ray_local, out)) == row_fingerprint([table])
    assert_no_leftovers(cfg, ray_local)


def test_tiny_blocks_are_grouped_into_few_maps_and_shuffle_exactly(ray_local, tmp_path):
    tables = [pa.table({"key": [i % 13], "v": [i]}) for i in range(2_000)]
    ds = ray_local.data.from_arrow(tables).materialize()
    assert ds.num_blocks() == 2_000
    cfg = base_config(tmp_path)
    started = time.monotonic()
    parts = outputs(ray_local, hybrid_ray.repartition(ds, 3, keys=["key"], config=cfg))
    elapsed = time.monotonic() - started
    assert row_fingerprint(parts) == row_fingerprint(tables)
    report = hybrid_ray.last_report()
    assert report.rows == 2_000 and report.num_maps <= 32, report.num_maps
    assert elapsed < 60, elapsed
    # A seeded random shuffle of the same blocks is exact and reproducible too.
    a = pa.concat_tables(outputs(ray_local, hybrid_ray.random_shuffle(ds, seed=3, config=cfg)))
    b = pa.concat_tables(outputs(ray_local, hybrid_ray.random_shuffle(ds, seed=3, config=cfg)))
    assert a.equals(b) and row_fingerprint([a]) == row_fingerprint(tables)
    assert hybrid_ray.last_report().num_maps <= 32
    assert_no_leftovers(cfg, ray_local)


# ---- item 15: seeds and partition counts ------------------------------------------------------
def test_bad_seeds_and_zero_partitions_are_refused_before_any_work(ray_local):
    ds = ray_local.data.range(10)
    for seed in (-1, 2**63, True, 1.5, "7"):
        with pytest.raises(ConfigError, match=r"seed must be None or an integer with "
                                              r"0 <= seed < 2\*\*63"):
            hybrid_ray.random_shuffle(ds, seed=seed)
    with pytest.raises(ConfigError, match="num_partitions must be a positive integer, got 0"):
        hybrid_ray.random_shuffle(ds, num_partitions=0)
    with pytest.raises(ConfigError, match="num_partitions must be a positive integer, got 0"):
        hybrid_ray.sort(ds, "id", num_partitions=0)
    with pytest.raises(ConfigError, match="num_partitions must be a positive integer, got -2"):
        hybrid_ray.sort(ds, "id", num_partitions=-2)


def test_numpy_integer_partition_counts_and_seeds_are_taken(ray_local, tmp_path):
    """A partition count or seed computed with NumPy (``np.int64``) is an integer: it was
    refused as "num_partitions must be a positive integer, got np.int64(3)"."""
    cfg = base_config(tmp_path)
    table = pa.table({"k": np.arange(200) % 17, "v": np.arange(200)})
    ds = ray_local.data.from_arrow(table).materialize()
    for call in (lambda n: hybrid_ray.repartition(ds, n, ["k"], config=cfg),
                 lambda n: hybrid_ray.sort(ds, "k", config=cfg, num_partitions=n),
                 lambda n: hybrid_ray.random_shuffle(ds, seed=np.uint32(4), config=cfg,
                                                     num_partitions=n)):
        parts = outputs(ray_local, call(np.int64(3)))
        assert len(parts) == 3 and row_fingerprint(parts) == row_fingerprint([table])
        assert type(hybrid_ray.last_report().num_partitions) is int
    same = outputs(ray_local, hybrid_ray.random_shuffle(ds, seed=4, config=cfg,
                                                        num_partitions=3))
    assert pa.concat_tables(parts).equals(pa.concat_tables(same))  # the seed's own result
    for bad in (np.int64(0), np.bool_(True), np.float64(3.0)):
        with pytest.raises(ConfigError, match="num_partitions must be a positive integer"):
            hybrid_ray.sort(ds, "k", config=cfg, num_partitions=bad)
    with pytest.raises(ConfigError, match="seed must be None or an integer"):
        hybrid_ray.random_shuffle(ds, seed=np.int64(-1), config=cfg)
    assert_no_leftovers(cfg, ray_local)


def test_largest_seed_works(ray_local, tmp_path):
    table = pa.table({"v": np.arange(1000)})
    ds = ray_local.data.from_arrow(table)
    out = hybrid_ray.random_shuffle(ds, seed=2**63 - 1, config=base_config(tmp_path))
    assert row_fingerprint(outputs(ray_local, out)) == row_fingerprint([table])


# ---- item 16: schemas that differ, sort keys with nulls --------------------------------------
def test_blocks_with_different_schemas_are_refused_before_the_shuffle(ray_local, tmp_path):
    from hybrid_ray.actors import get_master

    cfg = base_config(tmp_path)
    a = pa.table({"id": pa.array([1, 2], pa.int64()), "v": ["a", "b"]})
    b = pa.table({"id": pa.array([3], pa.int32()), "v": ["c"]})
    ds = ray_local.data.from_arrow([a, b]).materialize()
    master = get_master(cfg.namespace)
    registered = ray_local.get(master.status.remote())["shuffles"]
    for call in (lambda: hybrid_ray.repartition(ds, 2, keys=["v"], config=cfg),
                 lambda: hybrid_ray.sort(ds, "v", config=cfg),
                 lambda: hybrid_ray.random_shuffle(ds, config=cfg)):
        with pytest.raises(ConfigError) as err:
            call()
        message = str(err.value)
        assert "different schemas" in message and "id: int32 vs id: int64" in message
        assert "block 1" in message and "block 0" in message and "Cast" in message
    assert ray_local.get(master.status.remote())["shuffles"] == registered  # none started
    # run_shuffle on raw block refs: the map that gets the odd block refuses it, by name.
    with pytest.raises(ConfigError, match=r"different schemas: input block \d of map \d "
                                          r"differs .* id: int32 vs id: int64"):
        hybrid_ray.run_shuffle([ray_local.put(a), ray_local.put(b)], 2,
                               hybrid_ray.HashPartitioner(["v"]), a.schema, cfg)
    assert_no_leftovers(cfg, ray_local)


def _put_as_ipc(ray_mod, monkeypatch, table: pa.Table):
    """A ref to ``table``, stored as Arrow IPC bytes: Ray's own Arrow serializer looks
    columns up by name and refuses a table with a repeated one, but such a table reaches
    the store another way (RAY_DISABLE_CUSTOM_ARROW_DATA_SERIALIZATION=1, a serializer of
    the user's own). Only this put uses it."""
    from ray import cloudpickle

    def read(data: bytes) -> pa.Table:  # nested: pickled by value, for the workers
        return pa.ipc.open_stream(data).read_all()

    def reduce(t: pa.Table):
        sink = pa.BufferOutputStream()
        with pa.ipc.new_stream(sink, t.schema) as writer:
            writer.write_table(t)
        return read, (sink.getvalue().to_pybytes(),)
    ray_mod.put(None)  # Ray registers its serializers on a process's first put: before
    with monkeypatch.context() as patch:
        patch.setitem(cloudpickle.CloudPickler.dispatch, pa.Table, reduce)
        return ray_mod.put(table)


def test_data_with_repeated_column_names_is_refused_before_the_shuffle(ray_local, tmp_path,
                                                                      monkeypatch):
    """Blocks with two columns named "a" started the shuffle and failed it in a task,
    inside Ray's serializer, with Arrow's bare 'Field "a" exists 2 times in schema'; a
    key of that name was refused as "not in the blocks' schema" while the message listed
    it. Refused up front now, naming the repeated name and the fix, which works."""
    cfg = base_config(tmp_path)
    table = pa.Table.from_arrays([pa.array([1, 2, 3]), pa.array([4, 5, 6]),
                                  pa.array(["x", "y", "z"])], names=["a", "a", "b"])
    ref = _put_as_ipc(ray_local, monkeypatch, table)
    ds = ray_local.data.from_arrow_refs([ref])
    for call in (lambda: hybrid_ray.repartition(ds, 2, keys=["b"], config=cfg),
                 lambda: hybrid_ray.repartition(ds, 2, keys=["a"], config=cfg),
                 lambda: hybrid_ray.sort(ds, "b", config=cfg),
                 lambda: hybrid_ray.random_shuffle(ds, config=cfg),
                 lambda: hybrid_ray.run_shuffle([ref], 2, hybrid_ray.HashPartitioner(["b"]),
                                                table.schema, cfg)):
        with pytest.raises(ConfigError, match=r"more than one column named 'a' \(its "
                                              r"columns are \['a', 'a', 'b'\]\).* Rename "
                                              r"them apart first, e.g. table.rename_columns"):
            call()
    renamed = table.rename_columns(["a", "a_2", "b"])
    result = hybrid_ray.run_shuffle([ray_local.put(renamed)], 2,
                                    hybrid_ray.HashPartitioner(["b"]), renamed.schema, cfg)
    assert row_fingerprint(ray_local.get(result.refs)) == row_fingerprint([renamed])
    assert_no_leftovers(cfg, ray_local)


def test_the_fix_named_for_blocks_of_different_schemas_works(ray_local, tmp_path):
    """The refusal of blocks whose schemas differ names a fix: following it must make the
    dataset shuffle. It said ``pyarrow.unify_schemas([...])``, which refuses int32 vs int64
    itself (ArrowTypeError), and ``t.cast(schema)``, which fails on another column order."""
    cfg = base_config(tmp_path)
    a = pa.table({"id": pa.array([1, 2], pa.int64()), "v": ["a", "b"]})
    b = pa.table({"v": ["c"], "id": pa.array([3], pa.int32())})
    ds = ray_local.data.from_arrow([a, b]).materialize()
    with pytest.raises(ConfigError) as err:
        hybrid_ray.repartition(ds, 2, keys=["v"], config=cfg)
    message = str(err.value)
    assert "promote_options='permissive'" in message
    assert "t.select(schema.names).cast(schema)" in message
    # The fix, as the message words it.
    schema = pa.unify_schemas([a.schema, b.schema], promote_options="permissive")
    fixed = ds.map_batches(lambda t: t.select(schema.names).cast(schema),
                           batch_format="pyarrow")
    out = outputs(ray_local, hybrid_ray.repartition(fixed, 2, keys=["v"], config=cfg))
    assert row_fingerprint(out) == row_fingerprint([a, b.select(a.schema.names).cast(a.schema)])
    assert_no_leftovers(cfg, ray_local)


def test_sort_by_a_dictionary_encoded_or_float16_key(ray_local, tmp_path):
    """Arrow cannot sort dictionary-encoded or float16 columns: a dataset whose blocks all
    had such a key ran every map, then failed in every reducer (ArrowNotImplementedError)."""
    cfg = base_config(tmp_path)
    rng = np.random.default_rng(23)
    words = [None if i % 9 == 0 else f"w{rng.integers(0, 500):03d}" for i in range(2_000)]
    halves = rng.integers(-500, 500, 2_000).astype(np.float16) / np.float16(4)
    table = pa.table({"word": pa.array(words).dictionary_encode(),
                      "half": pa.array(halves), "row": np.arange(2_000)})
    ds = ray_local.data.from_arrow(table).repartition(4).materialize()
    present = sorted(w for w in words if w is not None)
    for descending in (False, True):
        out = pa.concat_tables(outputs(ray_local, hybrid_ray.sort(
            ds, "word", descending=descending, config=cfg, num_partitions=3)))
        nulls = [None] * words.count(None)
        # Nulls last in both directions, as Ray Data's own sort puts them.
        assert out["word"].to_pylist() == (present[::-1] if descending else present) + nulls
        assert sorted(out["row"].to_pylist()) == list(range(2_000))
    out = pa.concat_tables(outputs(ray_local, hybrid_ray.sort(
        ds, "half", config=cfg, num_partitions=3)))
    assert out["half"].to_pylist() == sorted(float(h) for h in halves)
    assert_no_leftovers(cfg, ray_local)


def test_sort_by_a_time_of_day_key_with_nanoseconds(ray_local, tmp_path):
    """Keys were sampled and searched among the boundaries as Python ``datetime.time``
    objects, which hold no nanoseconds: sorting by a time64[ns] column with any value off
    the microsecond failed in the sampling ("Value 8548 has non-zero nanoseconds")."""
    cfg = base_config(tmp_path)
    rng = np.random.default_rng(29)
    nanos = rng.integers(0, 86_400 * 10**9, 2_000)
    times = pa.array(nanos, mask=np.arange(2_000) % 11 == 0).cast(pa.time64("ns"))
    table = pa.table({"t": times, "row": np.arange(2_000)})
    ds = ray_local.data.from_arrow(table).repartition(4).materialize()
    present = sorted(int(n) for n, null in zip(nanos, times.is_null().to_pylist()) if not null)
    nulls = [None] * times.null_count
    for descending in (False, True):
        out = pa.concat_tables(outputs(ray_local, hybrid_ray.sort(
            ds, "t", descending=descending, config=cfg, num_partitions=3)))
        assert out["t"].cast(pa.int64()).to_pylist() == \
            (present[::-1] if descending else present) + nulls
        assert sorted(out["row"].to_pylist()) == list(range(2_000))
    assert_no_leftovers(cfg, ray_local)


def test_sort_runs_while_other_work_holds_every_cpu(ray_local, tmp_path):
    """sort sampled its keys with tasks asking one CPU each: with every CPU held (RayDP's
    executors, a user's actors) it waited forever. The samples ask none now."""
    import threading

    @ray_local.remote(num_cpus=ray_local.cluster_resources()["CPU"])
    class HoldsEveryCpu:
        def ready(self):
            return True

    table = pa.table({"k": np.arange(5_000)[::-1].copy()})
    ds = ray_local.data.from_arrow(table).repartition(3).materialize()  # Ray Data needs CPUs
    holder = HoldsEveryCpu.remote()
    ray_local.get(holder.ready.remote(), timeout=60)
    try:
        result = {}
        job = threading.Thread(target=lambda: result.update(out=outputs(ray_local, hybrid_ray.sort(
            ds, "k", config=base_config(tmp_path), num_partitions=2))), daemon=True)
        job.start()
        job.join(timeout=120)
        assert "out" in result, "sort waited for a CPU"
        assert pa.concat_tables(result["out"])["k"].to_pylist() == list(range(5_000))
    finally:
        ray_local.kill(holder)


def test_datasets_of_pandas_blocks_shuffle_exactly(ray_local, tmp_path):
    """ray.data.from_pandas (and map_batches(batch_format="pandas")) make pandas blocks,
    which every public operation failed on with AttributeError ('DataFrame' object has no
    attribute 'schema')."""
    import pandas as pd

    cfg = base_config(tmp_path)
    frame = pd.DataFrame({"k": np.arange(3_000) % 17, "v": np.arange(3_000)[::-1].copy()})
    ds = ray_local.data.from_pandas([frame.iloc[:1_000], frame.iloc[1_000:]])
    expected = pa.Table.from_pandas(frame, preserve_index=False)
    out = outputs(ray_local, hybrid_ray.repartition(ds, 4, keys=["k"], config=cfg))
    assert row_fingerprint(out) == row_fingerprint([expected])
    keys_seen = [set(t["k"].to_pylist()) for t in out]
    assert sum(len(k) for k in keys_seen) == 17  # each key in one partition
    ordered = pa.concat_tables(outputs(ray_local, hybrid_ray.sort(ds, "v", config=cfg)))
    assert ordered["v"].to_pylist() == list(range(3_000))
    assert_no_leftovers(cfg, ray_local)


def test_a_block_whose_column_is_all_null_shuffles_with_typed_blocks(ray_local, tmp_path):
    """Ray Data types a column of a block whose values are all None as Arrow's null type
    (from_items, JSON): such a block was refused as of 'different schemas' beside blocks
    of the real type; it now takes the other blocks' type."""
    cfg = base_config(tmp_path)
    typed = pa.table({"k": pa.array([1, 2, 3], pa.int64()), "v": ["a", "b", "c"]})
    all_null = pa.table({"k": pa.nulls(2), "v": ["d", "e"]})
    ds = ray_local.data.from_arrow([all_null, typed]).materialize()
    out = outputs(ray_local, hybrid_ray.repartition(ds, 2, keys=["v"], config=cfg))
    assert all(t.schema.field("k").type == pa.int64() for t in out)
    rows = sorted((r["k"] or -1, r["v"]) for t in out for r in t.to_pylist())
    assert rows == [(-1, "d"), (-1, "e"), (1, "a"), (2, "b"), (3, "c")]
    assert_no_leftovers(cfg, ray_local)


def test_sort_places_nulls_last_ascending_and_descending_as_ray_data_does(ray_local,
                                                                          tmp_path):
    """Nulls and NaNs sort where Ray Data's own sort puts them: last in both directions,
    NaNs before nulls. Descending put them first (the docstring said Ray Data did; Ray 2.60
    gives ``[7, 3, 0, -1, nan, nan, None, None]``), so a job moved from ``ds.sort`` to
    ``hybrid_ray.sort`` got its rows in another order (found by a review)."""
    cfg = base_config(tmp_path)
    rng = np.random.default_rng(16)
    words = [None if i % 7 == 0 else f"w{rng.integers(0, 10**6):07d}" for i in range(3_000)]
    numbers = [None if i % 11 == 0 else float("nan") if i % 13 == 0 else float(v)
               for i, v in enumerate(rng.integers(-1000, 1000, 3_000))]
    table = pa.table({"word": words, "number": numbers, "row": np.arange(3_000)})
    ds = ray_local.data.from_arrow(table).repartition(5).materialize()
    present = sorted(w for w in words if w is not None)
    nulls = words.count(None)
    for descending in (False, True):
        out = pa.concat_tables(outputs(ray_local, hybrid_ray.sort(
            ds, "word", descending=descending, config=cfg, num_partitions=4)))
        expected = (present[::-1] if descending else present) + [None] * nulls
        assert out["word"].to_pylist() == expected
        assert [r["word"] for r in ds.sort("word", descending=descending).take_all()] \
            == expected  # Ray Data's own sort
        assert row_fingerprint([out]) == row_fingerprint([table])
    values = sorted(v for v in numbers if v is not None and v == v)
    nans = sum(1 for v in numbers if v is not None and v != v)
    none = numbers.count(None)
    for descending in (False, True):
        got = pa.concat_tables(outputs(ray_local, hybrid_ray.sort(
            ds, "number", descending=descending, config=cfg, num_partitions=3)))
        got = ["nan" if v is not None and v != v else v for v in got["number"].to_pylist()]
        expected = (values[::-1] if descending else values) + ["nan"] * nans + [None] * none
        assert got == expected
        own = [r["number"] for r in ds.sort("number", descending=descending).take_all()]
        assert ["nan" if v is not None and v != v else v for v in own] == expected
    assert_no_leftovers(cfg, ray_local)


def test_sort_by_several_keys_each_in_its_own_direction_as_ray_data_does(ray_local,
                                                                         tmp_path):
    """``sort`` took one key: a job sorting by (date, amount) with Ray Data's
    ``ds.sort(["a", "b"], descending=[False, True])`` could not move to hybrid_ray. Several
    keys, one direction for all or one per key, nulls and NaNs last in every key (a
    dictionary-encoded key too, which Ray Data's own multi-key sort refuses), each
    output partition holding one key range: the concatenated output is exactly Arrow's
    sort of the whole input, rows equal in every key aside."""
    cfg = base_config(tmp_path)
    rng = np.random.default_rng(31)
    n = 6_000
    score = rng.integers(0, 6, n).astype(float)
    score[rng.random(n) < 0.05] = np.nan
    table = pa.table({
        "score": pa.array(score, mask=rng.random(n) < 0.05),
        "name": pa.array([None if i % 17 == 0 else f"n{v:02d}"
                          for i, v in enumerate(rng.integers(0, 40, n))]),
        "amount": pa.array(rng.integers(0, 300, n)), "row": np.arange(n)})
    ds = ray_local.data.from_arrow(
        [table.slice(i, 1_000) for i in range(0, n, 1_000)]).materialize()
    encoded = table.set_column(1, "name", table["name"].dictionary_encode())
    ds_encoded = ray_local.data.from_arrow(
        [encoded.slice(i, 1_000) for i in range(0, n, 1_000)]).materialize()

    def keys_of(t: pa.Table) -> list[list]:
        # NaN as a string: NaN != NaN would fail equal lists.
        return [["nan" if v is not None and v != v else v for v in t[k].to_pylist()]
                for k in ("score", "name", "amount")]

    for descending in ([False, True, False], [True, False, True], True):
        flags = descending if isinstance(descending, list) else [descending] * 3
        expected = table.sort_by([(k, "descending" if d else "ascending", "at_end")
                                  for k, d in zip(("score", "name", "amount"), flags)])
        for source in (ds, ds_encoded):
            parts = outputs(ray_local, hybrid_ray.sort(
                source, ["score", "name", "amount"], descending=descending, config=cfg,
                num_partitions=4))
            assert len([p for p in parts if p.num_rows]) >= 3  # really range-partitioned
            out = pa.concat_tables([p.cast(parts[0].schema) for p in parts])
            out = out.set_column(1, "name", out["name"].cast(pa.string()))
            assert keys_of(out) == keys_of(expected)
            assert sorted(out["row"].to_pylist()) == list(range(n))
        own = pa.Table.from_pylist(ds.sort(["score", "name", "amount"],
                                           descending=descending).take_all())
        assert keys_of(own) == keys_of(expected)  # Ray Data's own sort agrees
    for key, descending, message in (
            (["score", "amount"], [True], r"descending must be True or False, got \[True\]; "
                                          r"or a list of one of them per sort key \(2 here\)"),
            ([], False, r"sort key must be a column name or a non-empty list of column "
                        r"names, got \[\]"),
            (["score", "score"], False, r"sort key names column\(s\) \['score'\] more "
                                        r"than once"),
            (["score", "nope"], False, r"unknown column\(s\) \['nope'\]")):
        with pytest.raises(ConfigError, match=message):
            hybrid_ray.sort(ds, key, descending=descending, config=cfg)
    assert_no_leftovers(cfg, ray_local)


def test_run_shuffle_and_sort_refuse_inputs_that_failed_only_inside_the_maps(ray_local):
    """Tables instead of refs, or a partitioner class instead of an instance, failed deep
    inside the dispatch or a map after the actors started; a sort by a struct or list key
    failed in the driver's sampling or in every reducer after the map phase."""
    from hybrid_ray import HashPartitioner

    table = pa.table({"a": [1, 2, 3]})
    with pytest.raises(ConfigError, match="ObjectRefs of Arrow tables"):
        hybrid_ray.run_shuffle([table], 2, HashPartitioner(["a"]), table.schema)
    with pytest.raises(ConfigError, match="list of ObjectRefs"):
        hybrid_ray.run_shuffle(ray_local.put(table), 2, HashPartitioner(["a"]), table.schema)
    with pytest.raises(ConfigError, match="Partitioner instance"):
        hybrid_ray.run_shuffle([ray_local.put(table)], 2, HashPartitioner, table.schema)
    for column in (pa.array([[1], [2]]), pa.array([{"x": 1}, {"x": 2}])):
        ds = ray_local.data.from_arrow(pa.table({"k": column, "v": [1, 2]}))
        with pytest.raises(ConfigError, match="cannot sort by column 'k' of type"):
            hybrid_ray.sort(ds, "k")


def test_run_shuffle_names_a_block_that_is_not_an_arrow_table(ray_local, tmp_path):
    """A reference to a pandas DataFrame (ray.put(df), a common slip) or to a list failed
    the map with Ray's "Attempting to call `get` on the value 'a', which is not an
    ray.ObjectRef": the map took the resolved value for a group of block references."""
    from hybrid_ray import HashPartitioner

    table = pa.table({"a": [1, 2, 3]})
    config = base_config(tmp_path)
    for value in (table.to_pandas(), [1, 2, 3]):
        with pytest.raises(ConfigError, match=r"input block 0 of map 0 is a .*, not a "
                           r"pyarrow.Table.*ray.put\(pa.Table.from_pandas"):
            hybrid_ray.run_shuffle([ray_local.put(value)], 2, HashPartitioner(["a"]),
                                   table.schema, config)
    out = hybrid_ray.run_shuffle([ray_local.put(table)] * 2, 2, HashPartitioner(["a"]),
                                 table.schema, config)
    assert sum(t.num_rows for t in ray_local.get(out.refs)) == 6


def test_a_tensor_column_shuffles_on_fresh_workers(ray_local, tmp_path):
    """A dataset with a Ray Data tensor column failed its first shuffle on fresh worker
    processes ("different schemas ... ArrowTensorTypeV2 vs large_list"): the schema
    reached the writers in Arrow's IPC form before Ray Data's extension types were
    registered there. Fresh workers here: a namespace of this test's own."""
    import uuid

    cfg = base_config(tmp_path, namespace=f"tensor-{uuid.uuid4().hex[:8]}")
    ds = ray_local.data.range_tensor(1_000, shape=(2, 2), override_num_blocks=4).materialize()
    source = pa.concat_tables(outputs(ray_local, ds))

    def rows(tables: list[pa.Table]) -> list[list[int]]:
        return sorted(row.ravel().tolist()
                      for t in tables for row in t.column("data").to_numpy())

    out = outputs(ray_local, hybrid_ray.random_shuffle(ds, seed=1, config=cfg))
    assert {t.schema.field("data").type for t in out if t.num_rows} \
        == {source.schema.field("data").type}
    assert rows(out) == rows([source])
    assert_no_leftovers(cfg, ray_local)


def test_a_union_of_arrow_and_pandas_blocks_shuffles_exactly(ray_local, tmp_path):
    """Only the dataset's schema (its first block's) was looked at: Arrow blocks followed
    by pandas ones reached the maps as DataFrames ("... which is not an ray.ObjectRef")
    and the sort's sampling ("AttributeError")."""
    import pandas as pd

    cfg = base_config(tmp_path)
    ds = ray_local.data.from_arrow(pa.table({"k": [5, 1, 4]})).union(
        ray_local.data.from_pandas(pd.DataFrame({"k": [3, 2, 6]}))).materialize()
    out = outputs(ray_local, hybrid_ray.repartition(ds, 2, keys=["k"], config=cfg))
    assert sorted(pa.concat_tables(out)["k"].to_pylist()) == [1, 2, 3, 4, 5, 6]
    ordered = pa.concat_tables(outputs(ray_local, hybrid_ray.sort(ds, "k", config=cfg)))
    assert ordered["k"].to_pylist() == [1, 2, 3, 4, 5, 6]
    assert_no_leftovers(cfg, ray_local)


def test_keys_and_columns_that_failed_inside_the_maps_are_handled_up_front(ray_local, tmp_path):
    """Each was accepted and failed after the actors started: a sort by a canonical
    extension type (uuid) in every reducer; a string_view or run-end encoded column
    (which Arrow cannot take rows of) in every map; a union key in every map; a
    dictionary sort key holding a null value in the driver's sampling. A range
    partitioner with string boundaries for an int key is refused (it sorted [0, 1, 2, 10,
    ..., 19, 3, ...] without a word). (List-view keys: test_partitioning.py; Ray's own
    serializer refuses tables holding them here.)"""
    from hybrid_ray import HashPartitioner, RangePartitioner

    cfg = base_config(tmp_path)
    uuids = ray_local.data.from_arrow(pa.table({"k": pa.array([b"1" * 16], pa.uuid())}))
    with pytest.raises(ConfigError, match="cannot sort by column 'k' of type "
                                          "extension<arrow.uuid>: its values have no order"):
        hybrid_ray.sort(uuids, "k", config=cfg)
    # (Tables holding these cannot even be ray.put here once Ray Data's serializer is
    # registered: "Unhandled Arrow array type": the schema is what is checked first.)
    plain = pa.table({"k": [1, 2, 3], "s": ["a", "b", "c"], "r": ["x", "x", "y"]})
    views = pa.schema([("k", pa.int64()), ("s", pa.string_view()),
                       ("r", pa.run_end_encoded(pa.int32(), pa.string()))])
    with pytest.raises(ConfigError, match=r"cannot shuffle column\(s\) 's' \(string_view\), "
                                          r"'r' \(run_end_encoded<.*\): Arrow .* cannot take"):
        hybrid_ray.run_shuffle([ray_local.put(plain)], 2, HashPartitioner(["k"]), views, cfg)
    union = pa.UnionArray.from_sparse(pa.array([0, 1], pa.int8()),
                                      [pa.array([1, 2]), pa.array(["a", "b"])])
    with pytest.raises(ConfigError, match="cannot partition by column 'k' .* is a union"):
        hybrid_ray.repartition(ray_local.data.from_arrow(pa.table({"k": union})), 2, ["k"],
                               config=cfg)
    null_in_dictionary = pa.DictionaryArray.from_arrays(
        pa.array([0, 1, 2, 1, 0, 2]), pa.array([None, "b", "a"]))
    ds = ray_local.data.from_arrow(pa.table({"k": null_in_dictionary, "v": range(6)}))
    ordered = pa.concat_tables(outputs(ray_local, hybrid_ray.sort(ds, "k", config=cfg)))
    assert ordered["k"].cast(pa.string()).to_pylist() == ["a", "a", "b", "b", None, None]
    table = pa.table({"k": np.arange(30)})
    with pytest.raises(ConfigError, match="boundaries .* are not values of its key column"):
        hybrid_ray.run_shuffle([ray_local.put(table)], 3, RangePartitioner("k", ["10", "20"]),
                               table.schema, cfg)
    # More boundaries than partitions: refused before anything runs (the rows beyond the
    # last partition were caught only inside a map, or not at all if none fell there).
    with pytest.raises(ConfigError, match=r"RangePartitioner has 4 boundaries, which make 5 "
                                          r"key ranges, but the shuffle has 3 partitions: "
                                          r"give at most 2 boundaries, or ask for 5"):
        hybrid_ray.run_shuffle([ray_local.put(table)], 3,
                               RangePartitioner("k", [100, 200, 300, 400]), table.schema, cfg)
    assert_no_leftovers(cfg, ray_local)

